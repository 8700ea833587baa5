"""One snapshot's state machine on this node (DESIGN.md, "On the node"):

``queued`` (manifest read from the bucket, resume or staging) -> ``downloading`` (the stored layer,
or for a delta without its base here the rebuilt layer from peers) -> ``applying`` (delta: base
XOR diff) -> ``verifying`` (every ``*.safetensors`` header checked by the safetensors library,
``bdn.daemon.apply.headers``) -> ``ready`` (READY written, directory renamed into place), or
``failed`` with a one-line reason. Progress is saved every ``progress_interval_s`` and on
cancellation, so a restarted daemon resumes from what is verified on disk.
"""

from __future__ import annotations

import asyncio
import errno
import logging
from collections.abc import Callable, Iterable
from concurrent.futures import Executor
from typing import Any, TypeVar

from bdn.bucket import ObjectChanged
from bdn.daemon.apply import headers
from bdn.daemon.apply.delta_config import check_delta_config
from bdn.daemon.apply.fold import Folder, refuse_loop
from bdn.daemon.apply.forward import Forward
from bdn.daemon.config import Config
from bdn.daemon.errors import Conflict, NotAvailable
from bdn.daemon.fetch.bucketio import BucketIO
from bdn.daemon.fetch.fetcher import Fetcher
from bdn.daemon.fetch.haves import Haves
from bdn.daemon.observe import logctx
from bdn.daemon.observe.lograte import RepeatLog
from bdn.daemon.observe.stats import Stats
from bdn.daemon.process.clock import Clock
from bdn.daemon.process.executors import Executors
from bdn.daemon.snapshots.catchup import AfterServed
from bdn.daemon.snapshots.collector import RunnerJobs
from bdn.daemon.snapshots.events import (
    LayerComplete,
    LayerReset,
    ManifestAttached,
    Quarantined,
    ReasonChanged,
    Restarted,
    Resumed,
    StateChanged,
)
from bdn.daemon.snapshots.foreign_source import ForeignLoader
from bdn.daemon.snapshots.published import ManifestReader
from bdn.daemon.snapshots.records import record_bytes
from bdn.daemon.snapshots.snapshot import RESULT, STORED, TERMINAL, SnapshotJob
from bdn.daemon.store import diskio
from bdn.daemon.store.bitfield import Bitfield
from bdn.daemon.store.chunklist import check_limits
from bdn.daemon.store.index import ChunkIndex
from bdn.daemon.store.store import Store
from bdn.proto.errors import BdnError
from bdn.proto.manifest import ChunkRef, Manifest

log = logging.getLogger("bdn.runner")
T = TypeVar("T")


#: Times a delta is applied again because its base was repaired while it was read.
BASE_REPAIRS = 2


class Runner:
    """Brings one snapshot job at a time (``run(job)``) from ``queued`` to a terminal state.

    The runner owns the asyncio task that drives each job (its download, then a repair):
    ``start(job)`` spawns it, ``task(job)`` finds it; a task is forgotten once it ends. The
    job's record changes only by the events the runner sends it (``SnapshotJob.apply``)."""

    def __init__(
        self,
        cfg: Config,
        store: Store,
        bucket: BucketIO,
        index: ChunkIndex,
        fetcher: Fetcher,
        haves: Haves,
        stats: Stats,
        pools: Executors,
        clock: Clock,
        *,
        jobs: RunnerJobs,
        foreign: ForeignLoader,
    ) -> None:
        self.cfg = cfg
        self.store = store
        self.bucket = bucket
        self.index = index
        self.fetcher = fetcher
        self.haves = haves
        self.stats = stats
        self.pools = pools
        self.clock = clock
        self.jobs = jobs  # the catalog
        self.foreign = foreign  # the no-manifest path (require_manifest = false)
        self.folder = Folder(cfg, store, bucket, index, fetcher, pools)  # a lagging node's catch-up
        self.manifests = ManifestReader(cfg, bucket, clock, self.folder, foreign, jobs, stats, pools.disk)
        self.forward = Forward(cfg, store, stats, pools, self._register, self.repair)  # sparse applies
        self.after_served = AfterServed(jobs, store, self.forward, pools)  # catch-up and seed
        self.repeat = RepeatLog(log, cfg.log_repeat_s, clock)  # lines a full disk repeats per save
        self._tasks: dict[SnapshotJob, asyncio.Task[None]] = {}  # running, by job

    def start(self, job: SnapshotJob) -> None:
        """Spawn the task that runs ``job`` (``run``)."""
        self._keep(job, asyncio.create_task(self.run(job), name=f"snapshot-{job.identity}"))

    def task(self, job: SnapshotJob) -> asyncio.Task[None] | None:
        """The task driving ``job`` now (its download or its repair), or None once it ended
        (or for a job restored from the store, which never had one)."""
        return self._tasks.get(job)

    def _keep(self, job: SnapshotJob, task: asyncio.Task[None]) -> None:
        self._tasks[job] = task
        task.add_done_callback(lambda t: self._tasks.pop(job, None) if self._tasks.get(job) is t else None)

    async def _on(self, pool: Executor, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    async def run(self, job: SnapshotJob) -> None:
        """Bring ``job`` to ``ready`` or ``failed``: read and verify the manifest, resume saved
        progress or start afresh, fetch the stored chunks (peers, bucket, local copies), apply a delta
        or fold several, check every file (safetensors headers, digests), then publish the READY
        marker. Errors end in ``failed`` with a one-line reason; ``CancelledError`` is re-raised."""
        jobs = self.jobs
        logctx.SNAPSHOT.set(job.identity)  # every line this task (and its children) logs names it
        flusher: asyncio.Task[None] | None = None  # saves progress every progress_interval_s
        try:
            await jobs.removed(job.identity)  # a collected snapshot prefetched again: its old files go first
            m, digest = await self.manifests.read(job)
            job.apply(await self._on(self.pools.disk, ManifestAttached.of, m, digest))  # O(files): off the loop
            saved = self.store.load_progress(m.identity, job.manifest_digest)
            if saved is not None:
                await self._resume(job, saved)
            else:
                # a background catch-up's or seed's buffer is this delta's to take; any other seed
                # gives way (its pages would count against this snapshot's room)
                await self.forward.settle(m, jobs.get)
                jobs.check_budget(m)
                accept = self.forward.accept(m, jobs.get) if m.is_delta else None
                if accept is not None:
                    jobs.gc()  # the snapshot before the base may be collected now, and become a buffer
                    base = jobs.get(m.base_identity or "")
                    if base is not None:  # no spare holds the base (nor an ancestor): a copy of it is
                        await self.forward.seed(base, accept, jobs.budget_left(), background=False)
                held = await self._on(self.pools.disk, self.store.prepare_staging, m, accept, jobs.spare_room(m))
                self.forward.held(m.identity, held)
            flusher = asyncio.create_task(self._progress_flusher(job))
            # (a disk thread: one keyed address per chunk, seconds for millions of them)
            await self._on(self.pools.disk, self.index.add_pending, job, STORED, job.stored_refs)
            job.apply(StateChanged("downloading"))
            await job.notify()
            log.info("snapshot %s: %s, %d files, %d stored bytes", job.identity, m.kind, len(m.files), m.stored_bytes)
            ready_m = m
            if job.foreign is not None:
                ready_m = await self._run_foreign(job)
                assert job.manifest is not None  # _run_foreign read it
                m = job.manifest
            elif m.is_delta:
                await self._run_delta(job, m)
            else:
                await self.fetcher.fetch_layer(job, STORED)
                job.apply(LayerComplete(RESULT))  # full: stored == result
                job.apply(StateChanged("verifying"))
                await job.notify()
            # every safetensors header as the engine's library reads it, before READY exists
            await self._on(self.pools.disk, headers.check_snapshot, m, self.store.staging_dir(m.identity))
            if flusher is not None:  # publish removes the progress file: nothing may write it again
                flusher.cancel()
            final = await self._on(self.pools.disk, self._publish, job, ready_m)
            job.apply(StateChanged("ready"))
            log.info(
                "snapshot %s: ready at %s (stages: %s)",
                job.identity,
                final,
                " ".join(f"{k}={v:.3f}s" for k, v in job.stages.items()),
            )
            jobs.gc()
            self.forward.after_ready(job)  # after GC: the spares it just tagged are mapped ahead
            if not any(j is not job and j.state != "failed" for j in jobs.all()):
                # the first snapshot here (an anchor, a cold start): its buffer is copied while
                # the engines load it, so that the first delta on it applies sparsely too
                self.forward.spawn(
                    self.forward.seed(
                        job, lambda t: t.get("identity") == job.identity, jobs.budget_left(), background=True
                    )
                )
        except asyncio.CancelledError:
            self.save_progress(job)  # a clean stop resumes like a crash, from what is verified
            raise
        except (BdnError, OSError) as e:
            reason = str(e) if isinstance(e, BdnError) else f"{type(e).__name__}: {e}"
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                reason = self.store.full_reason(job.identity, e)
            job.apply(StateChanged("failed", reason.splitlines()[0] if reason else type(e).__name__))
            log.error("snapshot %s: failed: %s", job.identity, job.reason.removeprefix(f"snapshot {job.identity}: "))
            jobs.forget(job)
            self.store.discard(job.identity)
        except Exception as e:  # a bug must fail the snapshot, not kill the daemon
            log.exception("snapshot %s: internal error", job.identity)
            job.apply(StateChanged("failed", f"internal error: {type(e).__name__}: {e}"))
            jobs.forget(job)
            self.store.discard(job.identity)
        finally:
            if job.state != "ready":
                self.forward.forget(job.identity)
            if flusher is not None:
                flusher.cancel()
            # The change notice first: the replica offers a ready snapshot to its engines at
            # once, not after the index clean-up below, which queues behind the disk threads'
            # work in flight (a populate of a big target for one).
            await job.notify()
            # (not when the daemon stops: the index goes with it)
            if job.stored_refs and not jobs.closing:
                await asyncio.shield(self._on(self.pools.disk, self.index.drop_pending_of, job))

    def on_served(self, identity: str) -> None:
        """Event: the engines serve ``identity`` now (or none is registered). The snapshot served
        before it is free once the engines close it: then GC recycles it into a tagged spare and
        :meth:`Forward.catch_up` brings that spare forward to ``identity`` in the background (a
        task; DESIGN.md, "Sparse apply"). When no spare then holds ``identity`` (an anchor, a
        snapshot loaded without its predecessor), :meth:`Forward.seed` copies one from it
        (:class:`bdn.daemon.snapshots.catchup.AfterServed`)."""
        if self.cfg.sparse_apply:
            self.after_served.start(identity)

    def _publish(self, job: SnapshotJob, m: Manifest) -> Any:
        """READY and the restart record of ``job`` rebuilt from ``m`` (a disk thread: the record
        serialises the whole manifest)."""
        derived = job.foreign is not None or job.derived
        return self.store.publish(m, None, record_bytes(m, job.manifest_digest, job.created, derived))

    # ---- repair: a ready snapshot whose bytes on disk went bad ----------------------------------
    async def repair(self, job: SnapshotJob, positions: list[int] | None = None) -> dict[str, Any]:
        """Re-hash a ready snapshot's files (or only its rebuilt chunks at ``positions``: a peer's
        report, the scrub); quarantine and re-fetch every corrupted chunk.

        Corrupted chunks are quarantined at once: no longer served to peers (the index drops this
        node's copy), and the snapshot leaves ``ready`` (its directory goes back to staging, READY
        removed, so neither the local API nor ``bdn.client`` hands it out); counted in
        ``chunks_quarantined``. The chunks are then fetched again like any chunk (another local
        copy, peers, the bucket; a delta's rebuilt chunks from peers only) while the snapshot is
        ``downloading`` (reason ``repairing ...``), and it is ``ready`` again once every chunk and
        header is checked, or ``failed`` with the reason. Returns ``{"identity", "chunks",
        "corrupted": [{"path", "chunk", "offset", "length"}], "state", "reason"}``.

        Raises:
            Conflict: the snapshot is not ready (or stopped being ready while it was hashed).
        """
        assert job.manifest is not None
        refs = job.result_refs
        path_of = lambda fi: job.file_path(RESULT, fi)  # noqa: E731
        if positions is None:
            bad = await self._on(self.pools.disk, diskio.corrupt_chunks, refs, path_of)
        else:
            want = {p for p in positions if 0 <= p < len(refs)}
            good = await self._on(self.pools.disk, diskio.verify_held, refs, want.__contains__, path_of)
            bad = sorted(want - set(good))
        report: dict[str, Any] = {
            "identity": job.identity,
            "chunks": len(refs) if positions is None else len(positions),
            "corrupted": [
                {"path": refs[i].path, "chunk": refs[i].index, "offset": refs[i].offset, "length": refs[i].length}
                for i in bad[:1000]
            ],
        }
        if bad:
            if job.state != "ready" or self.jobs.get(job.identity) is not job:
                raise Conflict(f"snapshot {job.identity!r} is not ready (state {job.state})")
            first = refs[bad[0]]
            where = f"{first.path} chunk {first.index} (bytes {first.offset}-{first.offset + first.length})"
            self.index.quarantine(job, [refs[i] for i in bad], self.jobs.all())
            self.stats.add("chunks_quarantined", len(bad))
            # Out of ``ready`` before the directory moves: a reader that saw ``ready`` must find
            # the files at the path it was given (the directory goes back to staging next).
            job.apply(Quarantined(bad, f"repairing {len(bad)} corrupted chunk(s) found on this node, first {where}"))
            # The progress (every chunk but the bad ones) before the directory moves: a daemon
            # killed once it moved finds a staging directory with its progress and resumes the
            # repair; without it the restart removed the directory as a leftover and the snapshot
            # was gone (404) until loaded again from scratch.
            self.save_progress(job)  # on the loop, as _repair does: the bitfields are the loop's
            try:
                marker = await self._on(self.pools.disk, self.store.unpublish, job.identity)
            except OSError as e:
                job.apply(StateChanged("failed", f"repair failed: cannot take the snapshot back to staging: {e}"))
                log.error("snapshot %s: %s", job.identity, job.reason)
                await job.notify()
                raise
            log.error(
                "snapshot %s: %d corrupted chunk(s) on this node (first %s): quarantined, fetching them again",
                job.identity,
                len(bad),
                where,
            )
            await job.notify()
            self._keep(
                job,
                asyncio.create_task(self._repair(job, [refs[i] for i in bad], marker), name=f"repair-{job.identity}"),
            )
        report.update(state=job.state, reason=job.reason)
        return report

    async def _repair(self, job: SnapshotJob, refs: list[ChunkRef], marker: bytes) -> None:
        assert job.manifest is not None
        m = job.manifest
        logctx.SNAPSHOT.set(job.identity)
        try:
            self.save_progress(job)  # a restart meanwhile resumes from what is still good
            try:
                await asyncio.wait_for(self.haves.refresh(job), 5.0)
            except TimeoutError:
                pass
            await asyncio.gather(*(self.fetcher.ensure_chunk(job, self._repair_layer(job, r), r) for r in refs))
            job.apply(StateChanged("verifying"))
            await job.notify()
            await self._on(self.pools.disk, headers.check_snapshot, m, self.store.staging_dir(m.identity))
            await self._on(self.pools.disk, self.store.publish, m, marker)
            job.apply(StateChanged("ready"))
            log.info("snapshot %s: repaired (%d chunk(s) fetched again)", job.identity, len(refs))
        except asyncio.CancelledError:
            self.save_progress(job)
            raise
        except (BdnError, OSError) as e:
            reason = str(e) if isinstance(e, BdnError) else f"{type(e).__name__}: {e}"
            job.apply(
                StateChanged("failed", f"repair failed: {reason.splitlines()[0] if reason else type(e).__name__}")
            )
            log.error("snapshot %s: %s", job.identity, job.reason)
            self.jobs.forget(job)
            self.store.discard(job.identity)
        finally:
            await job.notify()

    @staticmethod
    def _repair_layer(job: SnapshotJob, ref: ChunkRef) -> str:
        """The layer to fetch a rebuilt chunk through: a delta's rebuilt safetensors chunks exist
        only on peers (RESULT); every other file is stored as it is used (STORED: bucket too)."""
        assert job.manifest is not None
        f = job.manifest.files[ref.file_index]
        return RESULT if f.is_diff or (job.kind == "delta" and f.path.endswith(".safetensors")) else STORED

    async def _resume(self, job: SnapshotJob, saved: tuple[bytes, bytes]) -> None:
        """Take back the chunks a previous run wrote, re-verifying each against the manifest."""
        assert job.manifest is not None
        try:
            stored, result = Bitfield(len(job.stored_refs), saved[0]), Bitfield(len(job.result_refs), saved[1])
        except ValueError as e:  # a progress file that does not fit the manifest: start over
            log.warning("snapshot %s: saved progress ignored: %s", job.identity, e)
            self.jobs.check_budget(job.manifest)
            await self._on(
                self.pools.disk, self.store.prepare_staging, job.manifest, None, self.jobs.spare_room(job.manifest)
            )
            return
        if job.foreign is not None:  # ids are no digests: the objects are verified whole before READY
            job.apply(Resumed(STORED, stored.set_positions().tolist()))  # held back until verified
            log.info(
                "snapshot %s: resumed with %d of %d stored chunks (no manifest: unchanged ETags, each object"
                " verified whole before READY)",
                job.identity,
                stored.count,
                len(job.stored_refs),
            )
            return
        ok_s = await self._on(
            self.pools.disk,
            diskio.verify_held,
            job.stored_refs,
            stored.__getitem__,
            lambda fi: job.file_path(STORED, fi),
        )
        ok_r = await self._on(
            self.pools.disk,
            diskio.verify_held,
            job.result_refs,
            result.__getitem__,
            lambda fi: job.file_path(RESULT, fi),
        )
        job.apply(Resumed(STORED, ok_s))
        job.apply(Resumed(RESULT, ok_r))
        await self._register(job, STORED, (job.stored_refs[i] for i in ok_s))
        await self._register(job, RESULT, (job.result_refs[i] for i in ok_r))
        log.info(
            "snapshot %s: resumed with %d of %d stored chunks verified on disk",
            job.identity,
            len(ok_s),
            len(job.stored_refs),
        )

    def save_progress(self, job: SnapshotJob) -> None:
        """Persist which chunks ``job`` holds (both layers' bitfields, tied to the
        manifest's digest) so a restarted daemon resumes; nothing for a job without a manifest or in a
        terminal state. An OSError is logged, not raised."""
        if job.manifest is None or job.stored is None or job.result is None or job.state in ("ready", "failed"):
            return
        try:
            extra = job.foreign.persisted() if job.foreign is not None else None
            self.store.save_progress(
                job.identity, job.manifest_digest, job.stored.to_bytes(), job.result.to_bytes(), extra
            )
        except OSError as e:
            why = self.store.full_reason(job.identity, e) if e.errno in (errno.ENOSPC, errno.EDQUOT) else str(e)
            self.repeat.log(
                logging.WARNING, ("progress", job.identity), "snapshot %s: cannot save progress: %s", job.identity, why
            )

    async def _progress_flusher(self, job: SnapshotJob) -> None:
        last = -1
        while True:
            await asyncio.sleep(self.cfg.progress_interval_s)
            if job.version != last:
                last = job.version
                self.save_progress(job)

    async def _run_foreign(self, job: SnapshotJob) -> Manifest:
        """Fetch, verify and rebuild a snapshot without a manifest; the manifest READY is written
        from. An object replaced mid-download (a read's If-Match failed) abandons every chunk and
        starts again on a fresh listing, at most ``foreign_restarts`` times, then fails naming the
        object: one snapshot never mixes two versions of an object."""
        restarts = 0
        while True:
            try:
                await self.fetcher.fetch_layer(job, STORED)
                return await self.foreign.finish(job, lambda layer, ref: self.index.register(job, layer, ref))
            except ObjectChanged as e:
                if restarts >= self.cfg.foreign_restarts:
                    raise BdnError(
                        f"snapshot {job.identity}: {e.key} was replaced during the download "
                        f"{restarts + 1} time(s) ({self.cfg.foreign_restarts} restart(s) allowed): {e}"
                    ) from None
                restarts += 1
                log.warning(
                    "snapshot %s: %s; starting again on a fresh listing (restart %d of %d)",
                    job.identity,
                    e,
                    restarts,
                    self.cfg.foreign_restarts,
                )
            await self._on(self.pools.disk, self.index.drop_pending_of, job)
            self.index.forget(job, self.jobs.all())
            job.apply(
                StateChanged("queued", f"restarting: an object was replaced during the download (restart {restarts})")
            )
            await job.notify()
            m, digest = await self.foreign.table(job, self.jobs, wait_publish=job.wait_publish)
            check_limits(m, self.cfg.max_chunks_per_snapshot, self.cfg.max_files_per_snapshot)
            job.apply(Restarted(await self._on(self.pools.disk, ManifestAttached.of, m, digest)))
            self.jobs.check_budget(m)
            await self._on(self.pools.disk, self.store.prepare_staging, m, None, self.jobs.spare_room(m))
            await self._on(self.pools.disk, self.index.add_pending, job, STORED, job.stored_refs)
            job.apply(StateChanged("downloading"))
            await job.notify()

    async def _run_delta(self, job: SnapshotJob, m: Manifest) -> None:
        assert m.base_identity is not None
        base_id = m.base_identity
        refuse_loop(job.identity, base_id, self.jobs)
        base = self.jobs.get(base_id)
        if base is None or base.state != "ready":
            # No base here: take the reconstructed chunks from peers that already rebuilt it
            # (content-addressed like any chunk), else walk the chain from the nearest anchor.
            if await self.haves.refresh(job, need_result=True):
                try:
                    await self._on(self.pools.disk, self.index.prepare, job, RESULT)  # off the loop
                    await self.fetcher.fetch_layer(job, RESULT)
                    job.apply(LayerComplete(STORED))
                    job.apply(StateChanged("verifying"))
                    return
                except NotAvailable as e:
                    log.info(
                        "snapshot %s: peers' reconstructed chunks not enough (%s); walking the chain", job.identity, e
                    )
                    job.apply(LayerReset(RESULT))
            if self.cfg.fold_deltas and await self.folder.fold(job, m, self.jobs):
                job.apply(LayerComplete(RESULT))
                await self._register(job, RESULT, job.result_refs)
                return
            base = self.jobs.prefetch(base_id, requested_by=f"base of {job.identity}")
        download = asyncio.create_task(self.fetcher.fetch_layer(job, STORED))
        try:
            base = await self._await_job(base)
        except BaseException:
            download.cancel()
            raise
        await download
        sparse: set[str] | None = None
        for attempt in range(BASE_REPAIRS + 1):
            # A base under repair (quarantined: out of ready, its directory back in staging) is
            # waited for, not taken for failed: it comes back ready, or fails with its reason.
            base = await self._await_job(base)
            if base.state != "ready":
                raise BdnError(f"base snapshot {base_id} failed: {base.reason}")
            seen = base.ready_count
            try:
                await self._apply_on(job, m, base_id, sparse)
                break
            except (BdnError, OSError) as e:
                if attempt == BASE_REPAIRS or (base.state == "ready" and base.ready_count == seen):
                    raise
                # the base was repaired while it was read (its files moved away, or bytes it
                # held before the repair did not rebuild right): once ready again, apply again,
                # in full (a sparse apply's buffers were brought forward already)
                sparse = set()
                why = str(e).splitlines()[0] if str(e) else type(e).__name__
                job.apply(ReasonChanged(f"applying again: base {base_id} was repaired meanwhile ({why})"))
                await job.notify()
                log.warning(
                    "snapshot %s: base %s was repaired while it was applied (%s); applying again",
                    job.identity,
                    base_id,
                    why,
                )
        job.apply(LayerComplete(RESULT))
        await self._register(job, RESULT, self.forward.untouched(job))

    async def _apply_on(self, job: SnapshotJob, m: Manifest, base_id: str, sparse: set[str] | None) -> None:
        """Apply delta ``m`` onto ready base ``base_id`` and verify every rebuilt chunk.
        ``sparse``: None the first time (the held buffers are brought forward first), else the
        paths a sparse apply did (an empty set: every file in full). Raises BdnError, OSError."""
        await self._on(
            self.pools.disk,
            check_delta_config,
            m.identity,
            base_id,
            self.store.ready_dir(base_id),
            self.store.staging_dir(m.identity),
        )
        if job.state == "downloading":
            job.apply(StateChanged("applying"))
            await job.notify()
        if sparse is None:
            sparse = await self.forward.apply(job, m)  # buffers brought forward in place; the rest in full
        await self._on(
            self.pools.apply,
            diskio.apply_delta,
            m,
            self.store.ready_dir(base_id),
            self.store.stored_dir(m.identity),
            self.store.staging_dir(m.identity),
            self.cfg.apply_workers,
            sparse,
        )
        if job.state == "applying":
            job.apply(StateChanged("verifying"))
            await job.notify()
        await self._on(self.pools.apply, diskio.verify_results, m, self.store.staging_dir(m.identity), sparse)

    async def _register(self, job: SnapshotJob, layer: str, refs: Iterable[ChunkRef]) -> None:
        """Index verified chunks, handing the event loop a turn every 4096 (millions are possible);
        the layer's keyed addresses are computed first, on a disk thread (bdn.daemon.store.index)."""
        await self._on(self.pools.disk, self.index.prepare, job, layer)
        for n, ref in enumerate(refs, 1):
            self.index.register(job, layer, ref)
            if n % 4096 == 0:
                await asyncio.sleep(0)

    @staticmethod
    async def _await_job(job: SnapshotJob) -> SnapshotJob:
        while job.state not in TERMINAL:
            await job.wait_change(job.version, 5.0)
        return job
