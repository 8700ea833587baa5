"""Reading a snapshot's published manifest for a download (split out of bdn.daemon.snapshots.runner).

The runner reads ``<identity>/bdn.manifest.json`` once per job: taken from the chain walk's read
when it just made one (``Folder.take_recent``), polled while the trainer has not written it yet
(``wait_publish``), read again while the bucket is unavailable, then parsed off the event loop
and checked against the configured limits (``check_limits``).
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import Executor

from bdn.bucket import BucketUnavailable, ObjectNotFound
from bdn.daemon.apply.fold import Folder
from bdn.daemon.config import Config
from bdn.daemon.fetch.bucketio import BucketIO
from bdn.daemon.observe.stats import Stats
from bdn.daemon.process.clock import Clock
from bdn.daemon.snapshots.events import ReasonChanged
from bdn.daemon.snapshots.foreign_source import ForeignLoader
from bdn.daemon.snapshots.snapshot import Jobs, SnapshotJob
from bdn.daemon.store.chunklist import check_limits
from bdn.proto.chunks import digest as xxh3_digest
from bdn.proto.errors import BdnError
from bdn.proto.manifest import MANIFEST_NAME, Manifest

#: Reads of a snapshot's manifest that may fail with the bucket unavailable (each after the
#: client's own retries) before the snapshot fails; 2, 4, 8 s between them.
MANIFEST_UNAVAILABLE_TRIES = 4


class ManifestReader:
    """Reads the manifest of a runner's jobs from the bucket (``read``); ``folder`` gives a
    manifest the chain walk just read, ``foreign`` the table of a snapshot without one
    (``require_manifest = false``), ``disk_pool`` parses it off the event loop."""

    def __init__(
        self,
        cfg: Config,
        bucket: BucketIO,
        clock: Clock,
        folder: Folder,
        foreign: ForeignLoader,
        jobs: Jobs,
        stats: Stats,
        disk_pool: Executor,
    ) -> None:
        self.cfg = cfg
        self.bucket = bucket
        self.clock = clock
        self.folder = folder
        self.foreign = foreign
        self.jobs = jobs
        self.stats = stats
        self.disk_pool = disk_pool

    async def read(self, job: SnapshotJob) -> tuple[Manifest, str]:
        """``(manifest, digest)`` of ``job``'s snapshot from the bucket (digest: XXH3-128 of the
        manifest's bytes; for a snapshot without one, its table and the table's id), polled
        every ``manifest_poll_s`` up to ``manifest_wait_s`` while it is not there (the job's
        reason says so), and read again up to ``MANIFEST_UNAVAILABLE_TRIES`` times while the
        bucket is unavailable. Raises BdnError (not published, too large), BucketError,
        ManifestError."""
        recent = await self.folder.take_recent(job.identity)
        if recent is not None:  # a chain walk read it moments ago
            digest, m = recent
            check_limits(m, self.cfg.max_chunks_per_snapshot, self.cfg.max_files_per_snapshot)
            return m, digest
        key = f"{job.identity}/{MANIFEST_NAME}"
        started = self.clock.monotonic()
        looked = 0
        unavailable = 0
        while True:
            looked += 1
            try:
                data = await self.bucket.read(key)
                break
            except BucketUnavailable as e:
                # still failing after the client's own retries (a burst of 503/429 that outlasted
                # them, a redirect): read again a few times, waits doubling, before the snapshot
                # fails (a burst of 12 errors all on this one read failed it: the suite under load)
                unavailable += 1
                if unavailable >= MANIFEST_UNAVAILABLE_TRIES:
                    raise
                job.apply(ReasonChanged(f"bucket unavailable, reading {key} again: {e}"))
                await job.notify()
                await asyncio.sleep(min(2.0**unavailable, 30.0))
            except ObjectNotFound:
                if not self.cfg.require_manifest:
                    return await self.foreign.table(job, self.jobs, wait_publish=job.wait_publish)
                if not job.wait_publish and not await self.bucket.list(f"{job.identity}/"):
                    raise BdnError(
                        f"snapshot {job.identity}: nothing is published under {job.identity}/ in {self.bucket.url}"
                    ) from None
                # bounded by the askers (a client that gives up after 60 s)
                limit = started + self.cfg.manifest_wait_s
                if job.publish_deadline is not None:
                    limit = min(limit, job.publish_deadline)
                now = self.clock.monotonic()
                if now >= limit:
                    raise BdnError(
                        f"snapshot {job.identity} is not published yet (waited {now - started:.0f} s): "
                        f"{key} is not in {self.bucket.url}"
                    ) from None
                # The count tells an operator (and a test) that the daemon keeps looking.
                job.apply(
                    ReasonChanged(
                        f"waiting for manifest: {job.identity} is not published yet, {key} is not in the "
                        f"bucket (looked {looked} time{'' if looked == 1 else 's'}); gives up after "
                        f"{limit - started:.0f} s"
                    )
                )
                await job.notify()
                await asyncio.sleep(self.cfg.manifest_poll_s)
        self.stats.add("bucket_manifest_bytes", len(data))
        digest = xxh3_digest(data)
        # off the event loop: a manifest of a million chunks takes seconds to parse and validate
        m = await asyncio.get_running_loop().run_in_executor(
            self.disk_pool, functools.partial(Manifest.from_json, expect_identity=job.identity), data
        )
        check_limits(m, self.cfg.max_chunks_per_snapshot, self.cfg.max_files_per_snapshot)
        return m, digest
