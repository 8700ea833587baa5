"""The snapshots on this node: start (prefetch), wait, cancel, garbage-collect, the shm budget,
and the read views the HTTP adapters serve (records, have-bitfields, files, tensors).

The catalog is the only writer of the set of jobs; each job's record changes only by the events
it is sent (``SnapshotJob.apply``: by its runner, the fetcher, and here the publish wait, the
tensor index, shedding and the stop).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from bdn.daemon.config import Config
from bdn.daemon.errors import Conflict, NotFound
from bdn.daemon.fetch.held import HeldFiles
from bdn.daemon.process.clock import Clock
from bdn.daemon.snapshots import retention
from bdn.daemon.snapshots.collector import Collector
from bdn.daemon.snapshots.events import (
    LayerComplete,
    ManifestAttached,
    PublishDeadline,
    Shed,
    StateChanged,
    Stopping,
    TensorIndexBuilt,
    TensorIndexRefused,
)
from bdn.daemon.snapshots.recent import RecentSet
from bdn.daemon.snapshots.records import MAX_RECORD_BYTES, from_ready, matches_ready, parse_record
from bdn.daemon.snapshots.runner import Runner
from bdn.daemon.snapshots.snapshot import RESULT, STORED, TERMINAL, SnapshotJob
from bdn.daemon.store.index import ChunkIndex
from bdn.daemon.store.store import Store
from bdn.fileops import read_header
from bdn.proto.errors import BdnError
from bdn.proto.identity import validate_identity
from bdn.proto.manifest import Manifest
from bdn.proto.ready import ReadyMarker
from bdn.proto.safetensors_fmt import SafetensorsError, tensor_index

log = logging.getLogger("bdn.catalog")
#: Failed snapshots whose records (state and reason) are kept; older ones are forgotten.
MAX_FAILED = 256
#: Identities GC removed that the catalog remembers (bdn/daemon/snapshots/recent.py): 256, as many
#: as the hot-load hints keep; a peer's hint naming an older one costs a manifest read, not a
#: fetch (``Collector.check_budget``: older than what GC keeps).
MAX_COLLECTED = 256


class Catalog:
    """The set of jobs and what is asked of them. ``runner_for(catalog)`` makes the runner of
    every job (it gets this catalog as its ``RunnerJobs``); ``pinned()`` names the identities GC
    must keep (leases, current, target; one pinned before and not now has no GC grace:
    ``retention.Pins``); ``on_change(job)`` is awaited after each job change (the
    replica view listens); ``on_forget(job)`` is called when a job's chunks leave the index (the
    transfer server's descriptor cache, the chunk log)."""

    def __init__(
        self,
        cfg: Config,
        store: Store,
        index: ChunkIndex,
        runner_for: Callable[[Catalog], Runner],
        clock: Clock,
        *,
        pinned: Callable[[], set[str]] = set,
        on_change: Callable[[SnapshotJob], Awaitable[None]] | None = None,
        on_forget: Callable[[SnapshotJob], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.store = store
        self.index = index
        self.clock = clock
        self.held = HeldFiles(clock)  # the have-bits advertised: less the chunks of files gone from disk
        self.jobs: dict[str, SnapshotJob] = {}
        self.resumable: set[str] = set()
        self.collected = RecentSet(MAX_COLLECTED)  # identities GC removed: old, not re-joined for peers
        self.pins = retention.Pins(pinned)
        self.on_change = on_change
        self.closing = False
        self.on_forget = on_forget
        self._indexing: dict[str, asyncio.Future[dict[str, tuple[str, Any]]]] = {}  # tensor indexes being built
        self.collector = Collector(cfg, store, self.jobs, self.pins, clock, self.collected, self.forget)
        # (the runner and the catch-up reach budget and GC through the catalog: RunnerJobs)
        self.check_budget, self.budget_left, self.spare_room = (
            self.collector.check_budget,
            self.collector.budget_left,
            self.collector.spare_room,
        )
        self.gc, self.gc_off_loop, self.removed, self.collectable = (
            self.collector.gc,
            self.collector.gc_off_loop,
            self.collector.removed,
            self.collector.collectable,
        )
        self.runner = runner_for(self)

    # ---- the set of jobs ---------------------------------------------------------------------
    def get(self, identity: str) -> SnapshotJob | None:
        """The job of ``identity``, or None."""
        return self.jobs.get(identity)

    def all(self) -> list[SnapshotJob]:
        """Every job, in the order they were started."""
        return list(self.jobs.values())

    def records(self) -> list[dict[str, Any]]:
        """Every snapshot's record (``SnapshotJob.describe``), in the order they were started."""
        return [j.describe() for j in self.jobs.values()]

    def prefetch(self, identity: str, requested_by: str = "local", wait_publish: bool = True) -> SnapshotJob:
        """Start (or return) the job that brings ``identity`` to ``ready`` on this node.

        A failed job is retried from scratch. ``wait_publish``: with nothing under the identity
        in the bucket, wait for it to be published (else the job fails at once with the reason).
        Raises IdentityError for a bad identity.
        """
        validate_identity(identity)
        job = self.jobs.get(identity)
        if job is not None and job.state != "failed":
            return job
        self.collected.discard(identity)
        if job is not None:
            self.forget(job)
        job = self._new_job(identity, requested_by, wait_publish=wait_publish)
        self.runner.start(job)
        return job

    def _new_job(
        self, identity: str, requested_by: str, *, wait_publish: bool = True, created: float | None = None
    ) -> SnapshotJob:
        """The one way a job is made and entered: a download, or a snapshot found READY at start
        (``created``: its record's creation time, epoch s), the same constructor for both."""
        job = SnapshotJob(
            identity,
            self.store,
            self._job_changed,
            requested_by=requested_by,
            wait_publish=wait_publish,
            created=created,
        )
        self.jobs[identity] = job
        return job

    async def prefetch_looked(
        self, identity: str, wait_publish: bool, timeout: float, publish_wait_s: float | None = None
    ) -> SnapshotJob:
        """``prefetch``, then wait (at most ``timeout`` s) until the job has looked at the bucket
        once: it downloads, waits with a reason (for its manifest, for publication), or failed
        (nothing published, a manifest refused, no room): so the local API can refuse a request
        that fails at once instead of answering 202 for it. ``publish_wait_s``: the
        asker's patience, which bounds the job's wait for publication (the latest of its askers';
        a job started without one keeps ``manifest_wait_s``). Raises IdentityError."""
        fresh = getattr(self.jobs.get(identity), "state", "failed") == "failed"
        job = self.prefetch(identity, wait_publish=wait_publish)
        if publish_wait_s is not None and (fresh or job.publish_deadline is not None):
            job.apply(PublishDeadline(self.clock.monotonic() + publish_wait_s))
        deadline = self.clock.monotonic() + timeout
        while job.state == "queued" and not job.reason:
            left = deadline - self.clock.monotonic()
            if left <= 0:
                break
            await job.wait_change(job.version, left)
        return job

    def _trim_failed(self) -> None:
        """Keep at most ``MAX_FAILED`` failed records (oldest started go first), each shed of its
        manifest, chunk lists and bitfields once its task ended (``SnapshotJob.shed``): names nobody
        published must not grow the catalog (256 records of 10^6 chunks would hold 4 GB)."""
        failed = [i for i, j in self.jobs.items() if j.state == "failed"]
        for identity in failed[: max(0, len(failed) - MAX_FAILED)]:
            del self.jobs[identity]
        for j in self.jobs.values():
            task = self.runner.task(j)
            if j.state == "failed" and (task is None or task.done()):
                j.apply(Shed())

    async def _job_changed(self, job: SnapshotJob) -> None:
        if self.on_change is not None:
            await self.on_change(job)

    async def wait_state(self, identity: str, state: str, timeout: float) -> SnapshotJob | None:
        """The job once it reaches ``state`` or a terminal state, or after ``timeout`` s, or at
        once when the daemon is stopping (``closing``); None if unknown."""
        job = self.jobs.get(identity)
        if job is None:
            return None
        deadline = self.clock.monotonic() + timeout
        while job.state != state and job.state not in TERMINAL and not self.closing:
            left = deadline - self.clock.monotonic()
            if left <= 0:
                break
            await job.wait_change(job.version, left)
            job = self.jobs.get(identity, job)
        return job

    async def delete(self, identity: str) -> SnapshotJob:
        """``DELETE /v1/snapshots/{id}``: a load in progress is cancelled (``failed``, "cancelled by
        the operator") and a failed record is forgotten (the record is returned as it was); a
        ready snapshot is left to GC. Raises NotFound."""
        job = await self.cancel(identity, "cancelled by the operator")
        if job.state == "failed" and self.jobs.get(identity) is job:
            del self.jobs[identity]
        return job

    async def cancel(self, identity: str, reason: str = "cancelled") -> SnapshotJob:
        """Stop the load of ``identity`` (its requests end, its staging files go): the job is
        ``failed`` with ``reason``; a ready or failed one is left as it is. Raises NotFound."""
        job = self.jobs.get(identity)
        if job is None:
            raise NotFound(f"snapshot {identity!r} is not known to this daemon")
        task = self.runner.task(job)
        if job.state in TERMINAL or task is None:
            return job
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        if job.state not in TERMINAL:
            job.apply(StateChanged("failed", reason))
            self.forget(job)
            self.store.discard(identity)
            await job.notify()
        log.info("snapshot %s: %s", identity, reason)
        return job

    def forget(self, job: SnapshotJob) -> None:
        """Drop ``job``'s chunks from the index (other holders of the same bytes keep serving them);
        called when a job fails or is started again. Keeps at most ``MAX_FAILED`` failed records."""
        self.index.forget(job, self.jobs.values())
        if self.on_forget is not None:
            self.on_forget(job)
        self._trim_failed()

    async def stop(self) -> None:
        """Cancel every job (each saves its progress) and the background catch-ups and seeds,
        and wait for them; then wake every waiter (``wait_state`` answers at once from now on)."""
        self.closing = True
        tasks = [t for j in self.jobs.values() if (t := self.runner.task(j)) is not None]
        for t in tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.runner.forward.close()  # catch-ups and seeds: before the pools shut down
        for j in self.jobs.values():
            j.apply(Stopping())
            async with j.cond:
                j.cond.notify_all()

    async def load_ready_from_store(self) -> None:
        """Register the snapshots already READY in shm (a restarted daemon keeps serving them),
        each the same record a fresh download of it ends with, made by the same constructor and
        events (manifest attached, both layers complete, ``ready``), its creation time kept: its
        manifest from the store's record (``bdn.daemon.snapshots.records``, parsed with the
        bucket's parser, on a disk thread), else READY's table alone (marked ``derived``: no
        publish time to check claims against)."""
        # Downloads a restart cut short resume from their saved progress; other half-built
        # leftovers were never handed out and are removed.
        disk = self.runner.pools.disk
        loop = asyncio.get_running_loop()
        self.resumable = set(await loop.run_in_executor(disk, self.store.resumable))
        await loop.run_in_executor(disk, self.store.clean_staging, self.resumable)
        for info in await loop.run_in_executor(disk, self.store.list_ready):
            bad = await loop.run_in_executor(disk, self.store.check_sizes, info)
            if bad:
                # Never hand out a file that is not what READY describes; it is fetched again.
                log.error("snapshot %s in shm is damaged (%s): removed, it will be fetched again", info.identity, bad)
                await loop.run_in_executor(disk, self.store.remove, info.identity)
                continue
            m, digest, created, derived = await loop.run_in_executor(disk, self._restored_table, info)
            attached = await loop.run_in_executor(disk, ManifestAttached.of, m, digest, derived)  # O(files)
            job = self._new_job(info.identity, "store", created=created)
            for event in (attached, LayerComplete(STORED), LayerComplete(RESULT), StateChanged("ready")):
                job.apply(event)
            await self._register_restored(job)
            log.info(
                "snapshot %s: ready from shm (%d bytes)%s",
                info.identity,
                info.total_bytes,
                "" if created is not None else ", no record of its manifest: READY's table",
            )

    def _restored_table(self, info: ReadyMarker) -> tuple[Manifest, str, float | None, bool]:
        """``(manifest, digest, created, derived)`` of a snapshot READY at start, from its record
        when it is valid and describes READY's files (blocking)."""
        data = self.store.read_record(info.identity, MAX_RECORD_BYTES)
        if data is not None:
            try:
                rec = parse_record(data, info.identity)
                why = matches_ready(rec.manifest, info)
            except BdnError as e:
                why = str(e)
            if not why:
                return rec.manifest, rec.digest, rec.created, rec.derived
            log.warning("snapshot %s: its record in shm is ignored (%s): READY's table is used", info.identity, why)
        return from_ready(info), "", None, True

    async def _register_restored(self, job: SnapshotJob) -> None:
        """Index a restored snapshot's chunks: every rebuilt chunk, and a delta's stored diff
        chunks when its stored files are there at their sizes (what a fresh download served)."""
        assert job.manifest is not None
        m = job.manifest
        disk = self.runner.pools.disk
        loop = asyncio.get_running_loop()
        layers = [(RESULT, job.result_refs)]
        if m.is_delta and await loop.run_in_executor(disk, self._stored_whole, m):
            layers.append((STORED, [r for r in job.stored_refs if m.files[r.file_index].is_diff]))
        for layer, refs in layers:
            await loop.run_in_executor(disk, self.index.prepare, job, layer)
            for n, ref in enumerate(refs, 1):
                self.index.register(job, layer, ref)
                if n % 4096 == 0:
                    await asyncio.sleep(0)  # millions of chunks: the loop answers meanwhile

    def _stored_whole(self, m: Manifest) -> bool:
        d = self.store.stored_dir(m.identity)
        try:
            return all((d / f.path).stat().st_size == f.size for f in m.files if f.is_diff)
        except OSError:
            return False

    # ---- read views ----------------------------------------------------------------------
    def record(self, identity: str) -> dict[str, Any]:
        """The snapshot record. Raises NotFound."""
        job = self.jobs.get(identity)
        if job is None:
            raise NotFound(
                f"snapshot {identity!r} is not known to this daemon (load it: bdnctl prefetch {identity}, "
                f"or POST /v1/snapshots/{identity}/prefetch)"
            )
        return job.describe()

    def ready(self, identity: str) -> tuple[SnapshotJob, Path]:
        """The ready job and its directory. Raises NotFound (unknown) or Conflict (not ready)."""
        job = self.jobs.get(identity)
        if job is None:
            raise NotFound(f"snapshot {identity!r} is not known to this daemon")
        if job.state != "ready":
            raise Conflict(f"snapshot {identity!r} is not ready (state {job.state})")
        return job, self.store.ready_dir(identity)

    async def repair(self, identity: str, positions: list[int] | None = None) -> dict[str, Any]:
        """Re-hash ready snapshot ``identity`` (every rebuilt chunk, or those at ``positions``);
        quarantine and re-fetch its corrupted chunks (``Runner.repair``: shapes there). Raises
        NotFound (unknown) or Conflict (not ready)."""
        job, _ = self.ready(identity)
        return await self.runner.repair(job, positions)

    def ready_dir(self, identity: str) -> Path:
        """The directory of ``identity``'s files once it is ready (it need not exist yet)."""
        return self.store.ready_dir(identity)

    def stored_dir(self, identity: str) -> Path:
        """Where a delta's stored diff files live (the replica's changed-tensor list reads them)."""
        return self.store.stored_dir(identity)

    async def have(self, identity: str, since: int, wait: float) -> dict[str, Any] | None:
        """The have answer once the job's version differs from ``since`` (or after ``wait`` s);
        None when the snapshot (or its manifest) is not known here."""
        job = self.jobs.get(identity)
        if job is None or job.manifest is None:
            return None
        await job.wait_change(since, wait)
        return job.have_map(self.held.advertised(job, STORED), self.held.advertised(job, RESULT))

    def files(self, identity: str) -> list[dict[str, Any]]:
        """``[{path, size}]`` of a ready snapshot. Raises NotFound/Conflict."""
        job, _ = self.ready(identity)
        assert job.manifest is not None
        return [{"path": f.path, "size": f.result_size} for f in job.manifest.files]

    async def files_json(self, identity: str) -> bytes:
        """``{"files": files(identity)}`` as JSON bytes, encoded on a disk thread in slices of
        ``FILES_SLICE`` entries (100,000 files took 0.2 s of the event loop's CPU). Raises
        NotFound/Conflict."""
        job, _ = self.ready(identity)
        assert job.manifest is not None
        return await asyncio.get_running_loop().run_in_executor(self.runner.pools.disk, _files_json, job.manifest)

    def file(self, identity: str, rel: str) -> Path:
        """The path of file ``rel`` of a ready snapshot. Raises NotFound/Conflict."""
        job, d = self.ready(identity)
        assert job.manifest is not None
        try:
            job.manifest.file(rel)
        except KeyError:
            raise NotFound(f"snapshot {identity!r} has no file {rel!r}") from None
        return d / rel

    def file_size(self, identity: str, rel: str) -> int:
        """The size in bytes file ``rel`` of a ready snapshot has by its manifest. Raises NotFound/Conflict."""
        job, _ = self.ready(identity)
        assert job.manifest is not None
        try:
            return job.manifest.file(rel).result_size
        except KeyError:
            raise NotFound(f"snapshot {identity!r} has no file {rel!r}") from None

    async def tensor(self, identity: str, name: str) -> tuple[Path, str, Any]:
        """``(file path, file name, TensorInfo)`` of tensor ``name``. Raises NotFound/Conflict
        (also for a checkpoint naming one tensor in two shards: ``tensor_index``'s one rule, and
        for a header bdn's parser refuses: the line names the file and the key, and is logged
        once per snapshot).

        The headers are read and parsed on a disk thread, once per snapshot (up to 100 MB of
        JSON each: on the event loop that would stall every request for a second)."""
        job, d = self.ready(identity)
        if job.tensor_refused:
            raise Conflict(job.tensor_refused)
        index = job.tensor_index
        if index is None:
            fut = self._indexing.get(identity)
            if fut is None:  # one parse per snapshot, however many requests wait for it
                fut = asyncio.get_running_loop().run_in_executor(self.runner.pools.disk, self._tensor_index, job, d)
                self._indexing[identity] = fut
                fut.add_done_callback(
                    lambda f: self._indexing.pop(identity, None) if self._indexing.get(identity) is f else None
                )
            try:
                index = await asyncio.shield(fut)
            except SafetensorsError as e:
                if job.apply(TensorIndexRefused(f"snapshot {identity}: tensors not served: {e}")):
                    log.error("%s", job.tensor_refused)
                raise Conflict(job.tensor_refused) from None
            except OSError as e:
                raise BdnError(f"snapshot {identity}: cannot read its safetensors headers: {e.strerror or e}") from None
            if self.jobs.get(identity) is job:
                job.apply(TensorIndexBuilt(index))
        hit = index.get(name)
        if hit is None:
            raise NotFound(f"snapshot {identity!r} has no tensor {name!r}")
        return d / hit[0], hit[0], hit[1]

    @staticmethod
    def _tensor_index(job: SnapshotJob, d: Path) -> dict[str, tuple[str, Any]]:
        """Every tensor of a ready snapshot by name (blocking). Raises SafetensorsError naming
        the file, OSError."""
        assert job.manifest is not None
        headers = []
        for f in job.manifest.files:
            if f.path.endswith(".safetensors"):
                try:
                    headers.append((f.path, read_header(d / f.path)))
                except SafetensorsError as e:
                    raise SafetensorsError(f"{f.path}: {e}") from None
        return tensor_index(headers)


#: Entries per ``json.dumps`` call of a file listing (each call holds the GIL; a few ms each).
FILES_SLICE = 4096


def _files_json(m: Manifest) -> bytes:
    parts = []
    for i in range(0, len(m.files), FILES_SLICE):
        parts.append(json.dumps([{"path": f.path, "size": f.result_size} for f in m.files[i : i + FILES_SLICE]])[1:-1])
    return ('{"files": [' + ", ".join(parts) + "]}").encode()
