"""The daemon's worker threads, one pool per kind of blocking work, so that a slow bucket read
cannot stall the preads of uploads, and a long delta apply cannot stall either.

- ``bucket``: bucket requests (``bucket_concurrency`` + 2 threads: chunk reads are bounded by the
  bucket semaphore, manifest and ``STARTUP_SNAPSHOT`` reads get the spare ones);
- ``disk``: hashing and writing chunks, copies, preads for uploads, resume re-verification;
- ``apply``: delta apply and the rebuilt files' verification (``bdn.proto.arc`` decodes on its
  own threads inside one such call);
- ``background``: work no hot-load waits for (a freed spare's catch-up, a background seed, the
  scrub's hashing), on ``BACKGROUND_THREADS`` threads whose nice value is raised by
  ``background_nice`` (``bdn.priority``), so that it gives the cores to the critical path; a
  task the critical path waits for is raised back (``priority.boost_lowered``).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from bdn.priority import BACKGROUND_NICE, LoweredPool

DISK_THREADS = 8
APPLY_THREADS = 2
BACKGROUND_THREADS = 2


@dataclass
class Executors:
    """The four worker pools: ``bucket``, ``disk``, ``apply``, ``background`` (see the module docstring)."""

    bucket: ThreadPoolExecutor
    disk: ThreadPoolExecutor
    apply: ThreadPoolExecutor
    background: LoweredPool

    @classmethod
    def create(cls, bucket_concurrency: int, background_nice: int = BACKGROUND_NICE) -> Executors:
        """The four pools: ``bucket_concurrency + 2`` threads for the bucket, ``DISK_THREADS`` for
        disk work, ``APPLY_THREADS`` for delta apply, ``BACKGROUND_THREADS`` at nice
        ``+background_nice`` (0..19) for background work."""
        return cls(
            bucket=ThreadPoolExecutor(max_workers=bucket_concurrency + 2, thread_name_prefix="bdn-bucket"),
            disk=ThreadPoolExecutor(max_workers=DISK_THREADS, thread_name_prefix="bdn-disk"),
            apply=ThreadPoolExecutor(max_workers=APPLY_THREADS, thread_name_prefix="bdn-apply"),
            background=LoweredPool(BACKGROUND_THREADS, "bdn-background", background_nice),
        )

    def shutdown(self) -> None:
        """Stop every pool without waiting; queued work is cancelled."""
        for ex in (self.bucket, self.disk, self.apply, self.background):
            ex.shutdown(wait=False, cancel_futures=True)
