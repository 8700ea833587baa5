"""The daemon's one way to the bucket: every request runs on the bucket thread pool, chunk and
manifest reads share the ``bucket_concurrency`` semaphore and chunk reads the ``bucket_mbit``
limit. Errors are the bucket's own (``bdn.bucket``: ``ObjectNotFound``, ``BucketError``)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from bdn.bucket import Bucket, BucketError, ObjectNotFound
from bdn.bucket.urls import check_bucket_url
from bdn.daemon.fetch.ratelimit import RateLimit
from bdn.daemon.observe.stats import Stats
from bdn.proto.manifest import STARTUP_NAME

_Buf = TypeVar("_Buf", bytearray, memoryview)  # a chunk buffer, or a view into a chunk's mapping


class BucketIO:
    """``bucket`` behind ``concurrency`` concurrent requests, ``limit`` on chunk bytes."""

    def __init__(
        self,
        bucket: Bucket,
        url: str,
        concurrency: int,
        limit: RateLimit,
        pool: ThreadPoolExecutor,
        stats: Stats,
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
        self,
        key: str,
        offset: int,
        length: int,
        alloc: Callable[[int], _Buf],
        if_match: str | None = None,
        progress: Callable[[int], None] | None = None,
        started: Callable[[], None] | None = None,
    ) -> _Buf:
        """``length`` bytes of ``key`` from ``offset`` (rate-limited) in a buffer from ``alloc``,
        taken only once a bucket slot is free (waiting reads hold no memory). ``if_match``: the
        object's version token (raises ``ObjectChanged`` when it was replaced). ``progress(n)``:
        called on the bucket thread as the first ``n`` bytes land (``Bucket.read_range_into``).
        ``started()``: called on the event loop once the read holds its bucket slot, just before
        the request goes out."""
        await self.limit.take(length)
        async with self.sem:
            if started is not None:
                started()
            self.stats.inflight["bucket"] += 1
            buf = alloc(length)
            try:
                if if_match is None and progress is None:
                    await self._run(self.bucket.read_range_into, key, offset, memoryview(buf))
                else:
                    await self._run(
                        lambda: self.bucket.read_range_into(
                            key, offset, memoryview(buf), if_match=if_match, progress=progress
                        )
                    )
            finally:
                self.stats.inflight["bucket"] -= 1
        return buf

    async def list(self, prefix: str) -> Any:
        """``Bucket.list(prefix)`` on a bucket thread, inside the concurrency limit."""
        async with self.sem:
            return await self._run(self.bucket.list, prefix)

    async def stat(self, key: str) -> Any:
        """``Bucket.stat(key)`` on a bucket thread, inside the concurrency limit."""
        async with self.sem:
            return await self._run(self.bucket.stat, key)

    async def probe(self) -> str | None:
        """Whether the bucket is reachable, cheaply (for readiness): None, or the one-line reason.

        A ``file://`` bucket must be an existing directory; an ``s3://``/``gs://`` bucket must
        answer a listing of the keys that start with ``STARTUP_SNAPSHOT`` (a HEAD cannot tell a
        missing bucket from a missing key: both are a bare 404). Outside the semaphore, so a
        busy download cannot delay it."""
        scheme, root, _ = check_bucket_url(self.url)
        if scheme == "file":
            ok = await self._run(os.path.isdir, root)
            return None if ok else f"{self.url}: no such directory"
        try:
            await self._run(self.bucket.list, STARTUP_NAME)
        except ObjectNotFound:
            return None
        except BucketError as e:
            return str(e)
        return None

    async def empty(self) -> bool:
        """Whether the bucket holds no object under its URL (one short listing; readiness calls
        it after a :meth:`probe` that found the bucket reachable). Raises BucketError."""
        return not await self._run(self.bucket.has_objects)

    def bucket_stats(self) -> dict[str, Any]:
        """The bucket client's counters (requests, bytes, retries), as a dict."""
        return self.bucket.stats.snapshot()

    def close(self) -> None:
        """Close the bucket client's connections."""
        self.bucket.close()
