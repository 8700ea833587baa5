"""The transfer server's counters (bdn.transfer.server's connections, bdn.transfer.answer's
answers), read by the daemon's status and metrics."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServerStats:
    """Counters since start (read them any time; written under the server's lock)."""

    connections: int = 0
    handshakes_refused: int = 0
    protocol_errors: int = 0
    chunks_out: int = 0
    bytes_out: int = 0
    busy: int = 0
    not_here: int = 0
    aborted: int = 0  # answers cut off after their DATA header (peer gone, file shrank)
    handshakes_evicted: int = 0  # unauthenticated connections dropped to admit a newer one
    cut_through: int = 0  # answers sent cut-through (while the chunk landed from the bucket)
    takes: int = 0  # TAKE requests answered
    given: int = 0  # ... of which granted
