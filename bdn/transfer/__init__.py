"""bdn's transfer layer for chunk bytes (docs/decisions/0006-transfer-wire.md): persistent authenticated connections between
peer pairs, ``sendfile`` from the snapshot's shm file on the serving side, ``recv_into`` the
target file's mapping (or a per-stream buffer and ``pwrite``) with in-place xxh3 on the
receiving side, worker threads on both (every call on the byte path releases the GIL).

The wire format and handshake are in bdn.proto.wire (pure); this package does the I/O:

- ``TransferServer(keys, node_id, resolve, admit=...)``: ``start()`` beside the event loop
  (its own threads), ``forget(path)`` when a snapshot is collected, ``close()`` on shutdown.
- ``TransferClient(keys, node_id)``: ``fetch_into(peer, address, dest, offset, length, digest,
  wait_s=, snapshot=, abort=) -> FetchResult`` (OK / BUSY / NOT_HERE / CORRUPT / FAILED),
  ``Abort().set()`` to end one fetch whose asker gave up, ``close_peer(peer)`` when a member leaves; its streams are pooled per peer by
  bdn.transfer.streams (``StreamPool``, ``Peer``).
- ``FetchPool(client, workers)``: ``await pool.fetch(...)`` from asyncio, ``submit(...)`` for a
  ``concurrent.futures.Future``.
- bdn.transfer.target: ``reserve(fd, size)`` and ``map_target(fd, size)`` for target files.

How the daemon adopts it (bdn.daemon.serve.wire_peer): ``resolve`` answers from the chunk index
(address -> stored file, offset, length; only verified chunks are indexed); ``admit`` runs the
pure upload policy (slots, per-chunk fan-out, ``wait`` while this owner fetches the chunk) and
returns ``Granted(release)``, ``Busy(retry_after_s)`` or ``NOT_HERE``; each member advertises its
transfer port next to its URL; the fetcher maps FetchResult onto what ``_from_peer`` does today
(BUSY -> busy round, NOT_HERE -> next source, CORRUPT -> penalise, FAILED -> mark failed) and
indexes a chunk only after OK.
"""

from bdn.transfer.client import Abort, FetchResult, Outcome, TransferClient
from bdn.transfer.pool import FetchPool
from bdn.transfer.server import (
    GRANTED,
    NOT_HERE,
    Busy,
    Granted,
    TransferServer,
    admit_all,
)
from bdn.transfer.streams import HandshakeRefused, Peer

__all__ = [
    "Abort",
    "GRANTED",
    "NOT_HERE",
    "Busy",
    "FetchPool",
    "FetchResult",
    "Granted",
    "HandshakeRefused",
    "Outcome",
    "Peer",
    "TransferClient",
    "TransferServer",
    "admit_all",
]
