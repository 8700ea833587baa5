"""Re-verification of the chunks this node serves, after they were verified once (DESIGN.md,
"Repair"): a chunk can go bad in shm after READY (a stray write, a bad page), and peers then
catch it by digest and penalise this node while the local file pull keeps handing it out.

Three ways in, one check:

- **Reports out** (``BadChunkReports.report``, built before the fetch path it serves): a fetch that got bad bytes from a peer tells that peer, with a
  signed ``POST bad_chunk`` (msgpack ``{"address", "snapshot"}``), once per (peer, address) in
  flight, at most ``MAX_OUTGOING`` at once (fire and forget: the penalty is the receiver's own
  defence either way).
- **Reports in** (``reported``): the reported daemon does not trust the report: it re-hashes the
  chunk from its shm file. Good bytes: nothing changes (``bad_chunk_reports_refuted``; the same
  address is not hashed again for ``RECHECK_S``). Bad bytes: quarantined (below). At most
  ``MAX_QUEUED`` checks wait, one runs at a time (a flood costs one chunk hash at a time and
  bounded memory; beyond it the report is answered 503).
- **Scrub** (``scrub_loop``, with ``scrub_mbit`` > 0): every ready snapshot's rebuilt chunks are
  re-hashed in turn at that rate, again and again.

Quarantine of a bad chunk of a ready snapshot is ``Catalog.repair(identity, positions)``: no
longer served, the snapshot leaves ready, the chunk is fetched again, ``chunks_quarantined``. A
chunk of a snapshot that is not ready (still downloading, or a delta's stored diff object) is
unindexed: no longer served; the download's own checks stand for the rest.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor

from bdn.daemon.fetch.ratelimit import RateLimit
from bdn.daemon.observe.lograte import RepeatLog
from bdn.daemon.observe.packing import packb
from bdn.daemon.observe.stats import Stats
from bdn.daemon.snapshots.catalog import Catalog
from bdn.daemon.snapshots.snapshot import RESULT, Loc, SnapshotJob
from bdn.daemon.store import diskio
from bdn.daemon.store.index import ChunkIndex
from bdn.daemon.swarm.peer_client import PeerClient, PeerError
from bdn.proto.errors import BdnError
from bdn.proto.manifest import ChunkRef

log = logging.getLogger("bdn.chunkcheck")
MAX_OUTGOING = 64
MAX_QUEUED = 256
RECHECK_S = 60.0
MAX_RECENT = 4096
IDLE_S = 5.0  # the scrub's pause when no snapshot is ready


class BadChunkReports:
    """Reports out (see the module docstring): tell a peer that sent bad bytes, in the background."""

    def __init__(self, peers: PeerClient) -> None:
        self.peers = peers
        self._outgoing: set[tuple[str, str]] = set()
        self._sending: set[asyncio.Future[None]] = set()

    def report(self, url: str, node_id: str, address: str, snapshot: str) -> None:
        """A fetch got bad bytes for ``address`` from the peer at ``url``: tell it (in the background)."""
        key = (url, address)
        if key in self._outgoing or len(self._outgoing) >= MAX_OUTGOING:
            return
        self._outgoing.add(key)
        body = packb({"address": address, "snapshot": snapshot})
        task = asyncio.ensure_future(self._send(url, node_id, body))
        self._sending.add(task)

        def sent(t: asyncio.Future[None]) -> None:
            self._outgoing.discard(key)
            self._sending.discard(t)

        task.add_done_callback(sent)

    async def _send(self, url: str, node_id: str, body: bytes) -> None:
        try:
            status, _ = await self.peers.post_json(url, "bad_chunk", body, timeout=10.0)
            log.debug("told %s of a bad chunk: %d", node_id, status)
        except (TimeoutError, PeerError, OSError) as e:
            log.debug("could not tell %s of a bad chunk: %s", node_id, e)


class ChunkCheck:
    """Reports in and the scrub (see the module docstring). ``scrub`` is the scrub's rate limit
    (None: no scrub); ``scrub_pool`` hashes the scrub's chunks (default ``disk_pool``; the
    daemon's lowered ``background`` pool, ``bdn.priority``), ``disk_pool`` a report's."""

    def __init__(
        self,
        index: ChunkIndex,
        catalog: Catalog,
        stats: Stats,
        disk_pool: Executor,
        scrub: RateLimit | None,
        log_repeat_s: float,
        clock: Callable[[], float] = time.monotonic,
        scrub_pool: Executor | None = None,
    ) -> None:
        self.index = index
        self.catalog = catalog
        self.stats = stats
        self.disk_pool = disk_pool
        self.scrub_pool = scrub_pool or disk_pool
        self.scrub = scrub
        self.clock = clock
        self.repeat = RepeatLog(log, log_repeat_s)
        self._queue: asyncio.Queue[tuple[str, str]] = asyncio.Queue(MAX_QUEUED)
        self._queued: set[str] = set()
        self._recent: dict[str, float] = {}  # address -> when it was last found good

    # ---- reports in ----------------------------------------------------------------------
    def reported(self, peer: str, address: str) -> bool:
        """Peer ``peer`` says our chunk at ``address`` was bad: queue a re-hash. False when the
        queue is full (the caller answers 503); a repeated or just-refuted address is a no-op."""
        if address in self._queued:
            return True
        seen = self._recent.get(address)
        if seen is not None and self.clock() - seen < RECHECK_S:
            return True
        try:
            self._queue.put_nowait((peer, address))
        except asyncio.QueueFull:
            return False
        self._queued.add(address)
        return True

    async def run(self) -> None:
        """Work the queue of reports, one check at a time (the app runs this task)."""
        while True:
            peer, address = await self._queue.get()
            try:
                await self.check_address(peer, address)
            except (BdnError, OSError) as e:
                log.warning("chunk %s reported bad by %s: check failed: %s", address, peer, e)
            finally:
                self._queued.discard(address)

    async def check_address(self, peer: str, address: str) -> str:
        """Re-hash the chunk at ``address``: ``"good"``, ``"bad"`` (quarantined) or ``"unknown"``
        (not served here, nothing to do)."""
        loc = self.index.lookup(address)
        if loc is None:
            return "unknown"
        ref = _ref_of(loc)
        bad = await self._hash(loc.job, loc.layer, [ref])
        if not bad:
            self.stats.add("bad_chunk_reports_refuted")
            if len(self._recent) >= MAX_RECENT:
                self._recent.clear()
            self._recent[address] = self.clock()
            self.repeat.log(
                logging.WARNING,
                ("refuted", peer),
                "peer %s reported chunk %d of %s (snapshot %s) bad; its bytes here match the manifest: kept",
                peer,
                ref.index,
                ref.path,
                loc.job.identity,
            )
            return "good"
        log.error(
            "peer %s reported chunk %d of %s (snapshot %s) bad, and it is: quarantined",
            peer,
            ref.index,
            ref.path,
            loc.job.identity,
        )
        await self._quarantine(loc, ref)
        return "bad"

    async def _quarantine(self, loc: Loc, ref: ChunkRef) -> None:
        job = loc.job
        if job.state == "ready" and (loc.layer == RESULT or _same_in_both(job, ref)):
            position = job.ref_index(RESULT, ref)
            await self.catalog.repair(job.identity, positions=[position])
            return
        self.index.unindex(self.index.address(ref.digest))
        self.stats.add("chunks_quarantined")

    async def _hash(
        self, job: SnapshotJob, layer: str, refs: list[ChunkRef], pool: Executor | None = None
    ) -> list[int]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            pool or self.disk_pool, diskio.corrupt_chunks, refs, lambda fi: job.file_path(layer, fi)
        )

    # ---- scrub ---------------------------------------------------------------------------
    async def scrub_loop(self) -> None:
        """Re-hash every ready snapshot's rebuilt chunks at the scrub rate, forever."""
        assert self.scrub is not None
        while True:
            ready = [j for j in self.catalog.all() if j.state == "ready" and j.manifest is not None]
            if not ready:
                await asyncio.sleep(IDLE_S)
                continue
            for job in ready:
                await self._scrub_one(job)

    async def _scrub_one(self, job: SnapshotJob) -> None:
        assert self.scrub is not None
        refs = job.result_refs
        for position in range(len(refs)):
            if job.state != "ready" or self.catalog.get(job.identity) is not job:
                return  # collected, or being repaired: the next pass sees it again
            ref = refs[position]
            await self.scrub.take(ref.length)
            self.stats.add("chunks_scrubbed")
            if await self._hash(job, RESULT, [ref], self.scrub_pool):
                log.error(
                    "scrub: chunk %d of %s (snapshot %s) no longer matches the manifest: quarantined",
                    ref.index,
                    ref.path,
                    job.identity,
                )
                try:
                    await self.catalog.repair(job.identity, positions=[position])
                except BdnError as e:
                    log.warning("scrub: snapshot %s: %s", job.identity, e)
                return


def _ref_of(loc: Loc) -> ChunkRef:
    m = loc.job.manifest
    assert m is not None
    f = m.files[loc.file_index]
    return ChunkRef(loc.file_index, f.path, loc.offset // m.chunk_size, loc.offset, loc.length, loc.digest)


def _same_in_both(job: SnapshotJob, ref: ChunkRef) -> bool:
    """A file that is not a delta's diff is the same bytes in the stored and the rebuilt layer."""
    m = job.manifest
    return m is not None and not m.files[ref.file_index].is_diff
