"""The target files of the snapshots downloading on this node, each mapped once (shared,
writable, page tables populated: bdn.transfer.target) and kept open while its snapshot
downloads, so received chunks land in shm with one kernel copy and no open per chunk.

Peer fetches over the wire take the file's descriptor instead (``acquire_fd``/``release_fd``:
the stream's cache-hot buffer is hashed and ``pwrite``n at the chunk's offset). On tmpfs a
full-page write into a reserved file skips the zeroing that populating a mapping costs, which
bench/transfer/pagefill measured as most of a receiver's CPU here (fresh 1 GiB: fallocate +
pwrite 0.55 CPU-s, fallocate + populate + memcpy 0.9-1.2 CPU-s).

A mapping is taken with ``acquire(job, path)`` and given back with ``release(path)``; it is
closed once nobody uses it and its snapshot is no longer ``queued``/``downloading`` (checked on
every acquire and by ``sweep``), or by ``close`` at shutdown. A mapping still used by a fetch
thread is never closed (mmap refuses while a buffer is exported; the count comes first).
"""

from __future__ import annotations

import asyncio
import mmap
import os
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path

from bdn.daemon.snapshot import SnapshotJob
from bdn.transfer.target import map_target

ACTIVE = ("queued", "downloading")


@dataclass(eq=False)
class _Mapping:
    job: SnapshotJob
    map: mmap.mmap
    users: int = 0


@dataclass(eq=False)
class _Fd:
    job: SnapshotJob
    fd: int
    users: int = 0


class TargetMaps:
    """Mappings by target path (see the module docstring); opened on ``disk_pool`` threads."""

    def __init__(self, disk_pool: Executor) -> None:
        self.disk_pool = disk_pool
        self._maps: dict[str, _Mapping] = {}
        self._opening: dict[str, asyncio.Future[_Mapping]] = {}
        self._fds: dict[str, _Fd] = {}

    def acquire_fd(self, job: SnapshotJob, path: Path) -> int:
        """An open read-write descriptor of ``path`` (opened once per snapshot download and
        kept), counted as used until ``release_fd``. Opening is one system call, on the loop.

        Raises:
            OSError: the file cannot be opened.
        """
        self.sweep()
        key = str(path)
        ent = self._fds.get(key)
        if ent is None or ent.job is not job:
            if ent is not None and ent.users <= 0:
                os.close(ent.fd)
            ent = self._fds[key] = _Fd(job, os.open(key, os.O_RDWR | os.O_CLOEXEC))
        ent.users += 1
        return ent.fd

    def release_fd(self, path: Path, fd: int) -> None:
        ent = self._fds.get(str(path))
        if ent is not None and ent.fd == fd:
            ent.users -= 1
            return
        os.close(fd)  # its entry was replaced while in use: the last user closes it

    async def acquire(self, job: SnapshotJob, path: Path) -> mmap.mmap:
        """The mapping of ``path`` (the whole file, as reserved by the store), counted as used.

        Raises:
            OSError: the file cannot be opened or mapped.
        """
        self.sweep()
        key = str(path)
        ent = self._maps.get(key)
        if ent is None or ent.job is not job:
            fut = self._opening.get(key)
            if fut is None:
                fut = self._opening[key] = asyncio.ensure_future(self._open(job, key))
                fut.add_done_callback(lambda _f: self._opening.pop(key, None))
            ent = await asyncio.shield(fut)
        ent.users += 1
        return ent.map

    async def _open(self, job: SnapshotJob, key: str) -> _Mapping:
        m = await asyncio.get_running_loop().run_in_executor(self.disk_pool, _map_file, key)
        old = self._maps.pop(key, None)
        if old is not None:
            self._close(old)
        ent = self._maps[key] = _Mapping(job, m)
        return ent

    def release(self, path: Path) -> None:
        ent = self._maps.get(str(path))
        if ent is not None:
            ent.users -= 1

    def sweep(self) -> None:
        """Close the unused mappings and descriptors of snapshots that no longer download."""
        for key, ent in list(self._maps.items()):
            if ent.users <= 0 and ent.job.state not in ACTIVE:
                del self._maps[key]
                self._close(ent)
        for key, fe in list(self._fds.items()):
            if fe.users <= 0 and fe.job.state not in ACTIVE:
                del self._fds[key]
                os.close(fe.fd)

    def close(self) -> None:
        for ent in self._maps.values():
            self._close(ent)
        self._maps.clear()
        for fe in self._fds.values():
            if fe.users <= 0:
                os.close(fe.fd)
        self._fds.clear()

    def open_count(self) -> int:
        return len(self._maps) + len(self._fds)

    @staticmethod
    def _close(ent: _Mapping) -> None:
        try:
            ent.map.close()
        except BufferError:
            pass  # a fetch thread still holds a view: the mapping goes when the view does


def _map_file(path: str) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            raise OSError(f"{path} is empty: nothing to map")
        return map_target(fd, size)
    finally:
        os.close(fd)  # the mapping keeps its own reference to the file
