"""Who reads each chunk from the bucket: HRW owners over the live set, computed once per epoch.

Source: rendezvous hashing (:mod:`bdn.proto.hrw`). Two refinements for large fleets:

- **Bucket readers.** A bucket serves ``aggregate_bps`` in total and ``per_connection_bps`` per
  connection, so ``ceil(headroom * aggregate / per_connection)`` connections saturate it (100 at
  10 GB/s and 100 MB/s; ``headroom`` 1.5 keeps it saturated while some finish). With one reader
  per node, N = 10,000 owners would each read one slow connection and every chunk would finish
  at the very end, with nothing left to overlap. So only the top ``readers`` nodes by HRW score
  of the snapshot's identity read from the bucket (each with ``connections_per_reader``
  connections), and a chunk's owner is the HRW top among those readers. The reader set differs
  per snapshot, so the role rotates over the fleet.
- **Once per epoch.** :class:`OwnerMap` is built from one membership epoch's live set; its
  owner lookups are memoised per chunk and the whole map is rebuilt only when the live set
  changes (``epoch`` differs), never per request: no ``chunks x N`` hashing before bytes move.

Pure: no clock is needed (the epoch is the caller's membership epoch).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from bdn.proto import hrw


def reader_count(
    live_n: int, aggregate_bps: float, per_connection_bps: float, connections_per_reader: int = 1,
    headroom: float = 1.5,
) -> int:
    """How many nodes read a snapshot from the bucket: enough connections to saturate it.

    ``aggregate_bps``/``per_connection_bps``: bytes per second (0 = unlimited per connection:
    then every live node reads). Returns an integer in ``[1, live_n]`` (0 when ``live_n`` is 0).
    """
    if live_n <= 0:
        return 0
    if per_connection_bps <= 0 or aggregate_bps <= 0:
        return live_n
    conns = math.ceil(headroom * aggregate_bps / per_connection_bps)
    return max(1, min(live_n, math.ceil(conns / max(1, connections_per_reader))))


class OwnerMap:
    """Owners of one snapshot's chunks for one membership epoch.

    ``live``: node ids of the epoch (this daemon included). ``identity``: the snapshot's
    identity (picks its readers). ``readers``: how many read from the bucket (see
    :func:`reader_count`; ``None`` = all). Keys are chunk digests (hex strings).
    """

    def __init__(self, epoch: int, live: Sequence[str], identity: str, readers: int | None = None) -> None:
        self.epoch = epoch
        self.live = tuple(sorted(set(live)))
        n = len(self.live) if readers is None else max(0, min(readers, len(self.live)))
        self.readers = tuple(hrw.rank(self.live, "readers\x00" + identity)[:n])
        self._reader_set = frozenset(self.readers)
        self._owner: dict[str, str | None] = {}

    def is_reader(self, node: str) -> bool:
        return node in self._reader_set

    def owner(self, digest: str) -> str | None:
        """The reader that fetches ``digest`` from the bucket (None with no live readers)."""
        o = self._owner.get(digest, "")
        if o == "":
            o = self._owner[digest] = hrw.owner(self.readers, digest)
        return o

    def ranked(self, digest: str) -> list[str]:
        """Readers from owner to last fallback for ``digest``."""
        return hrw.rank(self.readers, digest)

    def owned_by(self, node: str, digests: Sequence[str]) -> list[int]:
        """Indexes into ``digests`` that ``node`` owns, in order."""
        if node not in self._reader_set:
            return []
        return [i for i, d in enumerate(digests) if self.owner(d) == node]


class OwnerCache:
    """The current :class:`OwnerMap` per snapshot, rebuilt only when the epoch changes."""

    def __init__(self, max_snapshots: int = 8) -> None:
        self._maps: dict[str, OwnerMap] = {}
        self._max = max_snapshots
        self.rebuilds = 0

    def get(self, epoch: int, live: Sequence[str], identity: str, readers: int | None = None) -> OwnerMap:
        m = self._maps.get(identity)
        if m is None or m.epoch != epoch or (readers is not None and len(m.readers) != min(readers, len(m.live))):
            m = OwnerMap(epoch, live, identity, readers)
            self.rebuilds += 1
            self._maps.pop(identity, None)
            self._maps[identity] = m
            while len(self._maps) > self._max:
                self._maps.pop(next(iter(self._maps)))
        return m
