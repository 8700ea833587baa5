"""``file:///abs/path``: a plain directory as the bucket (the embedded default).

Keys map to files under the root. Every path is resolved (symlinks too) and must stay inside the
resolved root, so neither a crafted key nor a symlink planted in the directory reads or writes
outside it. Writes go to a temporary file in the target directory, are fsynced, and are renamed
into place with ``os.replace`` (atomic on POSIX), so a reader sees the old object or the new one.

ETag (the version token): ``"<size hex>-<st_mtime_ns hex>-<st_ino hex>"``. It changes whenever
a write replaces the file (``os.replace``: a new inode) or rewrites it in place (a new mtime), and
costs no read of the content. A conditional read (``if_match``) compares the token of the opened
file before and after reading: a file replaced by rename before the open, or written in place
during the read, raises :class:`ObjectChanged`; one replaced by rename after the open is read
whole from the version that was asked for (the open descriptor keeps the old inode). A directory
has no checksum of its content (see docs/TRUST.md).
"""

from __future__ import annotations

import errno
import os
import shutil
import stat as stat_mod
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from bdn.bucket.base import (
    DEFAULT_MAX_READ,
    PROGRESS_BYTES,
    AccessDenied,
    Bucket,
    BucketError,
    BucketStats,
    ObjectChanged,
    ObjectInfo,
    ObjectNotFound,
    as_byte_view,
    validate_key,
    validate_prefix,
)
from bdn.proto.errors import PathError

#: Temporary files of in-flight writes start with this; ``list`` never shows them.
TEMP_PREFIX = ".bdn-tmp-"


def file_etag(st: os.stat_result) -> str:
    """The etag of a ``file://`` object from its ``stat``: ``"<size hex>-<mtime_ns hex>-<inode hex>"``."""
    return f"{st.st_size:x}-{st.st_mtime_ns:x}-{st.st_ino:x}"


class FileBucket(Bucket):
    """A directory as a bucket. ``root`` is an absolute local path; it need not exist yet."""

    def __init__(self, url: str, root: str | os.PathLike[str]) -> None:
        self.url = url
        self.stats = BucketStats()
        root_path = Path(root)
        if not root_path.is_absolute():
            raise BucketError(f"file bucket root must be absolute: {url}")
        self._root = root_path
        # Resolved lazily per call: the root may be created (or become a symlink) after open.
        self._closed = False

    # -- paths ---------------------------------------------------------------------------------

    def _real_root(self) -> Path:
        return Path(os.path.realpath(self._root))

    def _path(self, key: str) -> Path:
        """The resolved local path of a validated key, refused if it escapes the root."""
        validate_key(key)
        root = self._real_root()
        real = Path(os.path.realpath(root / key))
        if real != root and root not in real.parents:
            raise PathError(f"bucket key escapes {self.url}: {key!r}")
        return real

    def _oserror(self, op: str, key: str, exc: OSError) -> BucketError:
        where = self._where(key)
        if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.EISDIR):
            return ObjectNotFound(f"object not found: {where}")
        if exc.errno in (errno.EACCES, errno.EPERM):
            return AccessDenied(f"{op} {where}: permission denied")
        return BucketError(f"{op} {where}: {exc.strerror or exc}")

    # -- reads ---------------------------------------------------------------------------------

    def stat(self, key: str) -> ObjectInfo:
        """``os.stat`` of the key's file: its size in bytes and :func:`file_etag`. Raises
        :class:`ObjectNotFound` (also for a directory), :class:`AccessDenied`, ``PathError``."""
        path = self._path(key)
        self.stats.add(head_requests=1)
        try:
            st = os.stat(path)
        except OSError as exc:
            raise self._oserror("stat", key, exc) from None
        if not stat_mod.S_ISREG(st.st_mode):
            raise ObjectNotFound(f"object not found: {self._where(key)}")
        return ObjectInfo(key=key, size=st.st_size, etag=file_etag(st))

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every regular file under the root whose key starts with ``prefix``, sorted by key.

        Walks only the deepest directory ``prefix`` names in full; skips in-flight writes
        (``TEMP_PREFIX``), files that vanish mid-walk, symlinks that lead outside the root and
        names that break the key rules. A missing directory lists as ``[]``. Raises ``PathError``
        for a prefix that escapes the root."""
        validate_prefix(prefix)
        root = self._real_root()
        # Walk only the deepest directory the prefix names in full; the rest is a string filter.
        head = prefix.rpartition("/")[0]
        start = Path(os.path.realpath(root / head)) if head else root
        if start != root and root not in start.parents:
            raise PathError(f"bucket prefix escapes {self.url}: {prefix!r}")
        self.stats.add(list_requests=1)
        found: list[ObjectInfo] = []
        if not start.is_dir():
            return found
        # os.walk does not follow directory symlinks, so the walk itself cannot leave the root;
        # file symlinks are resolved and checked below.
        for dirpath, dirnames, filenames in os.walk(start, onerror=None):
            dirnames[:] = [d for d in dirnames if not d.startswith(TEMP_PREFIX)]
            for name in filenames:
                if name.startswith(TEMP_PREFIX):
                    continue
                full = Path(dirpath) / name
                key = full.relative_to(root).as_posix()
                if not key.startswith(prefix):
                    continue
                try:
                    validate_key(key)
                    real = Path(os.path.realpath(full))
                    if root not in real.parents:
                        continue
                    st = os.stat(real)
                except (PathError, OSError):
                    continue  # vanished mid-walk, or a name no other backend could hold
                if stat_mod.S_ISREG(st.st_mode):
                    found.append(ObjectInfo(key=key, size=st.st_size, etag=file_etag(st)))
        found.sort(key=lambda info: info.key)
        return found

    def has_objects(self) -> bool:
        """Whether the root holds any regular file (not an in-flight write); stops at the first."""
        self.stats.add(list_requests=1)
        for _dirpath, dirnames, filenames in os.walk(self._real_root()):
            dirnames[:] = [d for d in dirnames if not d.startswith(TEMP_PREFIX)]
            if any(not n.startswith(TEMP_PREFIX) for n in filenames):
                return True
        return False

    def read(self, key: str, max_size: int = DEFAULT_MAX_READ) -> bytes:
        """The whole file; :class:`BucketError` if it is (or grows) over ``max_size`` bytes,
        :class:`ObjectNotFound` / :class:`AccessDenied` from the open."""
        path = self._path(key)
        self.stats.add(get_requests=1)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size > max_size:
                    raise BucketError(f"object {self._where(key)} is {size} bytes, over the {max_size}-byte limit")
                # Read one byte past the limit: the file may have grown since fstat.
                data = f.read(max_size + 1)
        except OSError as exc:
            raise self._oserror("read", key, exc) from None
        if len(data) > max_size:
            raise BucketError(f"object {self._where(key)} is over the {max_size}-byte limit")
        self.stats.add(get_bytes=len(data))
        return data

    def read_range_into(
        self,
        key: str,
        offset: int,
        out: memoryview,
        *,
        if_match: str | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        """``os.preadv`` from ``offset`` straight into ``out`` (pieces of ``PROGRESS_BYTES`` with
        ``progress``). ``if_match``: the :func:`file_etag` of the opened file must equal it before
        and after the read, else :class:`ObjectChanged`. Raises :class:`BucketError` for a
        negative offset or a file that ends before ``offset + len(out)``."""
        view = as_byte_view(out)
        if offset < 0:
            raise BucketError(f"negative offset {offset} for {self._where(key)}")
        path = self._path(key)
        self.stats.add(get_requests=1)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise self._oserror("read", key, exc) from None
        done = 0
        try:
            if if_match is not None:
                self._check_token(fd, key, if_match)
            step = PROGRESS_BYTES if progress is not None else len(view)
            while done < len(view):
                n = os.preadv(fd, [view[done : done + step]], offset + done)
                if n == 0:
                    raise BucketError(
                        f"short read of {self._where(key)}: wanted {len(view)} bytes at offset"
                        f" {offset}, the object ends after {done}"
                    )
                done += n
                if progress is not None:
                    progress(done)
            if if_match is not None:
                self._check_token(fd, key, if_match)
        except OSError as exc:
            raise self._oserror("read", key, exc) from None
        finally:
            os.close(fd)
            self.stats.add(get_bytes=done)

    def _check_token(self, fd: int, key: str, if_match: str) -> None:
        token = file_etag(os.fstat(fd))
        if token != if_match:
            raise ObjectChanged(
                f"object changed while it was read: {self._where(key)} (version {if_match!r} asked, {token!r} found)",
                key,
            )

    # -- writes --------------------------------------------------------------------------------

    def _prepare_parent(self, key: str) -> Path:
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise self._oserror("write", key, exc) from None
        # mkdir may have walked through a symlink created meanwhile: check again.
        return self._path(key)

    def _commit(self, key: str, fill: Callable[[BinaryIO], int]) -> None:
        path = self._prepare_parent(key)
        fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                size = fill(f)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException as exc:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            if isinstance(exc, OSError):
                raise self._oserror("write", key, exc) from None
            raise
        self._fsync_dir(path.parent)
        self.stats.add(put_requests=1, put_bytes=size)

    @staticmethod
    def _fsync_dir(directory: Path) -> None:
        # Make the rename (or link) itself durable, as an object store's PUT is.
        try:
            dir_fd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError:
            pass

    def write(self, key: str, data: bytes | bytearray | memoryview) -> None:
        """Write ``data`` to a temporary file beside the key's, fsync it, rename it into place
        (``os.replace``) and fsync the directory. Raises :class:`BucketError` / :class:`AccessDenied`."""

        def fill(f: BinaryIO) -> int:
            return f.write(data)

        self._commit(key, fill)

    def write_new(self, key: str, data: bytes | bytearray | memoryview) -> bool:
        """As :meth:`write`, but the temporary file is hard-linked into place (``os.link`` fails
        when the key exists: then False and nothing changes) instead of renamed over it."""
        path = self._prepare_parent(key)
        fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
        except OSError as exc:
            raise self._oserror("write", key, exc) from None
        finally:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        self._fsync_dir(path.parent)
        self.stats.add(put_requests=1, put_bytes=len(memoryview(data).cast("B")))
        return True

    def write_file(self, key: str, path: str | os.PathLike[str]) -> None:
        """Copy the local file at ``path`` (1 MiB at a time) as :meth:`write` stores bytes.
        Raises :class:`BucketError` when ``path`` cannot be read."""
        try:
            src = open(path, "rb")
        except OSError as exc:
            raise BucketError(f"cannot read {os.fspath(path)!r}: {exc.strerror or exc}") from None

        def fill(f: BinaryIO) -> int:
            shutil.copyfileobj(src, f, 1 << 20)
            return src.tell()

        with src:
            self._commit(key, fill)

    def write_buffers(self, key: str, buffers: Sequence[Any]) -> None:
        """Write the buffers one after the other (no join) as :meth:`write` stores bytes."""

        def fill(f: BinaryIO) -> int:
            n = 0
            for b in buffers:
                n += f.write(b)
            return n

        self._commit(key, fill)

    def close(self) -> None:
        """Nothing to release (no descriptor outlives a call); marks the bucket closed."""
        self._closed = True
