"""The daemon's one way to the bucket: every request runs on the bucket thread pool, chunk and
manifest reads share the ``bucket_concurrency`` semaphore and chunk reads the ``bucket_mbit``
limit. Errors are the bucket's own (``bdn.bucket``: ``ObjectNotFound``, ``BucketError``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bdn.bucket import Bucket
from bdn.daemon.ratelimit import RateLimit
from bdn.daemon.stats import Stats


class BucketIO:
    """``bucket`` behind ``concurrency`` concurrent requests, ``limit`` on chunk bytes."""

    def __init__(
        self, bucket: Bucket, url: str, concurrency: int, limit: RateLimit, pool: ThreadPoolExecutor, stats: Stats,
    ) -> None:
        self.bucket = bucket
        self.url = url  # for messages
        self.sem = asyncio.Semaphore(concurrency)
        self.limit = limit
        self.pool = pool
        self.stats = stats

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def read(self, key: str) -> bytes:
        """The whole object ``key`` (a manifest, ``STARTUP_SNAPSHOT``), within the semaphore."""
        async with self.sem:
            return await self._run(self.bucket.read, key)

    async def read_unbounded(self, key: str) -> bytes:
        """The whole object ``key`` outside the semaphore (``STARTUP_SNAPSHOT`` at start)."""
        return await self._run(self.bucket.read, key)

    async def read_chunk(
        self, key: str, offset: int, length: int, alloc: Callable[[int], bytearray], if_match: str | None = None,
    ) -> bytearray:
        """``length`` bytes of ``key`` from ``offset`` (rate-limited) in a buffer from ``alloc``,
        taken only once a bucket slot is free (waiting reads hold no memory). ``if_match``: the
        object's version token (raises ``ObjectChanged`` when it was replaced)."""
        await self.limit.take(length)
        async with self.sem:
            self.stats.inflight["bucket"] += 1
            buf = alloc(length)
            try:
                if if_match is None:
                    await self._run(self.bucket.read_range_into, key, offset, memoryview(buf))
                else:
                    await self._run(lambda: self.bucket.read_range_into(key, offset, memoryview(buf), if_match=if_match))
            finally:
                self.stats.inflight["bucket"] -= 1
        return buf

    async def list(self, prefix: str) -> Any:
        async with self.sem:
            return await self._run(self.bucket.list, prefix)

    async def stat(self, key: str) -> Any:
        async with self.sem:
            return await self._run(self.bucket.stat, key)

    def bucket_stats(self) -> dict[str, Any]:
        return self.bucket.stats.snapshot()

    def close(self) -> None:
        self.bucket.close()
