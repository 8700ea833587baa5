"""The node's snapshot store in shared memory: layout, READY markers, and the chunk index.

Layout under ``root = <shm_dir>/<swarm_id>`` (and ``<shm_dir>/bdnd.lock``, see ``ShmLock``)::

    <identity>/            a complete, verified Hugging Face directory plus its READY marker
    .staging/<identity>/   reconstructed files while the snapshot is being built (never handed out)
    .staging/.ready-<identity>.tmp   READY being written (renamed into the staging directory)
    .progress/<identity>   which chunks of a download are verified (resume after a restart)
    .stored/<identity>/    a delta's diff objects as stored in the bucket (kept to serve peers)
    .manifests/<identity>  the manifest a ready snapshot was rebuilt from (``bdn.daemon.snapshots.records``)
    .staging/.reserve-<identity>  the bytes of READY, the record and progress, held from the start
                           (``bdn.daemon.store.room``)
    .spares/<n>            files of collected snapshots no process maps or holds open, kept to
                           become the next snapshot's files (``bdn.daemon.store.spares``: the page pool)

Identities start with a letter or digit, so no identity is one of the dot-names. The only name
bdn writes inside a snapshot directory is ``READY`` (``bdn.proto.reserved.RESERVED_NAMES``), which
no manifest may list: every other file under ``<identity>/`` is the trainer's.

A snapshot is published on the node by writing READY into its staging directory and then renaming
the directory to ``<identity>/`` (one atomic rename): a directory under its identity is always
complete. READY is JSON (format ``bdn.ready/1``)::

    {"format": "bdn.ready/1", "identity": ..., "kind": ..., "policy_version": ...,
     "base_identity": ..., "chunk_size": ..., "files": [{"path", "size", "chunks"}]}

with the xxh3-128 digests of each reconstructed file's chunks.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack

from bdn.daemon.apply import buffers
from bdn.daemon.observe.packing import packb
from bdn.daemon.process.shmlock import ShmFull, existing, room_line
from bdn.daemon.store import diskio
from bdn.daemon.store.room import Reserve, grow, room
from bdn.daemon.store.spares import Spares
from bdn.proto.errors import ProtocolError
from bdn.proto.manifest import Manifest
from bdn.proto.ready import READY_NAME, ReadyMarker, parse_ready, ready_json

STAGING = ".staging"
STORED = ".stored"
PROGRESS = ".progress"
MANIFESTS = ".manifests"

log = logging.getLogger("bdn.store")


class Store:
    """Directories of one swarm's snapshots under ``<shm_dir>/<swarm_id>``."""

    def __init__(self, shm_dir: str | os.PathLike[str], swarm_id: str, spare_limit: int = -1) -> None:
        """Open (create) the store; ``spare_limit``: the page pool's bytes at most
        (``shm_spare_bytes``, ``bdn.daemon.store.spares``). Raises ShmFull: a directory cannot be made
        for want of room."""
        self.root = Path(shm_dir) / swarm_id
        self._reserve_lock = threading.Lock()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            for name in (STAGING, STORED, PROGRESS, MANIFESTS):
                (self.root / name).mkdir(exist_ok=True)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise ShmFull(
                f"shm_dir {str(shm_dir)!r} is full, bdnd cannot create its store {self.root}: "
                f"{room_line(existing(Path(shm_dir)))} (free some, or give it a larger tmpfs)"
            ) from None
        self.spares = Spares(self.root, spare_limit)

    def ready_dir(self, identity: str) -> Path:
        """``<root>/<identity>``: the published snapshot directory (complete once it exists)."""
        return self.root / identity

    def staging_dir(self, identity: str) -> Path:
        """``<root>/.staging/<identity>``: the files being rebuilt (never handed out)."""
        return self.root / STAGING / identity

    def stored_dir(self, identity: str) -> Path:
        """``<root>/.stored/<identity>``: a delta's diff files as stored in the bucket (served to peers)."""
        return self.root / STORED / identity

    def is_ready(self, identity: str) -> bool:
        """Whether ``<identity>/READY`` exists (not whether it parses: :meth:`read_ready`)."""
        return (self.ready_dir(identity) / READY_NAME).is_file()

    def read_ready(self, identity: str) -> ReadyMarker:
        """The snapshot's READY marker (``bdn.ready/1``, :func:`bdn.proto.ready.parse_ready`).

        Raises OSError when it cannot be read, ProtocolError when it is not a valid marker."""
        return parse_ready((self.ready_dir(identity) / READY_NAME).read_bytes())

    def list_ready(self) -> list[ReadyMarker]:
        """Every snapshot with a valid READY marker (a broken one is skipped, not fatal)."""
        out = []
        for d in sorted(self.root.iterdir()):
            if d.name.startswith(".") or not (d / READY_NAME).is_file():
                continue
            try:
                info = parse_ready((d / READY_NAME).read_bytes())
            except (OSError, ProtocolError):
                continue
            if info.identity == d.name:
                out.append(info)
        return out

    @staticmethod
    def space_needed(m: Manifest) -> int:
        """Bytes of shm a snapshot takes: its rebuilt files plus a delta's stored diff files."""
        return m.result_bytes + sum(f.size for f in m.files if f.is_diff)

    def free_bytes(self) -> int:
        """Bytes an unprivileged process may still allocate on the store's file system (statvfs)."""
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    def free_inodes(self) -> int:
        """Inodes an unprivileged process may still create on the store's file system (statvfs)."""
        return os.statvfs(self.root).f_favail

    def page_size(self) -> int:
        """The file system's allocation unit in bytes (statvfs ``f_bsize``; tmpfs: the page)."""
        return os.statvfs(self.root).f_bsize or 4096

    def full_reason(self, identity: str, e: OSError) -> str:
        """The one line for an ENOSPC/EDQUOT while writing snapshot ``identity``: "no inodes"
        when none are left (tmpfs says ENOSPC for both), else "no space", with the numbers."""
        what = "no inodes" if self.free_inodes() == 0 else "no space"
        return f"{what} in shm while writing snapshot {identity!r}: {room_line(self.root)} ({e.strerror})"

    def reserve(self, identity: str) -> Reserve:
        """The reservation of snapshot ``identity``'s small files (``bdn.daemon.store.room``)."""
        return Reserve(self.root / STAGING / f".reserve-{identity}", self.page_size())

    def record_path(self, identity: str) -> Path:
        """``<root>/.manifests/<identity>``: the record a restart rebuilds the job from."""
        return self.root / MANIFESTS / identity

    def read_record(self, identity: str, limit: int) -> bytes | None:
        """The record's bytes, or None (none, unreadable, or over ``limit`` bytes)."""
        p = self.record_path(identity)
        try:
            if p.is_symlink() or p.stat().st_size > limit:
                return None
            return p.read_bytes()
        except OSError:
            return None

    def check_sizes(self, info: ReadyMarker) -> str:
        """ "" if every file READY lists exists with its size, else what is wrong (one line)."""
        d = self.ready_dir(info.identity)
        for f in info.files:
            try:
                got = (d / f.path).stat().st_size
            except OSError:
                return f"{f.path} is missing"
            if got != f.size:
                return f"{f.path} is {got} bytes, READY says {f.size}"
        return ""

    def prepare_staging(
        self,
        m: Manifest,
        accept: Callable[[dict[str, Any]], bool] | None = None,
        spare_room: int | None = None,
    ) -> dict[str, dict[str, Any]]:
        """Reserve a snapshot's staging files, one snapshot at a time (see ``_prepare_staging``);
        ``accept``, ``{path: tag}`` returned: ``bdn.daemon.apply.buffers.take``; ``spare_room``: the
        bytes the spares may keep once ``m`` is reserved (``Catalog.spare_room``; None: the
        pool's own cap)."""
        with self._reserve_lock:
            return self._prepare_staging(m, accept, self.spares.cap() if spare_room is None else spare_room)

    def _prepare_staging(
        self, m: Manifest, accept: Callable[[dict[str, Any]], bool] | None, spare_room: int
    ) -> dict[str, dict[str, Any]]:
        """Create the staging files at their final sizes, with their space reserved up front.

        The space is allocated (``posix_fallocate``) rather than left sparse: a full tmpfs must
        fail here, with the numbers, not later as ENOSPC mid-download or SIGBUS inside an mmap.

        Raises:
            ProtocolError: the file system cannot hold the snapshot (message gives the numbers).
        """
        # (under _reserve_lock: two reserving at once would both pass the free-space check, then both fail)
        self.discard(m.identity)
        r = room(m, self.page_size())
        need = r.bytes
        free = self.free_bytes() + self.spares.bytes()  # spares are dropped before fresh pages fail
        if need > free:
            raise ProtocolError(
                f"no space in shm: snapshot {m.identity!r} needs {need} bytes ({r.files} of files, {r.small} of "
                f"READY, record and progress), {free} are free on {self.root}"
            )
        inodes = self.free_inodes()
        if r.inodes > inodes:
            raise ProtocolError(
                f"no inodes in shm: snapshot {m.identity!r} needs {r.inodes} inodes (files and directories), "
                f"{inodes} are free on {self.root}"
            )
        st = self.staging_dir(m.identity)
        stored = self.stored_dir(m.identity)
        files = [(st / f.path, f.result_size) for f in m.files]
        files += [(stored / f.path, f.size) for f in m.files if f.is_diff]
        held: dict[str, dict[str, Any]] = {}
        try:
            if accept is not None:  # spares holding an earlier snapshot of a diff file, kept as they are
                held = buffers.take(self.spares, m, st, accept)
            taken = {st / p for p in held}
            # Spares first (their pages exist: receiving into them is a copy, not an
            # allocation), the largest files first; then the spares left over are trimmed to
            # the room the budget leaves and to what the fresh allocations need.
            reused = 0
            for p, size in sorted(files, key=lambda e: -e[1]):
                p.parent.mkdir(parents=True, exist_ok=True)
                if p in taken:
                    reused += size
                    continue
                reused += self.spares.take(size, p) if size else 0
            fresh = sum(size for _, size in files) - reused
            self.spares.trim(spare_room)
            short = fresh + r.small - self.free_bytes()  # (the reservation is fresh pages too)
            if short > 0:
                self.spares.trim(self.spares.bytes() - short)
            for p, size in files:
                self._allocate(p, size)
            self.reserve(m.identity).hold(r.small)
            # (a disk-pool thread: the task's SNAPSHOT context does not follow, so it is given here)
            log.info(
                "snapshot %s: reserved %d bytes, %d in recycled pages, %d file(s) kept as buffers",
                m.identity,
                need,
                reused,
                len(held),
                extra={"snapshot": m.identity},
            )
            return held
        except OSError as e:
            self.discard(m.identity)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise ProtocolError(
                    f"{self.full_reason(m.identity, e)}; it needs {need} bytes, {r.inodes} inodes"
                ) from None
            raise

    @staticmethod
    def _allocate(p: Path, size: int) -> None:
        """``p`` at ``size`` bytes with its space allocated: a new file, or a spare moved there
        (made writable and truncated to ``size``, never emptied first: its pages stay)."""
        p.parent.mkdir(parents=True, exist_ok=True)
        if p.exists() and not p.is_symlink():
            os.chmod(p, WRITABLE)  # a spare comes from a ready (read-only) snapshot
        grow(p, size, WRITABLE)

    # ---- persisted progress (resume after a restart) ---------------------------------------
    def progress_path(self, identity: str) -> Path:
        """``<root>/.progress/<identity>``: the msgpack record of :meth:`save_progress`."""
        # Not beside the staging directories: ".staging/x.progress" would be the staging
        # directory of the identity "x.progress".
        return self.root / PROGRESS / identity

    def save_progress(
        self, identity: str, manifest_digest: str, stored: bytes, result: bytes, extra: dict[str, Any] | None = None
    ) -> None:
        """Atomically record which chunks of a snapshot in progress are written and verified;
        ``extra``: what a snapshot without a manifest needs to resume (``load_progress_extra``)."""
        p = self.progress_path(identity)
        tmp = p.with_name(f".{identity}.tmp")  # a dot-name: no identity's progress file
        doc: dict[str, Any] = {"m": manifest_digest, "s": stored, "r": result}
        if extra is not None:
            doc["x"] = extra
        data = packb(doc)
        try:
            old = p.stat().st_size
        except FileNotFoundError:
            old = 0
        # the bytes come out of the snapshot's reservation (bdn.daemon.store.room): a full tmpfs cannot
        # refuse them
        with self.reserve(identity).lend(len(data), old):
            try:
                tmp.write_bytes(data)
                os.replace(tmp, p)
            except OSError:
                tmp.unlink(missing_ok=True)
                raise

    def load_progress_extra(self, identity: str) -> dict[str, Any] | None:
        """The ``extra`` of the saved progress of ``identity`` whatever its manifest digest, or
        None (untrusted: the caller validates every field)."""
        try:
            obj = msgpack.unpackb(self.progress_path(identity).read_bytes(), raw=False)
        except (OSError, ValueError, msgpack.UnpackException):
            return None
        x = obj.get("x") if isinstance(obj, dict) else None
        return x if isinstance(x, dict) else None

    def load_progress(self, identity: str, manifest_digest: str) -> tuple[bytes, bytes] | None:
        """The saved bitfields if they belong to this exact manifest and the files are there."""
        try:
            obj = msgpack.unpackb(self.progress_path(identity).read_bytes(), raw=False)
        except (OSError, ValueError, msgpack.UnpackException):
            return None
        if not isinstance(obj, dict) or obj.get("m") != manifest_digest:
            return None
        s, r = obj.get("s"), obj.get("r")
        if not isinstance(s, bytes) or not isinstance(r, bytes) or not self.staging_dir(identity).is_dir():
            return None
        return s, r

    def resumable(self) -> list[str]:
        """Identities with a staging directory and saved progress (a download a restart cut)."""
        out = []
        for p in (self.root / PROGRESS).iterdir():
            if not p.name.startswith(".") and self.staging_dir(p.name).is_dir():
                out.append(p.name)
        return sorted(out)

    def clean_staging(self, keep: set[str]) -> None:
        """Remove staging leftovers except the resumable downloads named in ``keep``."""
        for d in (self.root / STAGING).iterdir():
            if d.name in keep or d.name.removeprefix(".reserve-") in keep:
                continue
            if d.is_dir():
                shutil.rmtree(d, ignore_errors=True)
            else:
                d.unlink(missing_ok=True)
        for p in (self.root / PROGRESS).iterdir():
            if p.name not in keep:
                p.unlink(missing_ok=True)
        for d in (self.root / STORED).iterdir():
            if d.name not in keep and not self.is_ready(d.name):
                shutil.rmtree(d, ignore_errors=True)
        for p in (self.root / MANIFESTS).iterdir():
            if not self.is_ready(p.name):
                p.unlink(missing_ok=True)

    def publish(self, m: Manifest, ready: bytes | None = None, record: bytes | None = None) -> Path:
        """Write READY (``ready``, or the marker of ``m``) into the staging directory and
        ``record`` (``bdn.daemon.snapshots.records``) beside it, in the room the reservation held, then
        rename the directory into place (atomic).

        Raises:
            BdnError: a staging file is not its size or has a hole (``diskio.check_staging``).
        """
        st = self.staging_dir(m.identity)
        diskio.check_staging(m, st)
        # The temporary file lives outside the snapshot directory: a name inside it could be
        # one of the trainer's files.
        tmp = self.root / STAGING / f".ready-{m.identity}.tmp"
        self.reserve(m.identity).release()
        if record is not None:
            rtmp = self.root / MANIFESTS / f".{m.identity}.tmp"
            rtmp.write_bytes(record)
            os.replace(rtmp, self.record_path(m.identity))
        with open(tmp, "wb") as fh:
            fh.write(ready_json(m) if ready is None else ready)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, st / READY_NAME)
        self.progress_path(m.identity).unlink(missing_ok=True)
        _set_modes(st, READ_ONLY)  # an engine cannot write into a ready snapshot by mistake
        final = self.ready_dir(m.identity)
        if final.exists():
            self._retire(final)
        os.replace(st, final)
        return final

    def unpublish(self, identity: str) -> bytes:
        """Take a ready snapshot back to staging (to repair it): its directory leaves
        ``<identity>/`` in one rename, so nothing hands it out any more, and READY is removed
        from it. Returns READY's bytes, for ``publish(m, ready=...)`` once it is whole again."""
        final, st = self.ready_dir(identity), self.staging_dir(identity)
        if st.exists():
            self._retire(st)
        marker = (final / READY_NAME).read_bytes()
        os.replace(final, st)
        (st / READY_NAME).unlink()
        _set_modes(st, WRITABLE)  # the repair writes the re-fetched chunks into them
        for f in parse_ready(marker).files:  # files changed behind the daemon's back: regular again
            p = st / f.path
            if not p.is_file() or p.is_symlink() or p.stat().st_size != f.size:
                if p.is_symlink() or (p.exists() and not p.is_file()):
                    p.unlink()  # never written through (a symlink to /etc/passwd)
                self._allocate(p, f.size)
        return marker

    def _retire(self, d: Path, recycle: bool = False, tags: dict[str, dict[str, Any]] | None = None) -> None:
        """Delete a snapshot directory without a window where it is visible but incomplete:
        rename it to a hidden name first (atomic), then remove that (after the page pool took
        the files nobody uses, when ``recycle``)."""
        gone = self.root / STAGING / f".removing-{d.name}-{os.getpid()}-{id(d)}"
        try:
            os.replace(d, gone)
        except FileNotFoundError:
            return
        if recycle:
            try:
                self.spares.absorb(gone, tags)
            except OSError as e:  # the pool is an optimisation: the removal goes on without it
                log.warning("page pool: %s not recycled: %s", d.name, e)
        shutil.rmtree(gone, ignore_errors=True)

    def discard(self, identity: str) -> None:
        """Remove a snapshot's staging and stored data (never its ready directory)."""
        shutil.rmtree(self.staging_dir(identity), ignore_errors=True)
        shutil.rmtree(self.stored_dir(identity), ignore_errors=True)
        self.progress_path(identity).unlink(missing_ok=True)
        self.reserve(identity).release()

    def remove(self, identity: str) -> None:
        """Remove everything of a snapshot (GC); its files that no process maps or holds open
        become spares (``bdn.daemon.store.spares``), its safetensors files tagged with what they hold."""
        try:
            tags = buffers.tags_of(self.read_ready(identity), self.stored_dir(identity))
        except (OSError, ProtocolError):
            tags = {}
        self.discard(identity)
        self.record_path(identity).unlink(missing_ok=True)
        self._retire(self.ready_dir(identity), recycle=True, tags=tags)


READ_ONLY = 0o444
WRITABLE = 0o644


def _set_modes(directory: Path, mode: int) -> None:
    """chmod every file under ``directory`` (not the directories: GC and repair rename and
    delete in them)."""
    for parent, _, names in os.walk(directory):
        for name in names:
            p = os.path.join(parent, name)
            if not os.path.islink(p):  # chmod follows symlinks: one planted here is left alone
                os.chmod(p, mode)
