"""Mappings of buffer files kept populated between steps (DESIGN.md, "Sparse apply").

On this class of VM a write into a page of a file mapped for this one call costs a page fault
(~2.5 us per 4 KiB page): a sparse apply that touches every page (0.1 % of values changed,
scattered) paid more in faults than a copy of the model. A tagged spare is therefore mapped with
``MAP_POPULATE`` in the background when it enters the pool (:meth:`HotMaps.prime`, a disk thread),
the sparse apply writes through that mapping, and the mapping is dropped once the snapshot it
became is READY (:meth:`HotMaps.drop`: the next recycle's write lease needs no other open file
description of the inode, the daemon's own mapping included). Keyed by inode, so a rename into
staging and then into place keeps it. Thread-safe.
"""

from __future__ import annotations

import mmap
import os
import stat
import threading
from pathlib import Path


class HotMaps:
    """Populated read-write mappings of files, by inode."""

    def __init__(self) -> None:
        self._maps: dict[int, mmap.mmap] = {}
        self._lock = threading.Lock()

    def prime(self, path: Path) -> bool:
        """Map ``path`` read-write with its page tables populated (blocking, ~0.3 s a GiB here);
        False when it cannot be (gone, empty, not writable) or is mapped already. A file renamed
        or removed meanwhile is dropped again at once."""
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            return False
        if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
            return False
        with self._lock:
            if st.st_ino in self._maps:
                return False
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            return False
        try:
            m = mmap.mmap(
                fd,
                st.st_size,
                flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                prot=mmap.PROT_READ | mmap.PROT_WRITE,
            )
        except OSError:
            return False
        finally:
            os.close(fd)
        with self._lock:
            self._maps.setdefault(st.st_ino, m)
        try:
            still = os.stat(path, follow_symlinks=False).st_ino == st.st_ino
        except OSError:
            still = False
        if not still:  # taken or trimmed while it was being mapped
            self.drop_inode(st.st_ino)
            return False
        return True

    def get(self, path: Path) -> mmap.mmap | None:
        """The mapping of the file at ``path`` (by its inode), or None."""
        try:
            ino = os.stat(path, follow_symlinks=False).st_ino
        except OSError:
            return None
        with self._lock:
            return self._maps.get(ino)

    def drop(self, path: Path) -> None:
        """Unmap the file at ``path`` if it is mapped here."""
        try:
            self.drop_inode(os.stat(path, follow_symlinks=False).st_ino)
        except OSError:
            pass

    def drop_inode(self, ino: int) -> None:
        """Unmap inode ``ino`` if it is mapped here (a view still exported keeps the mapping
        until that view is gone)."""
        with self._lock:
            m = self._maps.pop(ino, None)
        if m is not None:
            try:
                m.close()
            except BufferError:  # a numpy view still alive: the mapping goes with it
                pass

    def __len__(self) -> int:
        with self._lock:
            return len(self._maps)
