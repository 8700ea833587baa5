"""Runs the fetch plan (``bdn.daemon.fetch.policy``) for every chunk of a snapshot's layer.

For one chunk: this node's own store, then round after round of the plan's steps (holders, the
endgame race, owners with ``?wait=``, this node's own bucket read when it is the owner), then
the bucket as a counted fallback. One acquisition per chunk however many ask (single-flight);
owned chunks have workers of their own, since the other nodes wait on them.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Iterable

from bdn.control.owners import readers_and_rule
from bdn.daemon.config import Config
from bdn.daemon.errors import NotAvailable, Superseded
from bdn.daemon.fetch import policy
from bdn.daemon.fetch.haves import Haves
from bdn.daemon.fetch.owners import Owners
from bdn.daemon.fetch.sources import Sources
from bdn.daemon.fetch.takeover import TakeOvers
from bdn.daemon.observe.chunklog import ChunkLog
from bdn.daemon.observe.memtrim import IdleTrim
from bdn.daemon.observe.stats import Stats
from bdn.daemon.process.clock import Clock
from bdn.daemon.serve.transfer_address import wired
from bdn.daemon.snapshots.events import ChunkVerified, LayerStarted
from bdn.daemon.snapshots.snapshot import RESULT, STORED, SnapshotJob
from bdn.daemon.store.index import ChunkIndex
from bdn.daemon.swarm.membership import Member, Membership
from bdn.proto.manifest import ChunkRef

HAVES_FIRST_S = 5.0
#: Requests of ours an owner whose announcements we receive may have in flight before another
#: acquisition of its chunks waits for its HAVE_GROWING instead of parking there too.
PARK_AHEAD = 1
#: Workers per stored layer that take the chunks peers announce growing (cut-through): one per
#: chunk landing at the other owners at once (about 2 per owner: 14 at N = 8; with 8, half of
#: them went store-and-forward). Still bounded by ``max_inflight`` peer requests in all.
CUT_WORKERS = 16


def _views(members: list[Member]) -> tuple[list[policy.PeerView], dict[str, Member]]:
    """The chunk peers among ``members`` (those with a transfer address: ``wired``), as the plan
    sees them and by URL."""
    members = wired(members)
    return [policy.PeerView(m.url, m.node_id, m.inflight) for m in members], {m.url: m for m in members}


class Fetcher:
    """Executes the fetch plan for the chunks of a layer; the only caller of the chunk-verified event."""

    def __init__(
        self,
        cfg: Config,
        membership: Membership,
        index: ChunkIndex,
        haves: Haves,
        sources: Sources,
        stats: Stats,
        clock: Clock,
        rng: random.Random | None = None,
        *,
        chunk_log: ChunkLog | None = None,
        on_indexed: Callable[[SnapshotJob, str, int], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.node_id = cfg.node_id
        self.membership = membership
        self.index = index
        self.haves = haves
        self.sources = sources
        self.stats = stats
        self.clock = clock
        self.rng = rng or random.Random()
        self.chunk_log = chunk_log  # the config key chunk_log's per-chunk lines, or None
        self.owners = Owners()
        #: Event hook (job, layer, position): a chunk was verified and indexed here (the transfer
        #: wire's HAVE feed announces it to the subscribed peers, bdn.transfer.announce).
        self.on_indexed = on_indexed
        #: Reads taken over at the end of a slow owner's list, both ways (``steal_reads``).
        self.takeovers = TakeOvers(cfg, membership, haves, sources, stats, clock)
        #: Single-flight: the chunk acquisitions running, by job and ``(layer, position)``.
        self._inflight: dict[SnapshotJob, dict[tuple[str, int], asyncio.Future[None]]] = {}
        self._layers = 0  # fetch_layer calls running (the buffer pool is cleared when none is)
        self.idle_trim = IdleTrim(clock)  # the C heap's free pages go back when none is, too

    def owner(self, job: SnapshotJob, layer: str, digest: str, nodes: list[str] | None = None) -> str | None:
        """The node that reads chunk ``digest`` of ``layer`` from the bucket, among ``nodes``
        (default: this node and the live members): HRW with bounded loads
        (``bdn.daemon.fetch.owners``), or reader slots when ``bucket_readers`` picks a subset;
        the same answer on every daemon with the same live set."""
        refs = job.refs(layer)
        nodes = self.membership.hrw_nodes() if nodes is None else nodes
        nodes, bounded = readers_and_rule(job.identity, nodes, self.cfg.bucket_readers)  # bdn.control.owners
        dig = getattr(refs, "digest", None)
        digests = (lambda: [dig(i) for i in range(len(refs))]) if dig else (lambda: [r.digest for r in refs])
        if not bounded:
            return self.owners.slot_owner((job.identity, layer), nodes, digest, digests, len(refs))
        return self.owners.owner((job.identity, layer), nodes, digest, digests, len(refs))

    def workers(self) -> int:
        """How many chunks of a layer are acquired at once: enough to keep every peer slot
        (``max_inflight``) and bucket slot (``bucket_concurrency``) busy, with room for chunks
        parked at owners, and never one task per chunk (a manifest may list millions)."""
        return 2 * (self.cfg.max_inflight + self.cfg.bucket_concurrency)

    async def fetch_layer(self, job: SnapshotJob, layer: str) -> None:
        """Obtain every chunk of ``layer``. Raises NotAvailable (a rebuilt chunk no peer has),
        BdnError/ProtocolError (the bucket failed).

        Bounded sets of worker coroutines pull chunk positions from :func:`policy.split_owned`: a
        few (``bucket_concurrency + 1``) the chunks this node owns (the bucket reads them one
        after another, the other nodes wait on them), :meth:`workers` the rest, in the order
        their owners read them; each acquisition retries within its own worker (``policy.Rounds``)."""
        refs, bits = job.refs(layer), job.bits(layer)
        assert bits is not None
        job.apply(LayerStarted(layer))
        # Learn who already holds what before anything starts, so that a late joiner takes from
        # peers what they have rather than reading its own HRW share from the bucket.
        try:
            await asyncio.wait_for(self.haves.refresh(job), HAVES_FIRST_S)
        except TimeoutError:
            pass
        nodes = self.membership.hrw_nodes()
        dig = getattr(refs, "digest", None) or (lambda i: refs[i].digest)
        owned, others = policy.split_owned(
            bits, nodes, self.node_id, self.rng, lambda i: self.owner(job, layer, dig(i), nodes)
        )
        poller = asyncio.create_task(self.haves.poll(job))
        if layer == STORED:
            self.takeovers.begin(job)
        self._layers += 1

        async def worker(order: Iterable[int | None]) -> None:
            for i in order:
                if i is None:
                    await asyncio.sleep(0)  # a long stretch of held chunks: let the loop run
                elif not bits[i]:
                    await self._ensure(job, layer, i, refs[i])

        async def cut_worker() -> None:
            # A chunk a peer announced it is reading from the bucket now, which no acquisition
            # here is on: take it now, cut-through, rather than when the workers' order reaches
            # it (the owners' read order is not exactly the order the workers expect, and a chunk
            # missed while it grows is taken much later, from a holder).
            while True:
                i = await self.haves.next_growing(job)
                if i < bits.n and not bits[i] and not self.acquiring(job, layer, i):
                    await self._ensure(job, layer, i, refs[i])

        try:
            # Owned chunks have workers of their own (the bucket reads them one after another:
            # a few keep it busy), so that they never hold up the peer workers asking for the
            # chunks the other owners are reading.
            left = max(1, bits.n - bits.count)
            mine = [asyncio.create_task(worker(owned)) for _ in range(min(self.cfg.bucket_concurrency + 1, left))]
            tasks = mine + [asyncio.create_task(worker(others)) for _ in range(min(self.workers(), left))]
            wired = layer == STORED and self.cfg.cut_through and self.haves.subscriber is not None
            cut = [asyncio.create_task(cut_worker()) for _ in range(CUT_WORKERS)] if wired else []
            if wired and self.takeovers.may_steal(job, nodes, bits.n - bits.count):
                cut.append(
                    asyncio.create_task(self.takeovers.run(job, layer, mine, self.owner, self._ensure, self.acquiring))
                )
            try:
                await asyncio.gather(*tasks)
            except BaseException:
                # The acquisitions run shielded (single-flight), so cancelling their waiters alone
                # would leave them running: writing into files this job abandons (result mode
                # falling back to the chain) and dying with unretrieved exceptions.
                acquiring = [f for (lay, _), f in list(self._inflight.get(job, {}).items()) if lay == layer]
                for t in (*tasks, *acquiring):
                    t.cancel()
                await asyncio.gather(*tasks, *acquiring, return_exceptions=True)
                raise
            finally:
                for t in cut:
                    t.cancel()
                await asyncio.gather(*cut, return_exceptions=True)
        finally:
            poller.cancel()
            if layer == STORED:
                self.takeovers.end(job)
            # The bitfields served this download only: kept, they would pile up one table of
            # N peers' bitfields per snapshot ever fetched (a later fetch asks afresh first).
            self.haves.forget(job.identity)
            self.owners.forget((job.identity, layer))
            self._layers -= 1
            if not self._layers:
                # No download runs: the chunk buffers its endgame races used go
                # back to the system now, not when the pool's bound pushes them out
                # (sources.BufferPool), and so do the wire's receive buffers (one per fetch that
                # ran at once: bdn.transfer.receive.Rings).
                self.sources.release_buffers()
                # And the C heap's free pages, which glibc keeps resident in the middle of its
                # threads' arenas (bdn.daemon.observe.memtrim; at most once per 30 s), on a disk thread:
                # the walk of a large heap must not hold the event loop.
                if self.idle_trim.due():
                    loop = asyncio.get_running_loop()

                    def trim() -> None:  # counted when it ran: two ends queued before it run it once
                        if self.idle_trim.maybe():
                            loop.call_soon_threadsafe(self.stats.add, "heap_trims")

                    try:
                        self.sources.disk_pool.submit(trim)
                    except RuntimeError:  # the pool is shut down: the daemon is stopping
                        pass

    def give(self, node_id: str, identity: str, idx: int) -> bool:
        """Event (a peer's ``TAKE``, on the loop): ``TakeOvers.give``."""
        return self.takeovers.give(node_id, identity, idx)

    async def ensure_chunk(self, job: SnapshotJob, layer: str, ref: ChunkRef) -> None:
        """Single-flight: one acquisition per chunk, however many ask for it."""
        await self._ensure(job, layer, job.ref_index(layer, ref), ref)

    def acquiring(self, job: SnapshotJob, layer: str, idx: int) -> bool:
        """Whether an acquisition of chunk ``idx`` of ``job``'s ``layer`` runs now."""
        return (layer, idx) in self._inflight.get(job, ())

    async def _ensure(self, job: SnapshotJob, layer: str, idx: int, ref: ChunkRef) -> None:
        key = (layer, idx)
        flights = self._inflight.setdefault(job, {})
        fut = flights.get(key)
        if fut is None:
            fut = asyncio.ensure_future(self._acquire(job, layer, idx, ref))
            flights[key] = fut
            fut.add_done_callback(lambda _f: self._landed(job, key))
        await asyncio.shield(fut)

    def _landed(self, job: SnapshotJob, key: tuple[str, int]) -> None:
        flights = self._inflight.get(job)
        if flights is not None:
            flights.pop(key, None)
            if not flights:
                del self._inflight[job]
        if not self._layers and not self._inflight:
            # The last acquisition outside any download (a repair's chunks, fetched one by one
            # through ensure_chunk) ended: its buffers go back too, as at a download's end (they
            # stayed mapped until the next download ended)
            self.sources.release_buffers()

    async def _got(self, job: SnapshotJob, layer: str, ref: ChunkRef) -> None:
        """Event: a chunk is verified on disk. The job's bitfields and the index change here only."""
        if job.apply(ChunkVerified(layer, ref)):
            if self.chunk_log is not None:
                self.chunk_log.done(job, layer, ref, job.ref_index(layer, ref))
            if job.servable(ref):
                self.index.register(job, layer, ref)
                if self.on_indexed is not None and job.foreign is None:
                    self.on_indexed(job, layer, job.ref_index(layer, ref))
            await job.notify()

    async def _acquire(self, job: SnapshotJob, layer: str, idx: int, ref: ChunkRef) -> None:
        bits = job.bits(layer)
        assert bits is not None
        if bits[idx]:
            return
        target = job.file_path(layer, ref.file_index)
        src = self.sources
        if self.chunk_log is not None:
            self.chunk_log.started(job, ref)
        loc = self.index.by_content(ref.digest)
        if loc is not None and loc.length == ref.length and await src.from_local(job, loc, ref, target):
            if self.chunk_log is not None:
                self.chunk_log.attempt(job, ref, "local", "ok")
            await self._got(job, layer, ref)
            return
        if job.foreign is not None and job.foreign.bucket_only(ref):
            await src.from_bucket(job, ref, target, owner=True)  # no checksum: peers' bytes are not taken
            await self._got(job, layer, ref)
            return
        address = self.index.address(ref.digest)
        errors: list[str] = []
        rounds = policy.Rounds(self.clock, self.cfg.owner_patience_s, self.rng)
        while True:
            errors_before, busy_before = len(errors), self.stats.busy_answers
            views, members = _views(self.membership.live())
            ranked = policy.holders(views, self.haves.holding(job, layer, idx), self.rng, src.watch.book)
            key = (job.identity, layer, idx)
            if self.takeovers.unmark(key) and not ranked and not self.haves.growing_at(job, layer, idx):
                # this node takes the read over from the chunk's owner, who granted it (TakeOvers)
                try:
                    with self.takeovers.reading_for_owner(key):
                        await src.from_bucket(
                            job, ref, target, owner=True, address=address, claim=self.takeovers.claim(job, layer, idx)
                        )
                    self.stats.add("bucket_chunks_taken_over")
                    await self._got(job, layer, ref)
                    return
                except Superseded:
                    pass  # someone announced it first: take it from them
            if not ranked:
                # Nobody holds it yet, but a peer announced it is reading it from the bucket now:
                # ask it at once, cut-through (bdn.transfer.growing), before parking anywhere.
                # (in random order, so the askers spread over them; a full one answers busy and is
                # not asked again for this chunk)
                growing = self.haves.growing_at(job, layer, idx)
                self.rng.shuffle(growing)
                for url in growing:
                    if url in members and await src.from_peer(job, members[url], address, ref, target, 0.0, errors):
                        await self._got(job, layer, ref)
                        return
                    self.haves.not_growing(job, idx, url)  # a hint: asked once, then the plan
            race, asks = policy.plan_holders(ranked, bits.n - bits.count, self.cfg.endgame_chunks)
            tried = {p.url for p in race} | {a.peer.url for a in asks}
            if race and await src.race(job, [members[p.url] for p in race], address, ref, target, errors):
                await self._got(job, layer, ref)
                return
            for a in asks:
                if await src.from_peer(job, members[a.peer.url], address, ref, target, 0.0, errors, invited=True):
                    await self._got(job, layer, ref)
                    return
            views, members = _views(self.membership.live())
            owner = self.owner(job, layer, ref.digest, [self.node_id, *(v.node_id for v in views)])
            # Holders exist but all answered busy (or had no free stream): wait for one of them
            # (or a new holder's HAVE) rather than park at the owners or read the bucket as the
            # owner: the chunk is in the fleet already (a late joiner takes it from its peers).
            holders_busy = bool(ranked) and self.stats.busy_answers > busy_before
            steps = (
                []
                if holders_busy
                else policy.plan_owners(self.node_id, views, ref.digest, layer, tried, self.cfg.chunk_wait_s, owner)
            )
            parked_out = False
            for step in steps:
                if isinstance(step, policy.ReadBucket):
                    live_nodes = [m.node_id for m in wired(self.membership.live())]
                    owner_now = self.owner(job, layer, ref.digest, [self.node_id, *live_nodes])
                    if policy.reads_as_owner(step, self.node_id, live_nodes, ref.digest, owner_now):
                        try:
                            await src.from_bucket(
                                job,
                                ref,
                                target,
                                owner=True,
                                address=address,
                                claim=self.takeovers.claim(job, layer, idx),
                            )
                        except Superseded:
                            # another node took this read over (TakeOvers): the requests parked
                            # here for it go there; a busy round, then take the chunk from it
                            # (never a fallback read: it is being read)
                            if address:
                                self.index.read_elsewhere(address)
                            parked_out = True
                            break
                        finally:
                            self.takeovers.read_ended((job.identity, layer, idx))
                        await self._got(job, layer, ref)
                        return
                    # Not the owner: the nodes above only said "busy" or "not yet". Reading the
                    # bucket here would compete with the owners for its bandwidth; go round again.
                    break
                m = members[step.peer.url]
                if (
                    step.wait > 0
                    and self.cfg.cut_through
                    and m.inflight >= PARK_AHEAD
                    and self.haves.synced(job, m.node_id)
                ):
                    # This owner announces what it starts reading (HAVE_GROWING) and already has
                    # a request of ours parked: wait for the announcement and take the chunk
                    # cut-through then, instead of parking one more request on a chunk it reads
                    # later (parked requests hold this node's streams and transfer slots, and the
                    # chunks the owners read *now* would find none free).
                    parked_out = True
                    break
                if await src.from_peer(job, m, address, ref, target, step.wait, errors):
                    await self._got(job, layer, ref)
                    return
            busy = self.stats.busy_answers > busy_before or parked_out
            delay, again = rounds.after_round(busy=busy, failed=len(errors) > errors_before)
            # woken early when a peer announces the chunk (a HAVE pushed on the transfer wire)
            await self.haves.wait_holder(job, layer, idx, delay)
            if not again:
                break
        if layer == RESULT:
            raise NotAvailable(f"no peer holds reconstructed chunk {ref.index} of {ref.path}")
        # every peer failed: this node reads the bucket itself, as a counted fallback
        await src.from_bucket(job, ref, target, owner=False, address=address)
        await self._got(job, layer, ref)


__all__ = ["Fetcher", "STORED", "RESULT"]
