"""Storing a snapshot's objects: every file under ``<identity>/`` in parallel, each file's chunk
digests computed on the same worker thread (xxhash releases the GIL), a file that changes while
it is sent refused. The bucket splits large files into parallel multipart parts itself."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from bdn import fileops
from bdn.bucket import Bucket, validate_key
from bdn.proto.manifest import FileEntry, FileResult
from bdn.publish.errors import PublishError

#: Called with a number of bytes each time that many more bytes were stored in the bucket.
ProgressFn = Callable[[int], object]


@dataclass(frozen=True)
class Upload:
    """One object to store: snapshot ``path``, the local file to send, and for a diff the result."""

    path: str
    local: Path
    result: FileResult | None = None


def store_all(
    b: Bucket,
    identity: str,
    uploads: list[Upload],
    chunk_size: int,
    workers: int,
    progress: ProgressFn | None,
) -> list[FileEntry]:
    """Store every upload under ``<identity>/`` in parallel; their entries, in upload order.

    ``chunk_size``: bytes per digest; ``workers``: threads; ``progress``: called with each stored
    file's size in bytes. Raises PathError (before anything is stored) for a path no bucket key
    may have, PublishError for a file unreadable or changed while it was sent, BucketError.
    """
    for u in uploads:
        # Before the first byte moves: a path too long for a bucket key should not fail midway.
        validate_key(f"{identity}/{u.path}")
    lock = threading.Lock()

    def one(u: Upload) -> FileEntry:
        try:
            before = os.stat(u.local)
        except OSError as e:
            raise PublishError(f"cannot read {u.path!r}: {e.strerror or e}") from None
        chunks = digests(u.local, chunk_size, u.path)
        b.write_file(f"{identity}/{u.path}", u.local)
        after = os.stat(u.local)
        if (before.st_size, before.st_mtime_ns) != (after.st_size, after.st_mtime_ns):
            raise PublishError(f"{u.path!r} changed while it was being published")
        if progress is not None:
            with lock:
                progress(after.st_size)
        return FileEntry(u.path, after.st_size, tuple(chunks), u.result)

    return run_all(one, uploads, workers)


def digests(local: Path, chunk_size: int, path: str) -> list[str]:
    """The xxh3-128 digests of ``local``'s chunks of ``chunk_size`` bytes; PublishError naming ``path`` if unreadable."""
    try:
        return fileops.chunk_digests(local, chunk_size)
    except OSError as e:
        raise PublishError(f"cannot read {path!r}: {e.strerror or e}") from None


def run_all(fn: Callable, items: list, workers: int) -> list:
    """``[fn(x) for x in items]`` on ``workers`` threads; the first error cancels what has not
    started and is raised once the running calls have finished."""
    if not items:
        return []
    ex = ThreadPoolExecutor(max_workers=max(1, min(workers, len(items))), thread_name_prefix="bdn-publish")
    try:
        futures: list[Future] = [ex.submit(fn, x) for x in items]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        for f in done:
            if (e := f.exception()) is not None:
                ex.shutdown(wait=True, cancel_futures=True)
                raise e
        return [f.result() for f in futures]
    finally:
        ex.shutdown(wait=True, cancel_futures=True)
