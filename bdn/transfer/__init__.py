"""bdn's transfer layer for chunk bytes (issue 9): persistent authenticated connections between
peer pairs, ``sendfile`` from the snapshot's shm file on the serving side, ``recv_into`` the
target file's mapping with in-place xxh3 on the receiving side, worker threads for both.

The wire format and handshake are in bdn.proto.wire (pure); this package does the I/O.
"""

from bdn.transfer.client import FetchResult, HandshakeRefused, Outcome, Peer, TransferClient
from bdn.transfer.pool import FetchPool
from bdn.transfer.server import GRANTED, NOT_HERE, Busy, Granted, TransferServer, admit_all

__all__ = [
    "GRANTED", "NOT_HERE", "Busy", "FetchPool", "FetchResult", "Granted", "HandshakeRefused", "Outcome",
    "Peer", "TransferClient", "TransferServer", "admit_all",
]
