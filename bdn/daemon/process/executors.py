"""The daemon's worker threads, one pool per kind of blocking work, so that a slow bucket read
cannot stall the preads of uploads, and a long delta apply cannot stall either.

- ``bucket``: bucket requests (``bucket_concurrency`` + 2 threads: chunk reads are bounded by the
  bucket semaphore, manifest and ``STARTUP_SNAPSHOT`` reads get the spare ones);
- ``disk``: hashing and writing chunks, copies, preads for uploads, resume re-verification;
- ``apply``: delta apply and the rebuilt files' verification (``bdn.proto.arc`` decodes on its
  own threads inside one such call).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

DISK_THREADS = 8
APPLY_THREADS = 2


@dataclass
class Executors:
    """The three worker pools: ``bucket``, ``disk``, ``apply`` (see the module docstring)."""

    bucket: ThreadPoolExecutor
    disk: ThreadPoolExecutor
    apply: ThreadPoolExecutor

    @classmethod
    def create(cls, bucket_concurrency: int) -> Executors:
        """The three pools: ``bucket_concurrency + 2`` threads for the bucket, ``DISK_THREADS`` for disk work, ``APPLY_THREADS`` for delta apply."""
        return cls(
            bucket=ThreadPoolExecutor(max_workers=bucket_concurrency + 2, thread_name_prefix="bdn-bucket"),
            disk=ThreadPoolExecutor(max_workers=DISK_THREADS, thread_name_prefix="bdn-disk"),
            apply=ThreadPoolExecutor(max_workers=APPLY_THREADS, thread_name_prefix="bdn-apply"),
        )

    def shutdown(self) -> None:
        """Stop every pool without waiting; queued work is cancelled."""
        for ex in (self.bucket, self.disk, self.apply):
            ex.shutdown(wait=False, cancel_futures=True)
