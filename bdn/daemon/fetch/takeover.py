"""Reads taken over at the end of a slow owner's list (``steal_reads``), both sides of them:
DESIGN.md, "Reads taken over at the end of an owner's list".

The taker: once this node's own bucket reads of an anchor are done, ``run`` picks, at most
``STEALERS`` at a time, the last chunk of the owner with the most chunks nobody holds or reads
yet (the pure choice ``policy.pick_steal``), asks that owner for it (``Sources.take``: ``TAKE`` on
the transfer wire) and, if granted, marks it: the chunk's acquisition here (``Fetcher``) reads it
from the bucket on its next round (``unmark``, ``reading_for_owner``).

The owner: ``give`` decides a peer's ``TAKE`` on the event loop, where every bucket read of this
node decides too, at its bucket slot, through ``claim()``. A read that passed its claim is never
given; a read given is never started while the taker is live (for ``GRANT_S`` at most); a chunk
is given once per download, ``MAX_GRANTS`` per taker at a time. That is what keeps a chunk read
from the bucket once: announcements alone (HAVE_GROWING), which ``claim()`` also honours, let two
reads start when both reached their slots within one announcement's flight.

State is per chunk key ``(identity, layer, position)``; nothing here does I/O but ``run``'s
``Sources.take``. Time comes from the injected clock.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

from bdn.control.owners import readers_and_rule
from bdn.daemon.config import Config
from bdn.daemon.fetch import policy
from bdn.daemon.fetch.haves import Haves
from bdn.daemon.observe.stats import Stats
from bdn.daemon.process.clock import Clock
from bdn.daemon.snapshots.layers import STORED
from bdn.daemon.snapshots.snapshot import SnapshotJob
from bdn.daemon.swarm.membership import Member, Membership
from bdn.proto.manifest import ChunkRef

#: Chunks at once this node reads for other owners, at the end of their lists, once its own
#: are all acquired (``steal_reads``): about the chunks one owner lands at once.
STEALERS = 2
#: An owner keeps this many of its not yet announced chunks (the front of its list: the ones it
#: is about to read) before another node takes its last one.
STEAL_MARGIN = 2
#: Seconds between looks for a chunk to take over when there was none.
STEAL_POLL_S = 0.25
#: Missing chunks above which no look is taken (each look scans them: the tail is what it is for).
STEAL_SCAN_LIMIT = 4096
#: Seconds a bucket read this node (the owner) gave up to a taker (``give``) stays the taker's:
#: the taker announces it within a round trip of its bucket slot (its own reads are done, its
#: slots free), after which the announcement keeps it; a taker that dies meanwhile leaves the
#: live set, which ends the grant at once. A chunk is given once per download, so a taker that
#: never reads (a secret holder) holds a chunk up this long, once, ``MAX_GRANTS`` at a time.
GRANT_S = 10.0
#: Grants one taker may hold here at once (it takes ``STEALERS`` at a time): a secret holder
#: asking for every chunk gets this many, then only refusals.
MAX_GRANTS = 2 * STEALERS

Key = tuple[str, str, int]  # (identity, layer, position)
Owner = Callable[[SnapshotJob, str, str, "list[str] | None"], "str | None"]
Ensure = Callable[[SnapshotJob, str, int, ChunkRef], Awaitable[None]]


class AskOwner(Protocol):
    """Where a taker asks an owner for its bucket read (``bdn.daemon.fetch.sources.Sources``)."""

    async def take(self, m: Member, identity: str, index: int) -> bool:
        """Whether member ``m``, the owner of stored chunk ``index`` of ``identity``, gave it up."""
        ...


class TakeOvers:
    """Both sides of reads taken over, for every download of this node (module docstring)."""

    def __init__(
        self,
        cfg: Config,
        membership: Membership,
        haves: Haves,
        sources: AskOwner,
        stats: Stats,
        clock: Clock,
    ) -> None:
        self.cfg = cfg
        self.node_id = cfg.node_id
        self.membership = membership
        self.haves = haves
        self.sources = sources  # ``take`` asks an owner
        self.stats = stats
        self.clock = clock
        #: Chunks this node was granted and reads for their owner on the acquisition's next round.
        self._marked: set[Key] = set()
        self._stealing: set[Key] = set()  # ... whose bucket read runs here now
        #: Chunks whose bucket read here passed its ``claim()`` (it holds its slot and reads).
        self._reading: set[Key] = set()
        #: Chunks whose bucket read this node gave up (``give``): key -> (taker's node id, until);
        #: kept after ``until`` (never given twice) until the download ends.
        self._given: dict[Key, tuple[str, float]] = {}
        #: identity -> the job whose stored layer is being fetched here (what ``give`` decides on).
        self._fetching: dict[str, SnapshotJob] = {}

    # ---- downloads ------------------------------------------------------------------------------
    def begin(self, job: SnapshotJob) -> None:
        """Event: this node starts fetching ``job``'s stored layer (``give`` may grant its chunks)."""
        self._fetching[job.identity] = job

    def end(self, job: SnapshotJob) -> None:
        """Event: that fetch ended: nothing of it is given any more, its grants are forgotten."""
        if self._fetching.get(job.identity) is job:
            del self._fetching[job.identity]
            for k in [k for k in self._given if k[0] == job.identity]:
                del self._given[k]

    # ---- the owner's side -----------------------------------------------------------------------
    def claim(self, job: SnapshotJob, layer: str, idx: int) -> Callable[[], bool]:
        """At the bucket slot of one read of chunk ``idx``: whether the read is still wanted.
        No when it was given to a live taker (``give``), or a live member (not penalised, not
        failed) announced the chunk, growing or held; a yes records the read as started, so it
        is never given (``read_ended`` when it is over). A peer's word alone never stops a read
        for longer than its penalty: a liar claiming every chunk is penalised at its first bad
        bytes, and its claims do not count meanwhile (tests/test_bad_input.py)."""
        key = (job.identity, layer, idx)

        def decide() -> bool:
            members = self.membership.live()
            given = self._given.get(key)
            if given is not None:
                taker, until = given
                if self.clock.monotonic() < until and any(m.node_id == taker for m in members):
                    return False  # given up to a live taker: it reads the chunk
            live = {m.url for m in members}
            if any(u in live for u in (*self.haves.holding(job, layer, idx), *self.haves.growing_at(job, layer, idx))):
                return False
            self._reading.add(key)
            return True

        return decide

    def read_ended(self, key: Key) -> None:
        """Event: a bucket read whose ``claim()`` said yes is over (verified, failed or given up)."""
        self._reading.discard(key)

    def give(self, node_id: str, identity: str, idx: int) -> bool:
        """Event (a peer's ``TAKE``, on the loop): whether this node gives its bucket read of
        stored chunk ``idx`` of ``identity`` up to the live member ``node_id``. Granted only for
        an anchor being fetched here whose chunk is neither held here nor being read here (its
        read has not passed ``claim()``) and was never given before, at most ``MAX_GRANTS`` per
        taker at once; the grant makes this node's ``claim()`` give the read up while the taker is
        live, for ``GRANT_S`` at most."""
        job = self._fetching.get(identity)
        if job is None or not self.cfg.steal_reads or job.manifest is None or job.manifest.is_delta:
            return False
        bits = job.bits(STORED)
        key = (identity, STORED, idx)
        if bits is None or not 0 <= idx < bits.n or bits[idx] or key in self._reading or key in self._stealing:
            return False
        if key in self._given or not any(m.node_id == node_id for m in self.membership.live()):
            return False
        now = self.clock.monotonic()
        if sum(1 for taker, until in self._given.values() if taker == node_id and until > now) >= MAX_GRANTS:
            return False
        self._given[key] = (node_id, now + GRANT_S)
        self.stats.add("bucket_reads_given")
        return True

    # ---- the taker's side -----------------------------------------------------------------------
    def may_steal(self, job: SnapshotJob, nodes: list[str], missing: int) -> bool:
        """Whether this node takes over other owners' last chunks in this download: only when
        every node is in its peer set (the owner's announcements reach this node), the layer is
        small enough to scan (``policy.ORDER_LIMIT``), an anchor, and this node reads from the
        bucket at all (``bucket_readers``)."""
        if not self.cfg.steal_reads or len(nodes) > self.haves.k + 1 or missing > policy.ORDER_LIMIT:
            return False
        if job.manifest is None or job.manifest.is_delta:
            # anchors only: a delta folded here may take a subset of its stored chunks, numbered
            # otherwise than at the peers that load it whole, so positions would not name the
            # same chunk at both ends
            return False
        readers, _ = readers_and_rule(job.identity, nodes, self.cfg.bucket_readers)
        return self.node_id in readers

    def unmark(self, key: Key) -> bool:
        """Whether chunk ``key`` was granted to this node and not yet taken up (it is no longer,
        after this call): the acquisition reads it from the bucket now unless someone holds it."""
        if key in self._marked:
            self._marked.discard(key)
            return True
        return False

    @contextmanager
    def reading_for_owner(self, key: Key) -> Iterator[None]:
        """The span of this node's bucket read of a chunk granted to it."""
        self._stealing.add(key)
        try:
            yield
        finally:
            self._stealing.discard(key)
            self._reading.discard(key)

    async def run(
        self,
        job: SnapshotJob,
        layer: str,
        mine: list[asyncio.Task[None]],
        owner: Owner,
        ensure: Ensure,
        acquiring: Callable[[SnapshotJob, str, int], bool],
    ) -> None:
        """Once this node's own chunks (the tasks ``mine``) are all acquired: over and over, the
        last chunk of the owner with the most chunks nobody holds or reads yet
        (``policy.pick_steal``; ``owner(job, layer, digest, nodes)`` says whose) is asked of that
        owner (``TAKE``), at most ``STEALERS`` at a time, and when granted marked and acquired
        here (``ensure(job, layer, position, ref)``, started if no acquisition is on it:
        ``acquiring(job, layer, position)``, woken if
        one sleeps). A refused position is not asked again in this download. Ends with the
        layer (cancelled by the fetcher)."""
        if mine:
            await asyncio.wait(mine)
        refs, bits = job.refs(layer), job.bits(layer)
        assert bits is not None
        dig = getattr(refs, "digest", None) or (lambda i: refs[i].digest)
        started: set[asyncio.Future[None]] = set()

        def ended(f: asyncio.Future[None]) -> None:
            started.discard(f)
            if not f.cancelled():
                f.exception()  # retrieved, as before: asyncio does not log it as never retrieved

        refused: set[int] = set()  # positions whose owner reads (or holds) them: not asked again
        try:
            while bits.count < bits.n:
                ours = [k for k in (*self._marked, *self._stealing) if k[0] == job.identity and k[1] == layer]
                for k in ours:
                    if bits[k[2]]:
                        self._marked.discard(k)  # it came from elsewhere first
                if len(ours) >= STEALERS or bits.n - bits.count > STEAL_SCAN_LIMIT:
                    await asyncio.sleep(STEAL_POLL_S)  # (over the limit: the tail is not here yet)
                    continue
                nodes = self.membership.hrw_nodes()
                remaining: dict[str, list[int]] = {}
                for i in bits.clear_positions():
                    i = int(i)
                    if (job.identity, layer, i) in self._marked or i in refused:
                        continue
                    o = owner(job, layer, dig(i), nodes)
                    if (
                        o is None
                        or o == self.node_id
                        or not self.haves.synced(job, o)
                        or self.haves.holding(job, layer, i)
                        or self.haves.growing_at(job, layer, i)
                    ):
                        continue
                    remaining.setdefault(o, []).append(i)
                pick = policy.pick_steal(remaining, STEAL_MARGIN)
                if pick is None:
                    await asyncio.sleep(STEAL_POLL_S)
                    continue
                o, i = pick
                key = (job.identity, layer, i)
                m = next((m for m in self.membership.live() if m.node_id == o), None)
                # the owner decides, on its own loop where its reads decide: a read it has started
                # is never given, one it gave is never started
                if m is None or not await self.sources.take(m, job.identity, i):
                    refused.add(i)
                    continue
                if bits[i]:
                    continue
                self._marked.add(key)
                self.haves.wake(key)
                if not acquiring(job, layer, i):
                    f: asyncio.Future[None] = asyncio.ensure_future(ensure(job, layer, i, refs[i]))
                    started.add(f)
                    f.add_done_callback(ended)
                await asyncio.sleep(0)
        finally:
            for k in [k for k in self._marked if k[0] == job.identity and k[1] == layer]:
                self._marked.discard(k)
            for f in list(started):
                f.cancel()


__all__ = ["GRANT_S", "MAX_GRANTS", "STEALERS", "TakeOvers"]
