"""The page pool: shm files of collected snapshots kept as spares, to become the next snapshot's
files, so that fresh pages are not paid for on the critical path (docs/decisions/0010-page-pool-write-lease.md).

Why: on this class of VM reserving and zeroing fresh tmpfs pages costs 0.5-1.1 CPU-s per GiB
(``bench/transfer/pagefill``), 5-8x a copy into pages that already exist, and in RL
post-training a node receives a new snapshot every step while GC drops an old one: the pages
exist. A spare file is renamed into the new snapshot's staging directory and truncated to the
file's size, so receiving is a copy into existing pages. Its old bytes are never handed out:
every chunk of a staging file is written and verified before READY, exactly as for a fresh one.

When a file may become a spare: an engine that mapped or opened a file must never see its bytes
change. The collected snapshot's directory is first renamed away from its identity (no new
``open`` by path reaches it), then each file is recycled only under a write lease
(``fcntl(F_SETLEASE, F_WRLCK)``): Linux grants it only when no other open file description of
the inode exists, in any process (fs/locks.c ``check_conflicting_open``: the inode's read and
write open counts must be the lease holder's own), and a mapping keeps its file description alive
after its descriptor is closed; bdnd's own descriptors count too (a send still in flight keeps
its file). Holding the lease, the file is renamed into the pool; if anyone tried to open it
meanwhile (the lease is being broken: ``F_GETLEASE`` no longer says ``F_WRLCK``) the file is
deleted instead. A refused lease (in use, not the file's owner, leases disabled by
``fs.leases-enable``) means the file is deleted as before, never recycled. (A scan of
``/proc/*/maps`` and ``/proc/*/fd`` was the first design: it cannot read every process here,
pid 1 among them, even as root, and it races with an ``open``; the lease is the kernel's own
answer, atomic with the rename.)

Layout: ``<root>/.spares/<n>`` (``n`` a counter), at most ``limit`` bytes of allocated pages
(``st_blocks``), the oldest dropped first. Sizes in bytes.

**Tags** (``<root>/.spares/.tags/<n>``, JSON): what a spare still holds, for the sparse apply
(DESIGN.md, "Sparse apply"): ``{"identity", "path", "size", "chunks", "adlers"}``, the ready
snapshot the file was, its path there, the xxh3-128 digests READY listed for it and, when known,
each tensor's Adler-32 (the snapshot's own diff metadata). A tag is written after its file moved
into the pool and removed before the file leaves it (a crash in between leaves an untagged spare,
never a tag on other bytes); spare files keep their read-only mode (0444). Untrusted on read: a
tag that does not parse is dropped.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import logging
import os
import signal
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from bdn.daemon.apply.hotmaps import HotMaps
from bdn.daemon.store.room import allocated

log = logging.getLogger("bdn.spares")

SPARES = ".spares"
TAGS = ".tags"
CLAIMED = ".claimed-"


def _ignore_sigio() -> None:
    """A broken lease signals its holder with SIGIO, whose default action ends the process."""
    try:
        if signal.getsignal(signal.SIGIO) == signal.SIG_DFL:
            signal.signal(signal.SIGIO, signal.SIG_IGN)
    except ValueError:  # not the main thread: whoever runs the loop there decides
        pass


def unused(path: Path) -> bool:
    """True if no other open file description of ``path`` exists now (the write lease of
    :func:`recycle`, granted and given back at once): nobody maps or holds the file. False when it
    is in use, gone, or leases are unavailable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
    except OSError:
        return False
    else:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        return True
    finally:
        os.close(fd)


def recycle(path: Path, dest: Path) -> bool:
    """Rename ``path`` to ``dest`` if no other open file description of it exists (any
    process, any mapping); True if it moved. A file somebody holds or tries to open stays (False)
    or, if the attempt came during the rename, is deleted from ``dest`` (False)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        try:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
        except OSError:
            return False  # in use (EAGAIN), or leases unavailable here: not recycled
        try:
            os.replace(path, dest)
            if fcntl.fcntl(fd, fcntl.F_GETLEASE) != fcntl.F_WRLCK:
                os.unlink(dest)  # an open() came while we held it: that opener keeps the inode
                return False
            return True
        finally:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
    finally:
        os.close(fd)


class Spares:
    """The spare files of one store (``root/.spares``), at most ``limit`` bytes (-1: at most
    as many bytes as the largest batch collected at once; 0: the pool is off)."""

    def __init__(self, root: Path, limit: int = -1) -> None:
        self.dir = root / SPARES
        self.dir.mkdir(exist_ok=True)
        self.maps = HotMaps()  # tagged spares' mappings, populated ahead of a sparse apply
        self.tags = self.dir / TAGS  # created with the first tag
        for t in self._tag_files():  # a tag whose file is gone (trimmed, taken, crashed) says nothing
            if not (self.dir / t.name).is_file():
                t.unlink(missing_ok=True)
        for p in self.dir.glob(f"{CLAIMED}*"):  # a catch-up a crash interrupted: partial bytes
            p.unlink(missing_ok=True)
        for p in self.tags.glob(".*.tmp"):  # a tag a crash interrupted (_write_tag): never renamed
            p.unlink(missing_ok=True)
        _ignore_sigio()
        self.limit = limit
        self._high = self.bytes()  # the largest batch absorbed (for limit -1); a restart keeps its spares
        self._lock = threading.Lock()
        self._seq = itertools.count()
        self.recycled_bytes = 0  # counters, for the status page and the tests
        self.kept_in_use = 0

    def _files(self) -> list[tuple[float, int, Path]]:
        """``(mtime, allocated bytes, path)`` of every spare, oldest first."""
        out = []
        for p in self.dir.iterdir():
            if p.name.startswith("."):  # the tags directory
                continue
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            out.append((st.st_mtime, st.st_blocks * 512, p))
        return sorted(out)

    def bytes(self) -> int:
        """Allocated bytes the spares hold (they count against shm budgets and free space)."""
        return sum(b for _, b, _ in self._files())

    def cap(self) -> int:
        """Bytes the spares may hold: ``limit``, or for ``limit`` -1 the largest batch absorbed so far."""
        return self._high if self.limit < 0 else self.limit

    def absorb(self, directory: Path, tags: Mapping[str, dict[str, Any]] | None = None) -> int:
        """Keep the regular files under ``directory`` (already renamed away from any identity)
        that no process maps or holds open as spares, up to ``cap()``; returns the bytes kept.
        ``tags``: relative path (``/``-separated) -> the tag of that file (module docstring).
        The caller removes what is left of ``directory``."""
        if self.limit == 0:
            return 0
        files: list[tuple[Path, os.stat_result]] = []
        for parent, _, names in os.walk(directory):
            for name in names:
                p = Path(parent) / name
                try:
                    st = p.lstat()
                except OSError:
                    continue
                if p.is_file() and not p.is_symlink() and st.st_blocks:
                    files.append((p, st))
        if not files:
            return 0
        kept = 0
        with self._lock:
            self._high = max(self._high, sum(st.st_blocks * 512 for _, st in files))
            for p, st in files:
                name = f"{os.getpid()}-{next(self._seq)}"
                # A restarted daemon with the same pid (PID 1 in a container) counts from 0 again:
                # a tag left at this name is some other file's, never this one's.
                (self.tags / name).unlink(missing_ok=True)
                if recycle(p, self.dir / name):
                    kept += st.st_blocks * 512
                    tag = (tags or {}).get(p.relative_to(directory).as_posix())
                    if tag is not None:
                        self._write_tag(name, tag)
                else:
                    self.kept_in_use += 1
            self._trim(self.cap())
        return kept

    def take(self, size: int, dest: Path) -> int:
        """Move the spare best fitting ``size`` (the smallest holding it, else the largest) to
        ``dest``; returns the bytes of existing pages it brings (0: the pool is empty)."""
        with self._lock:
            files = self._files()
            if not files:
                return 0
            fits = [f for f in files if f[1] >= size]
            pick = min(fits, key=lambda f: f[1]) if fits else max(files, key=lambda f: f[1])
            (self.tags / pick[2].name).unlink(missing_ok=True)  # its bytes are about to change
            self.maps.drop(pick[2])
            os.replace(pick[2], dest)
            got = min(pick[1], size)
            self.recycled_bytes += got
            return got

    def trim(self, keep: int) -> None:
        """Delete the oldest spares until at most ``keep`` bytes remain."""
        with self._lock:
            self._trim(keep)

    def _trim(self, keep: int) -> None:  # lock held
        files = self._files()
        total = sum(b for _, b, _ in files)
        for _, b, p in files:
            if total <= max(keep, 0):
                break
            (self.tags / p.name).unlink(missing_ok=True)
            self.maps.drop(p)
            p.unlink(missing_ok=True)
            total -= b

    def _tag_files(self) -> list[Path]:
        try:
            return [t for t in self.tags.iterdir() if not t.name.startswith(".")]
        except FileNotFoundError:
            return []

    def _write_tag(self, name: str, tag: dict[str, Any]) -> None:  # lock held
        tmp = self.tags / f".{name}.tmp"
        try:
            self.tags.mkdir(exist_ok=True)
            tmp.write_text(json.dumps(tag))
            os.replace(tmp, self.tags / name)
        except OSError as e:  # an untagged spare is still a spare
            log.warning("page pool: tag of %s not written: %s", name, e)
            tmp.unlink(missing_ok=True)

    def take_tagged(
        self, path: str, size: int, dest: Path, accept: Callable[[dict[str, Any]], bool]
    ) -> dict[str, Any] | None:
        """Move a spare that held ``path`` at exactly ``size`` bytes, with a block behind every
        byte, and whose tag ``accept``s to ``dest`` (the newest such); returns its tag, or None
        (nothing moved). The tag is removed
        before the file moves: from here on only the caller knows what the file holds."""
        with self._lock:
            best: tuple[float, Path, dict[str, Any]] | None = None
            for t in self._tag_files():
                try:
                    tag = json.loads(t.read_text())
                    st = (self.dir / t.name).stat()
                except (OSError, ValueError):
                    continue
                if (
                    not isinstance(tag, dict)
                    or tag.get("path") != path
                    or tag.get("size") != size
                    or st.st_size != size
                    or not allocated(st)  # a hole (made behind the daemon) is not the tag's bytes
                    or not accept(tag)
                ):
                    continue
                if best is None or st.st_mtime > best[0]:
                    best = (st.st_mtime, t, tag)
            if best is None:
                return None
            _, t, tag = best
            t.unlink(missing_ok=True)
            os.replace(self.dir / t.name, dest)
            self.recycled_bytes += size
            return tag

    def claim_tagged(
        self, path: str, size: int, accept: Callable[[dict[str, Any]], bool]
    ) -> tuple[Path, dict[str, Any]] | None:
        """Take a tagged spare out of the pool to bring it forward where it lies (the sparse
        catch-up, ``bdn.daemon.apply.forward``): as :meth:`take_tagged`, but to a hidden name in the
        pool's directory (``.claimed-<n>``, which no take, trim or restart hands out: a restart
        deletes it), writable; ``(its path, its tag)`` or None. Give it back with :meth:`release`."""
        hidden = self.dir / f"{CLAIMED}{os.getpid()}-{next(self._seq)}"
        tag = self.take_tagged(path, size, hidden, accept)
        if tag is None:
            return None
        self.recycled_bytes -= size  # not handed to a snapshot (yet)
        os.chmod(hidden, 0o644)
        return hidden, tag

    def tagged(self, accept: Callable[[dict[str, Any]], bool]) -> set[tuple[str, int]]:
        """``(path, size)`` of every tagged spare whose tag ``accept``s (what :meth:`take_tagged`
        could hand out now)."""
        out: set[tuple[str, int]] = set()
        with self._lock:
            for t in self._tag_files():
                try:
                    tag = json.loads(t.read_text())
                    st = (self.dir / t.name).stat()
                except (OSError, ValueError):
                    continue
                if isinstance(tag, dict) and tag.get("size") == st.st_size and accept(tag):
                    out.add((str(tag.get("path")), st.st_size))
        return out

    def seed(self, size: int) -> Path | None:
        """A new file of ``size`` bytes, its pages allocated, under a hidden name in the pool's
        directory (``.claimed-<n>``, as :meth:`claim_tagged` gives: a restart deletes it), writable:
        a buffer to fill with a copy of a ready file (``bdn.daemon.apply.seed``) and give to the pool
        with :meth:`release`. None when the pool is off (``limit`` 0), the file would take the pool
        past a fixed ``limit``, or the space cannot be allocated. With ``limit`` -1 the pool's cap
        grows to hold it (what it holds is one batch, as when GC absorbs a snapshot)."""
        if self.limit == 0 or (self.limit > 0 and self.bytes() + size > self.limit):
            return None
        hidden = self.dir / f"{CLAIMED}{os.getpid()}-{next(self._seq)}"
        try:
            fd = os.open(hidden, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except OSError as e:
            log.warning("page pool: no seed buffer of %d bytes: %s", size, e)
            return None
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            hidden.unlink(missing_ok=True)
            log.warning("page pool: no seed buffer of %d bytes: %s", size, e)
            return None
        finally:
            os.close(fd)
        with self._lock:
            if self.limit < 0:
                self._high = max(self._high, self.bytes() + size)
        return hidden

    def discard(self, hidden: Path) -> None:
        """Delete a file :meth:`seed` or :meth:`claim_tagged` gave (its mapping first)."""
        self.maps.drop(hidden)
        hidden.unlink(missing_ok=True)

    def release(self, hidden: Path, tag: dict[str, Any] | None) -> None:
        """Put a file :meth:`claim_tagged` or :meth:`seed` gave into the pool, read-only, with
        ``tag`` (what it holds now) or untagged (None: its bytes are not known)."""
        with self._lock:
            name = f"{os.getpid()}-{next(self._seq)}"
            (self.tags / name).unlink(missing_ok=True)
            try:
                os.chmod(hidden, 0o444)
                os.replace(hidden, self.dir / name)
            except OSError as e:
                log.warning("page pool: %s not given back: %s", hidden.name, e)
                hidden.unlink(missing_ok=True)
                return
            if tag is not None:
                self._write_tag(name, tag)

    def prime_tagged(self) -> int:
        """Map and populate every tagged spare not mapped yet (``HotMaps.prime``; blocking, a disk
        thread); returns how many were mapped."""
        return sum(self.maps.prime(self.dir / t.name) for t in self._tag_files())
