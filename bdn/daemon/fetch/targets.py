"""The target files of the snapshots downloading on this node, each mapped once (shared,
writable, page tables filled on demand: bdn.transfer.target) and held open as a descriptor too
while its snapshot downloads, so received chunks land in shm with no open per chunk: a peer's
whole answer by ``pwrite`` to the descriptor (``fd``), bucket reads and cut-through answers by
``recv_into`` the mapping.

A mapping is taken with ``acquire(job, path)`` and given back with ``release(path)``; it is
closed once nobody uses it and its snapshot is no longer ``queued``/``downloading`` (checked on
every acquire and by ``sweep``), or by ``close`` at shutdown. A mapping still used by a fetch
thread is never closed (mmap refuses while a buffer is exported; the count comes first), and
neither is its descriptor (a file replaced while in use keeps its old one open until the
process exits: one descriptor per such repair).
"""

from __future__ import annotations

import asyncio
import mmap
import os
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path

from bdn.daemon.snapshots.snapshot import SnapshotJob
from bdn.transfer.target import map_target

ACTIVE = ("queued", "downloading")


@dataclass(eq=False)
class _Mapping:
    job: SnapshotJob
    map: mmap.mmap
    inode: tuple[int, int]  # (st_dev, st_ino) of the file mapped
    fd: int  # the file, open read-write (pwrite), closed with the mapping
    users: int = 0


class TargetMaps:
    """Mappings by target path (see the module docstring); opened on ``disk_pool`` threads."""

    def __init__(self, disk_pool: Executor) -> None:
        self.disk_pool = disk_pool
        self._maps: dict[str, _Mapping] = {}
        self._opening: dict[str, asyncio.Future[_Mapping]] = {}

    async def acquire(self, job: SnapshotJob, path: Path) -> mmap.mmap:
        """The mapping of ``path`` (the whole file, as reserved by the store), counted as used.

        Raises:
            OSError: the file cannot be opened or mapped.
        """
        self.sweep()
        key = str(path)
        ent = self._maps.get(key)
        if ent is not None and ent.job is job and not _same_file(key, ent.inode):
            ent = None  # the file was replaced (a repair recreated one deleted behind our back)
        if ent is None or ent.job is not job:
            fut = self._opening.get(key)
            if fut is None:
                fut = self._opening[key] = asyncio.ensure_future(self._open(job, key))
                fut.add_done_callback(lambda _f: self._opening.pop(key, None))
            ent = await asyncio.shield(fut)
        ent.users += 1
        return ent.map

    async def _open(self, job: SnapshotJob, key: str) -> _Mapping:
        m, inode, fd = await asyncio.get_running_loop().run_in_executor(self.disk_pool, _map_file, key)
        old = self._maps.pop(key, None)
        if old is not None:
            if old.users > 0:  # a fetch thread may still pwrite through it: left to the exit
                old.fd = -1
            self._close(old)
        # release() is by path: users of the replaced mapping give their count back to this one
        ent = self._maps[key] = _Mapping(job, m, inode, fd, old.users if old is not None else 0)
        return ent

    def fd(self, path: Path) -> int:
        """The open descriptor of ``path``'s target file; only while the caller holds it
        (between ``acquire`` and ``release``)."""
        return self._maps[str(path)].fd

    def release(self, path: Path) -> None:
        ent = self._maps.get(str(path))
        if ent is not None:
            ent.users -= 1

    def sweep(self) -> None:
        """Close the unused mappings of snapshots that no longer download."""
        for key, ent in list(self._maps.items()):
            if ent.users <= 0 and ent.job.state not in ACTIVE:
                del self._maps[key]
                self._close(ent)

    def close(self) -> None:
        """Close every mapping (shutdown). A descriptor a fetch thread may still write through
        is left to the process's exit: closed now, its number could be reused by the next
        ``open`` and the late ``pwrite`` land in that file."""
        for ent in self._maps.values():
            if ent.users > 0:
                ent.fd = -1
            self._close(ent)
        self._maps.clear()

    def open_count(self) -> int:
        return len(self._maps)

    @staticmethod
    def _close(ent: _Mapping) -> None:
        if ent.fd >= 0:
            os.close(ent.fd)
            ent.fd = -1
        try:
            ent.map.close()
        except BufferError:
            pass  # a fetch thread still holds a view: the mapping goes when the view does


def _same_file(path: str, inode: tuple[int, int]) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == inode


def _map_file(path: str) -> tuple[mmap.mmap, tuple[int, int], int]:
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)  # never write through a symlink
    try:
        st = os.fstat(fd)
        if st.st_size == 0:
            raise OSError(f"{path} is empty: nothing to map")
        # not populated: a peer's whole answer is pwritten (no page tables needed); a bucket
        # read or a cut-through answer fills them on demand
        return map_target(fd, st.st_size, populate=False), (st.st_dev, st.st_ino), fd
    except BaseException:
        os.close(fd)
        raise
