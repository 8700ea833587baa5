"""Open descriptors of the chunk files the transfer server sends from (``os.sendfile`` needs an
fd; reopening per chunk cost an ``open``/``close`` pair per request), shared by its connection
threads. Thread-safe; no other state.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict


class FileCache:
    """Open descriptors of chunk files by path, at most ``limit`` (least recently used closed
    first), each checked against the path's current inode so a replaced file is reopened."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._open: OrderedDict[str, list] = OrderedDict()  # path -> [fd, dev, ino, users, stale]

    def acquire(self, path: str) -> tuple[int, list] | None:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            self.forget(path)
            return None
        with self._lock:
            ent = self._open.get(path)
            if ent is not None and (ent[1], ent[2]) == (st.st_dev, st.st_ino):
                ent[3] += 1
                self._open.move_to_end(path)
                return ent[0], ent
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        fst = os.fstat(fd)
        new = [fd, fst.st_dev, fst.st_ino, 1, False]
        with self._lock:
            old = self._open.pop(path, None)
            if old is not None:
                self._retire(old)
            self._open[path] = new
            while len(self._open) > self._limit:
                _, ent = self._open.popitem(last=False)
                self._retire(ent)
        return fd, new

    def release(self, ent: list) -> None:
        with self._lock:
            ent[3] -= 1
            if ent[4] and ent[3] == 0:
                os.close(ent[0])

    def _retire(self, ent: list) -> None:  # lock held
        if ent[3] == 0:
            os.close(ent[0])
        else:
            ent[4] = True  # closed by the last user

    def forget(self, path: str) -> None:
        with self._lock:
            ent = self._open.pop(str(path), None)
            if ent is not None:
                self._retire(ent)

    def close(self) -> None:
        with self._lock:
            while self._open:
                self._retire(self._open.popitem()[1])
