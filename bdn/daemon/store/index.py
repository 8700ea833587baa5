"""The chunk index of one node: swarm address / digest -> where the verified bytes live, the
chunks of snapshots in progress (``pending``), and the waiters of peers' parked requests.

Only verified chunks are ever registered (DESIGN.md, "Moving chunks": every chunk is hashed
before it is written or served). A chunk held by several snapshots is served from one of them;
when the snapshot that serves it is forgotten, another holder takes its place.

**Compact**: a snapshot of a million chunks costs no Python object per chunk
here. The index keeps one :class:`_Segment` per (snapshot, layer): the layer's keyed addresses as
two sorted ``uint64`` columns plus the position each came from (``uint32``), and two byte masks,
``pending`` (the snapshot is about to fetch it) and ``held`` (verified here). That is 22 bytes
per chunk, against ~900 for the dicts of ``ChunkRef`` / ``Loc`` objects
(docs/decisions/0018-compact-chunk-state.md); the ``ChunkRef`` / ``Loc`` of a chunk is built only when a lookup answers it.
A full snapshot's two layers list the same digests in the same order and share one set of
columns. Building a segment computes one keyed address per chunk (seconds for millions): callers
do it on a worker thread (``add_pending``, :meth:`prepare`).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from bdn.daemon.snapshots.layers import RESULT, STORED
from bdn.daemon.snapshots.snapshot import TERMINAL, Loc, SnapshotJob
from bdn.proto.manifest import ChunkRef

_BLOCK = 1 << 16  # addresses joined and decoded per step while a segment is built


def _key(address: str) -> tuple[int, int] | None:
    """The two signed 64-bit halves of a 32-hex-digit swarm address, or None if it is not one."""
    if len(address) != 32:
        return None
    try:
        raw = bytes.fromhex(address)
    except ValueError:
        return None
    return int.from_bytes(raw[:8], "big", signed=True), int.from_bytes(raw[8:], "big", signed=True)


class _Columns:
    """The sorted keyed addresses of one layer's chunks: ``hi``/``lo`` halves (signed, so that a
    lookup passes plain ints), ``pos`` their positions."""

    __slots__ = ("hi", "lo", "pos")

    def __init__(self, digests: Iterable[str], n: int, address: Callable[[str], str]) -> None:
        buf = bytearray(16 * n)
        at, block = 0, []
        for d in digests:
            block.append(address(d))
            if len(block) == _BLOCK:
                raw = bytes.fromhex("".join(block))
                buf[at : at + len(raw)] = raw
                at += len(raw)
                block = []
        if block:
            raw = bytes.fromhex("".join(block))
            buf[at : at + len(raw)] = raw
            at += len(raw)
        assert at == 16 * n, (at, n)
        halves = np.frombuffer(bytes(buf), dtype=">i8").reshape(n, 2)
        del buf
        hi, lo = halves[:, 0].astype(np.int64), halves[:, 1].astype(np.int64)
        order = np.lexsort((lo, hi))  # stable: equal addresses stay in position order
        self.hi, self.lo = hi[order], lo[order]
        self.pos = order.astype(np.uint32)

    def positions(self, key: tuple[int, int]) -> np.ndarray | None:
        """Positions (ascending) of the chunks at the address ``key``, or None."""
        hi, lo = key
        a = int(self.hi.searchsorted(hi))
        if a >= len(self.hi) or self.hi[a] != hi:
            return None
        b = int(self.hi.searchsorted(hi, "right"))
        match = self.pos[a:b][self.lo[a:b] == lo]
        return match if len(match) else None

    def first(self, key: tuple[int, int], mask: np.ndarray) -> int | None:
        """The lowest position at the address ``key`` whose ``mask`` entry is set, or None."""
        hi, lo = key
        a = int(self.hi.searchsorted(hi))
        n = len(self.hi)
        if a >= n or self.hi[a] != hi:
            return None
        if a + 1 == n or self.hi[a + 1] != hi:  # the usual case: one chunk at this address
            p = int(self.pos[a])
            return p if self.lo[a] == lo and mask[p] else None
        ps = self.positions(key)
        if ps is None:
            return None
        ps = ps[mask[ps]]
        return int(ps[0]) if len(ps) else None


class _Segment:
    """One layer of one snapshot in the index: its chunks' addresses and two masks."""

    __slots__ = ("job", "layer", "refs", "cols", "pending", "held", "any_pending", "any_held")

    def __init__(self, job: SnapshotJob, layer: str, refs: Sequence[ChunkRef], cols: _Columns) -> None:
        self.job, self.layer, self.refs, self.cols = job, layer, refs, cols
        n = len(refs)
        self.pending = np.zeros(n, dtype=bool)
        self.held = np.zeros(n, dtype=bool)
        self.any_pending = self.any_held = False  # (never cleared by quarantine / unindex: a hint)

    def live(self) -> bool:
        """Not a stale layer (its snapshot's table was replaced) nor a failed snapshot's."""
        return self.refs is self.job.refs(self.layer) and self.job.state != "failed"

    def loc(self, p: int) -> Loc:
        ref = self.refs[p]
        return Loc(self.job, self.layer, ref.file_index, ref.offset, ref.length, ref.digest)

    def position_of(self, ref: ChunkRef) -> int | None:
        """Where ``ref`` (a chunk of this layer) is, or None if it is not one of this layer's."""
        holds = getattr(self.refs, "holds", None)
        if holds is not None:
            return holds(ref)
        for p, have in enumerate(self.refs):  # a plain sequence (not a ChunkList): small
            if (have.file_index, have.offset, have.digest) == (ref.file_index, ref.offset, ref.digest):
                return p
        return None


def _digests(refs: Sequence[ChunkRef]) -> Iterable[str]:
    digests = getattr(refs, "digests", None)
    return digests() if digests is not None else (r.digest for r in refs)


class ChunkIndex:
    """``address(digest) -> address`` is the swarm's keyed address (``SwarmKeys.address``)."""

    def __init__(self, address: Callable[[str], str]) -> None:
        self.address = address
        self._segments: list[_Segment] = []  # creation order; replaced whole, never changed in place
        self._by_layer: dict[tuple[SnapshotJob, str], _Segment] = {}
        self._lock = threading.Lock()  # segments are built on worker threads too
        self._waiters: dict[str, asyncio.Event] = {}
        self._elsewhere: set[str] = set()  # read_elsewhere

    # ---- segments ------------------------------------------------------------------------
    def _current(self, job: SnapshotJob, layer: str) -> _Segment | None:
        seg = self._by_layer.get((job, layer))
        return seg if seg is not None and seg.refs is job.refs(layer) else None

    def prepare(self, job: SnapshotJob, layer: str) -> None:
        """Build ``job``'s ``layer`` segment now (one keyed address per chunk: call it on a worker
        thread for a big snapshot) so that registering its chunks later is cheap."""
        self._segment(job, layer)

    def _segment(self, job: SnapshotJob, layer: str) -> _Segment:
        seg = self._current(job, layer)
        if seg is not None:
            return seg
        refs = job.refs(layer)
        cols = None
        m = job.manifest
        if m is not None and not any(f.is_diff for f in m.files):
            twin = self._current(job, RESULT if layer == STORED else STORED)  # same digests, same order
            if twin is not None:
                cols = twin.cols
        if cols is None:
            cols = _Columns(_digests(refs), len(refs), self.address)
        with self._lock:
            seg = self._current(job, layer)
            if seg is not None:  # another thread built it meanwhile
                return seg
            seg = _Segment(job, layer, refs, cols)
            old = self._by_layer.get((job, layer))
            self._by_layer[(job, layer)] = seg
            self._segments = [s for s in self._segments if s is not old] + [seg]
        return seg

    def _drop(self, keep: Callable[[_Segment], bool]) -> None:
        with self._lock:
            self._segments = [s for s in self._segments if keep(s)]
            self._by_layer = {(s.job, s.layer): s for s in self._segments}

    def _held(self, address: str) -> tuple[_Segment, int] | None:
        key = _key(address)
        if key is None:
            return None
        for seg in self._segments:
            if not (seg.any_held and seg.live()):
                continue
            p = seg.cols.first(key, seg.held)
            if p is not None:
                return seg, p
        return None

    # ---- events --------------------------------------------------------------------------
    def register(self, job: SnapshotJob, layer: str, ref: ChunkRef) -> None:
        """Event: ``ref`` of ``job``'s ``layer`` is verified on disk; wake the requests waiting for it."""
        seg = self._segment(job, layer)
        p = seg.position_of(ref)
        if p is None:
            raise ValueError(f"{ref} is not a chunk of {job.identity}'s {layer} layer")
        seg.held[p] = True
        seg.any_held = True
        if self._waiters or self._elsewhere:
            addr = self.address(ref.digest)
            self._elsewhere.discard(addr)
            ev = self._waiters.pop(addr, None)
            if ev is not None:
                ev.set()

    def forget(self, job: SnapshotJob, others: Iterable[SnapshotJob] = ()) -> None:
        """Drop ``job``'s chunks, held and pending. Bytes that other snapshots hold too (an
        unchanged tokenizer, a shared chunk) stay served from one of those (failed ones excepted).
        (``others`` is accepted for the callers' sake: every snapshot's segment is searched anyway.)"""
        self._drop(lambda s: s.job is not job)

    def add_pending(self, job: SnapshotJob, layer: str, refs: Iterable[ChunkRef]) -> None:
        """``job`` is about to fetch ``refs``: a peer asking for one is told "still fetching".
        Builds the layer's segment if needed (a keyed address per chunk: a worker thread's job)."""
        seg = self._segment(job, layer)
        if refs is seg.refs:
            seg.pending[:] = True
        else:
            for ref in refs:
                p = seg.position_of(ref)
                if p is not None:
                    seg.pending[p] = True
        seg.any_pending = True

    def drop_pending(self, job: SnapshotJob, refs: Iterable[ChunkRef]) -> None:
        """Forget ``job``'s pending chunks among ``refs`` (other jobs' entries for the same bytes stay)."""
        for ref in refs:
            key = _key(self.address(ref.digest))
            for seg in self._segments:
                if seg.job is job and key is not None:
                    ps = seg.cols.positions(key)
                    if ps is not None:
                        seg.pending[ps] = False

    def drop_pending_of(self, job: SnapshotJob) -> None:
        """Forget every pending chunk of ``job`` (no keyed addresses computed: cheap for millions;
        safe on a worker thread while the loop reads the index)."""
        for seg in self._segments:
            if seg.job is job:
                seg.any_pending = False
                seg.pending[:] = False

    def quarantine(self, job: SnapshotJob, refs: list[ChunkRef], others: Iterable[SnapshotJob] = ()) -> None:
        """Stop serving ``job``'s copies of ``refs`` (their bytes on disk are corrupted) at once;
        another snapshot holding the same bytes serves them instead (failed ones excepted)."""
        for seg in self._segments:
            if seg.job is not job:
                continue
            for ref in refs:
                p = seg.position_of(ref)
                if p is not None:
                    seg.held[p] = False

    def unindex(self, address: str) -> None:
        """Stop serving the copy of ``address`` that :meth:`lookup` answers (its bytes on disk
        turned out not to be what was indexed)."""
        found = self._held(address)
        if found is not None:
            seg, p = found
            seg.held[p] = False

    # ---- queries -------------------------------------------------------------------------
    def pending_for(self, address: str) -> tuple[SnapshotJob, str, ChunkRef] | None:
        """``(job, layer, chunk)`` of the download that will hold ``address`` (the first snapshot
        to list it, its first chunk at that address), or None."""
        key = _key(address)
        if key is None:
            return None
        for seg in self._segments:
            if not (seg.any_pending and seg.refs is seg.job.refs(seg.layer)):
                continue
            p = seg.cols.first(key, seg.pending)
            if p is not None:
                return seg.job, seg.layer, seg.refs[p]
        return None

    def fetching(self, address: str) -> bool:
        """True while ``address`` is a chunk of a snapshot in progress here, not yet held."""
        pend = self.pending_for(address)
        return pend is not None and pend[0].state not in TERMINAL and self._held(address) is None

    def lookup(self, address: str) -> Loc | None:
        """The verified location of the chunk at swarm ``address`` on this node, or None."""
        found = self._held(address)
        return found[0].loc(found[1]) if found is not None else None

    def by_content(self, digest: str) -> Loc | None:
        """A verified location of the bytes with xxh3-128 ``digest`` on this node, or None."""
        return self.lookup(self.address(digest))

    def chunks(self) -> dict[str, int]:
        """How many chunk positions the index covers, and how many are pending / held (metrics, tests)."""
        segs = self._segments
        return {
            "positions": sum(len(s.held) for s in segs),
            "pending": sum(int(s.pending.sum()) for s in segs if s.any_pending),
            "held": sum(int(s.held.sum()) for s in segs),
        }

    # ---- parked requests -------------------------------------------------------------------
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
        loc = self.lookup(address)
        if loc is not None:
            return loc
        ev = self._waiters.get(address)
        if ev is None:
            ev = self._waiters[address] = asyncio.Event()
        try:
            await asyncio.wait_for(ev.wait(), timeout)
        except TimeoutError:
            pass
        return self.lookup(address)
