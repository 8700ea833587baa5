"""The chunk index of one node: swarm address / digest -> where the verified bytes live, the
chunks of snapshots in progress (``pending``), and the waiters of peers' parked requests.

Only verified chunks are ever registered (DESIGN.md, "Moving chunks": every chunk is hashed
before it is written or served). A chunk held by several snapshots is indexed once; when the
snapshot that holds the indexed copy is forgotten, another holder takes its place.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from bdn.daemon.snapshot import TERMINAL, Loc, SnapshotJob
from bdn.proto.manifest import ChunkRef


class ChunkIndex:
    """``address(digest) -> address`` is the swarm's keyed address (``SwarmKeys.address``)."""

    def __init__(self, address: Callable[[str], str]) -> None:
        self.address = address
        self.by_address: dict[str, Loc] = {}
        self.by_digest: dict[str, Loc] = {}
        self.pending: dict[str, tuple[SnapshotJob, str, ChunkRef]] = {}
        self._waiters: dict[str, asyncio.Event] = {}
        self._elsewhere: set[str] = set()  # read_elsewhere

    def register(self, job: SnapshotJob, layer: str, ref: ChunkRef) -> None:
        """Event: ``ref`` of ``job``'s ``layer`` is verified on disk; wake the requests waiting for it."""
        job.registered.append((layer, ref))
        loc = Loc(job, layer, ref.file_index, ref.offset, ref.length, ref.digest)
        addr = self.address(ref.digest)
        self.by_address.setdefault(addr, loc)
        self.by_digest.setdefault(ref.digest, loc)
        self._elsewhere.discard(addr)
        ev = self._waiters.pop(addr, None)
        if ev is not None:
            ev.set()

    def forget(self, job: SnapshotJob, others: Iterable[SnapshotJob]) -> None:
        """Drop ``job``'s chunks. Bytes that ``others`` hold too (an unchanged tokenizer, a shared
        chunk) stay served from one of those (failed snapshots excepted)."""
        lost: set[str] = set()
        for addr, loc in list(self.by_address.items()):
            if loc.job is job:
                del self.by_address[addr]
                lost.add(loc.digest)
        for dg, loc in list(self.by_digest.items()):
            if loc.job is job:
                del self.by_digest[dg]
                lost.add(dg)
        if lost:
            for other in others:
                if other is job or other.state == "failed":
                    continue
                for layer, ref in other.registered:
                    if ref.digest in lost and ref.digest not in self.by_digest:
                        loc = Loc(other, layer, ref.file_index, ref.offset, ref.length, ref.digest)
                        self.by_digest[ref.digest] = loc
                        self.by_address.setdefault(self.address(ref.digest), loc)
        for addr, (j, _, _) in list(self.pending.items()):
            if j is job:
                del self.pending[addr]

    def add_pending(self, job: SnapshotJob, layer: str, refs: Iterable[ChunkRef]) -> None:
        """``job`` is about to fetch ``refs``: a peer asking for one is told "still fetching"."""
        for ref in refs:
            self.pending.setdefault(self.address(ref.digest), (job, layer, ref))

    def drop_pending(self, job: SnapshotJob, refs: Iterable[ChunkRef]) -> None:
        """Forget ``job``'s pending chunks among ``refs`` (other jobs' entries for the same bytes stay)."""
        for ref in refs:
            addr = self.address(ref.digest)
            if self.pending.get(addr, (None,))[0] is job:
                del self.pending[addr]

    def drop_pending_of(self, job: SnapshotJob) -> None:
        """Forget every pending chunk of ``job`` (no keyed addresses computed: cheap for millions;
        safe on a worker thread while the loop reads the table)."""
        for addr, (j, _, _) in list(self.pending.items()):
            if j is job and self.pending.get(addr, (None,))[0] is job:
                self.pending.pop(addr, None)

    def pending_for(self, address: str) -> tuple[SnapshotJob, str, ChunkRef] | None:
        """``(job, layer, chunk)`` of the download that will hold ``address``, or None."""
        return self.pending.get(address)

    def fetching(self, address: str) -> bool:
        """True while ``address`` is a chunk of a snapshot in progress here, not yet held."""
        pend = self.pending.get(address)
        return pend is not None and pend[0].state not in TERMINAL and address not in self.by_address

    def quarantine(self, job: SnapshotJob, refs: list[ChunkRef], others: Iterable[SnapshotJob]) -> None:
        """Stop serving ``job``'s copies of ``refs`` (their bytes on disk are corrupted) at once;
        another snapshot holding the same bytes serves them instead (failed ones excepted)."""
        bad = {(r.file_index, r.offset) for r in refs}
        job.registered = [(lay, r) for lay, r in job.registered if (r.file_index, r.offset) not in bad]
        lost: set[str] = set()
        for ref in refs:
            addr = self.address(ref.digest)
            for table, key in ((self.by_address, addr), (self.by_digest, ref.digest)):
                loc = table.get(key)
                if loc is not None and loc.job is job and (loc.file_index, loc.offset) == (ref.file_index, ref.offset):
                    del table[key]
                    lost.add(ref.digest)
        for other in others:
            if other.state == "failed":
                continue
            for layer, ref in other.registered:
                if ref.digest in lost:
                    loc = Loc(other, layer, ref.file_index, ref.offset, ref.length, ref.digest)
                    self.by_digest.setdefault(ref.digest, loc)
                    self.by_address.setdefault(self.address(ref.digest), loc)

    def unindex(self, address: str) -> None:
        """Stop serving ``address`` (its bytes on disk turned out not to be what was indexed)."""
        loc = self.by_address.pop(address, None)
        if loc is not None and self.by_digest.get(loc.digest) is loc:
            del self.by_digest[loc.digest]

    def lookup(self, address: str) -> Loc | None:
        """The verified location of the chunk at swarm ``address`` on this node, or None."""
        return self.by_address.get(address)

    def by_content(self, digest: str) -> Loc | None:
        """A verified location of the bytes with xxh3-128 ``digest`` on this node, or None."""
        return self.by_digest.get(digest)

    def read_elsewhere(self, address: str) -> None:
        """Event: this node gave its bucket read of ``address`` up because another node reads
        it now (bdn.daemon.fetch.fetcher, ``steal_reads``). The requests parked here for it end
        at once (``elsewhere``: they answer busy, and the askers take the chunk from that node,
        cut-through) instead of waiting for this node to hold it. Cleared when it is registered."""
        self._elsewhere.add(address)
        self.wake(address)

    def elsewhere(self, address: str) -> bool:
        """Whether another node reads ``address`` for this one now (:meth:`read_elsewhere`)."""
        return address in self._elsewhere

    def wake(self, address: str) -> None:
        """Wake the requests waiting for ``address`` without registering it (the chunk started
        landing here from the bucket: a cut-through asker need not wait for the whole chunk)."""
        ev = self._waiters.pop(address, None)
        if ev is not None:
            ev.set()

    async def wait(self, address: str, timeout: float) -> Loc | None:
        """Wait up to ``timeout`` s for ``address`` to be registered; its location or None."""
        loc = self.by_address.get(address)
        if loc is not None:
            return loc
        ev = self._waiters.get(address)
        if ev is None:
            ev = self._waiters[address] = asyncio.Event()
        try:
            await asyncio.wait_for(ev.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        return self.by_address.get(address)
