"""The lock of one ``shm_dir`` (one bdnd per directory) and the "no room" report of a full shm.

:class:`ShmLock` is taken first at start (``bdn.daemon.main``), before the store touches any file;
:class:`ShmFull` and :func:`room_line` are what a full tmpfs or inode table is reported with.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from bdn.proto.errors import BdnError

LOCK_NAME = "bdnd.lock"


class ShmInUse(BdnError):
    """Another process holds the lock of the ``shm_dir`` (message names its pid)."""


class ShmFull(BdnError):
    """The ``shm_dir`` has no room (bytes or inodes) for the store's own directories at start
    (one line with the numbers; bdnd exits 2)."""


def room_line(path: Path) -> str:
    """ "N of M bytes, I of J inodes free on PATH" (statvfs; what a "no space" line quotes)."""
    try:
        st = os.statvfs(path)
    except OSError as e:
        return f"{path}: {e.strerror or e}"
    return (
        f"{st.f_bavail * st.f_frsize} of {st.f_blocks * st.f_frsize} bytes, "
        f"{st.f_favail} of {st.f_files} inodes free on {path}"
    )


def existing(p: Path) -> Path:
    """``p`` or its nearest existing parent (what statvfs can be asked about)."""
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


class ShmLock:
    """The exclusive lock of one ``shm_dir`` (``<shm_dir>/bdnd.lock``), held for the process's life.

    Two daemons on one ``shm_dir`` would resume each other's half-written files; the second must
    stop before it touches anything. The lock is a ``flock`` on the open file (released by the
    kernel when the process dies, however it dies); the file holds the holder's pid, for the
    error message only.
    """

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd = fd

    @classmethod
    def acquire(cls, shm_dir: str | os.PathLike[str]) -> ShmLock:
        """Take the lock of ``shm_dir`` (created if missing).

        Raises:
            ShmInUse: another process holds it ("shm_dir X is in use by pid N").
            BdnError: the directory or the lock file cannot be created or opened.
        """
        d = Path(shm_dir)
        path = d / LOCK_NAME
        try:
            d.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise ShmFull(
                    f"shm_dir {str(d)!r} is full, bdnd cannot create its lock file: "
                    f"{room_line(existing(d))} (free some, or give it a larger tmpfs)"
                ) from None
            raise BdnError(f"cannot lock shm_dir {str(d)!r}: {e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            try:
                pid = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            except OSError:
                pid = ""
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                who = f"pid {pid}" if pid.isdigit() else "another process"
                raise ShmInUse(f"shm_dir {str(d)!r} is in use by {who} (one bdnd per shm_dir)") from None
            raise BdnError(f"cannot lock shm_dir {str(d)!r}: {e.strerror or e}") from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:  # a full tmpfs: the pid is for messages only, the lock is held
            pass
        return cls(path, fd)

    def release(self) -> None:
        """Drop the lock (the process exiting does the same)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
