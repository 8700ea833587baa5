"""Every byte and inode a snapshot takes in shared memory, and the reservation that holds the
bytes of its small files (READY, the restart record, progress) from the start of the download.

A snapshot's files are allocated at their sizes before the download (``Store.prepare_staging``);
the small files bdn writes beside them (the READY marker: 40 bytes per rebuilt chunk; the record
of ``bdn.daemon.snapshots.records``: the manifest again; the progress file, written as a new file then
renamed over the old one) were left out, so a tmpfs filled to 96 % or more passed the check and
then failed at READY after the whole download, or logged "cannot save progress" per save (issue
31). ``room(m)`` counts them, and the page each file rounds up to (tmpfs allocates whole pages),
and the inodes (every file and directory); ``Reserve`` holds the small files' bytes in one
allocated file, ``.staging/.reserve-<identity>``, which is shrunk exactly when one of them is
written and freed before READY.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from bdn.proto.manifest import Manifest

#: JSON bytes per chunk digest in READY and in the manifest (indent 1: 4 spaces, quotes, comma, newline).
_PER_DIGEST = 41
#: JSON bytes per file around its path and digests (keys, indents, a size up to 2^50), an upper bound.
_PER_FILE = 96
#: The rest of a READY marker, a record or a progress file (format, identity, numbers), an upper bound.
_FIXED = 1024


@dataclass(frozen=True)
class Room:
    """What a snapshot takes: ``files`` bytes of its data files (page-rounded), ``small`` bytes
    of READY, record and progress (page-rounded, the reservation), ``inodes``."""

    files: int
    small: int
    inodes: int

    @property
    def bytes(self) -> int:
        """Every byte: the data files and the small files."""
        return self.files + self.small


def pages(n: int, page: int) -> int:
    """``n`` bytes rounded up to whole ``page``-byte pages (what tmpfs allocates)."""
    return -(-n // page) * page


def _json_path(path: str) -> int:
    return len(json.dumps(path))  # as READY and the manifest write it (ASCII, escapes)


def small_files(m: Manifest) -> tuple[int, int, int]:
    """Upper bounds of ``(READY bytes, record bytes, progress bytes)`` for snapshot ``m``."""
    ready = _FIXED + sum(_PER_FILE + _json_path(f.path) + _PER_DIGEST * len(f.result_chunks) for f in m.files)
    record = _FIXED + sum(
        2 * _PER_FILE + _json_path(f.path) + _PER_DIGEST * (len(f.chunks) + (len(f.result_chunks) if f.is_diff else 0))
        for f in m.files
    )
    n_stored = sum(len(f.chunks) for f in m.files)
    n_result = sum(len(f.result_chunks) for f in m.files)
    progress = _FIXED + (n_stored + 7) // 8 + (n_result + 7) // 8
    return ready, record, progress


def room(m: Manifest, page: int = 4096) -> Room:
    """Bytes and inodes snapshot ``m`` takes on a file system with ``page``-byte pages: its
    rebuilt files and a delta's stored diff files, each page-rounded; READY, the record and two
    progress files (the new one is written before the old one goes); an inode per file and per
    directory (the staging and stored trees), plus the reservation file's."""
    data = sum(pages(f.result_size, page) for f in m.files)
    data += sum(pages(f.size, page) for f in m.files if f.is_diff)
    ready, record, progress = small_files(m)
    small = pages(ready, page) + pages(record, page) + 2 * pages(progress, page)
    dirs = _dirs(f.path for f in m.files)
    diff_dirs = _dirs(f.path for f in m.files if f.is_diff)
    n_diff = sum(1 for f in m.files if f.is_diff)
    inodes = len(m.files) + 1 + len(dirs)  # the files, the staging directory, its subdirectories
    inodes += (n_diff + 1 + len(diff_dirs)) if n_diff else 0  # the stored tree
    inodes += 5  # READY, the record, two progress files, the reservation
    return Room(data, small, inodes)


def _dirs(paths: Iterable[str]) -> set[str]:
    """Every directory above the ``/``-separated relative ``paths`` (not the root)."""
    out: set[str] = set()
    for p in paths:
        i = p.rfind("/")
        while i > 0:
            d = p[:i]
            if d in out:
                break
            out.add(d)
            i = p.rfind("/", 0, i)
    return out


def allocated(st: os.stat_result) -> bool:
    """True when the file of ``st`` has a block behind every byte of its size (``st_blocks`` is in
    512-byte units, stat(2)): no unallocated hole, so ``posix_fallocate`` has nothing to add. One
    ``fstat``, where fallocate and ``SEEK_HOLE`` walk every page of the file (30 and 15 ms for
    589 MB of tmpfs here: a cost per step proportional to the model, not to what changed)."""
    return st.st_blocks * 512 >= st.st_size


def grow(path: Path, size: int, mode: int = 0o600) -> None:
    """``path`` (created with ``mode`` if missing, never through a symlink) at ``size`` bytes with
    its space allocated (``posix_fallocate``; a file system without it keeps the sparse file). A
    file whose blocks already cover ``size`` (a recycled spare, a buffer brought forward in
    place) is only truncated: its pages are there.
    Raises OSError: ENOSPC/EDQUOT when the space is not there."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, mode)
    try:
        os.ftruncate(fd, size)
        if size and not allocated(os.fstat(fd)):
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
    finally:
        os.close(fd)


class Reserve:
    """The reservation file of one snapshot: ``hold(size)`` allocates it, ``lend(new, old)``
    around the write of a small file, ``release()`` before READY."""

    def __init__(self, path: Path, page: int = 4096) -> None:
        self.path = path
        self.page = page

    def hold(self, size: int) -> None:
        """Allocate ``size`` bytes (raises OSError, ENOSPC when they are not there)."""
        grow(self.path, size)

    def size(self) -> int:
        """The bytes held (0 when there is no reservation)."""
        try:
            return os.lstat(self.path).st_size
        except FileNotFoundError:
            return 0

    @contextlib.contextmanager
    def lend(self, new_bytes: int, old_bytes: int) -> Iterator[None]:
        """Around the write of a file of ``new_bytes`` that replaces one of ``old_bytes``: the
        reservation shrinks by the new file's pages first and grows back by the old file's once
        it is gone, so the reservation plus the small files stay the same size. Without a
        reservation (none held) it does nothing. A grow that fails leaves the reservation
        smaller (the body's errors propagate; the grow's are not raised)."""
        held = self.size()
        if not held:
            yield
            return
        new, old = pages(new_bytes, self.page), pages(old_bytes, self.page)
        os.truncate(self.path, max(0, held - new))
        done = False
        try:
            yield
            done = True
        finally:
            back = max(0, held - new) + (old if done else new)
            with contextlib.suppress(OSError):
                grow(self.path, back)

    def release(self) -> None:
        """Free the reservation (READY and the record are written next)."""
        self.path.unlink(missing_ok=True)
