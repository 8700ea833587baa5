"""The daemon's file-level work, as blocking functions run on its worker threads: thin loops over
a manifest that call :mod:`bdn.fileops` (the one module of file-level work shared by the daemon,
the client and the publisher) for each file or chunk.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection
from pathlib import Path

from bdn import fileops
from bdn.daemon.store import room
from bdn.proto.errors import BdnError, ProtocolError
from bdn.proto.manifest import ChunkRef, Manifest

copy_range = fileops.copy_verified  # (src, src_off, dst, dst_off, length, digest) -> bool


def write_at(buf: memoryview, path: Path, offset: int) -> bool:
    """``pwrite`` ``buf`` at byte ``offset`` of the existing file ``path``, unhashed (a chunk of a
    snapshot without a manifest, whose object is verified once whole); True."""
    view = buf.cast("B")
    fd = os.open(path, os.O_WRONLY)
    try:
        pos = 0
        while pos < len(view):
            pos += os.pwrite(fd, view[pos:], offset + pos)
    finally:
        os.close(fd)
    return True


def verify_held(refs: list[ChunkRef], held: Callable[[int], bool], path_of: Callable[[int], Path]) -> list[int]:
    """Positions ``i`` of ``refs`` with ``held(i)`` whose bytes at ``path_of(file_index)`` match
    their digest (a resumed download takes back only what is verified on disk)."""
    by_file: dict[int, list[int]] = {}
    for i, ref in enumerate(refs):
        if held(i):
            by_file.setdefault(ref.file_index, []).append(i)
    good: list[int] = []
    for fi, positions in by_file.items():
        first = refs[positions[0]]
        chunk_size = first.length if first.index == 0 else first.offset // first.index
        digests: dict[int, str] = {refs[i].index: refs[i].digest for i in positions}
        table = [digests.get(ci, "") for ci in range(max(digests) + 1)]
        ok = set(fileops.verify_chunks(path_of(fi), chunk_size, table, which=sorted(digests)))
        good.extend(i for i in positions if refs[i].index in ok)
    return sorted(good)


def corrupt_chunks(refs: list[ChunkRef], path_of: Callable[[int], Path]) -> list[int]:
    """Positions of ``refs`` whose bytes at ``path_of(file_index)`` do not match their digest
    (a missing or short file counts as corrupted in every chunk it lacks)."""
    good = set(verify_held(refs, lambda i: True, path_of))
    return [i for i in range(len(refs)) if i not in good]


def apply_delta(
    m: Manifest, base_dir: Path, stored_dir: Path, staging_dir: Path, workers: int, skip: Collection[str] = ()
) -> None:
    """target = base XOR diff per tensor into the staging files, Adler-32 checked per tensor
    (every diff file but the paths in ``skip``: those a sparse apply brought forward).

    Raises:
        BdnError: the base lacks a file; ProtocolError: a diff that does not fit the manifest.
    """
    for f in m.files:
        if not f.is_diff or f.path in skip:
            continue
        base_path = base_dir / f.path
        assert m.compression_format is not None and f.result is not None  # a delta names its codec, a diff its result
        if not base_path.is_file():
            raise BdnError(f"base snapshot {m.base_identity!r} has no file {f.path!r} to apply the delta to")
        fileops.apply_delta_file(
            base_path,
            stored_dir / f.path,
            staging_dir / f.path,
            m.compression_format,
            f.result.size,
            workers=workers,
            name=f.path,
        )


def verify_results(m: Manifest, staging_dir: Path, skip: Collection[str] = ()) -> None:
    """Every reconstructed chunk's xxh3-128 against the manifest's ``result`` digests (but the
    files in ``skip``: a sparse apply's, whose touched chunks are hashed after READY).

    Raises:
        ProtocolError: the first chunk that does not match (file, chunk, both digests).
    """
    for f in m.files:
        if not f.is_diff or f.result_size == 0 or f.path in skip:
            continue
        bad = fileops.first_mismatch(staging_dir / f.path, m.chunk_size, f.result_chunks)
        if bad is not None:
            ci, got = bad
            raise ProtocolError(
                f"{f.path}: reconstructed chunk {ci} has digest {got or '(missing)'}, "
                f"manifest says {f.result_chunks[ci]}"
            )


def _changed_behind(p: Path, size: int) -> str:
    """ "" if the staging file ``p`` is ``size`` bytes with no hole, else what is wrong.

    Every byte of a staging file was written and verified before READY; a file truncated (or
    punched) behind the daemon while it downloaded loses bytes already verified, and the later
    ``pwrite``s grow it back to its size with zeros in between (the chunk index still says
    verified). Those zeros are holes, pages the truncation freed and no write allocated again,
    so a file whose blocks cover its size has none (``room.allocated``, one ``fstat``); only a
    file with fewer blocks is searched with ``SEEK_HOLE`` (walks its pages), which names the
    byte, or finds none on a file system that stores fewer blocks than bytes (compression: no
    false alarm). The daemon allocates a staging file's pages only when it reserves them,
    before the download, so a hole made behind it is never filled by an allocation of its own."""
    try:
        fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as e:
        return f"cannot be opened ({e.strerror})"
    try:
        st = os.fstat(fd)
        got = st.st_size
        if got != size:
            return f"is {got} bytes, not {size} (changed behind the daemon)"
        if room.allocated(st):
            return ""
        hole = os.lseek(fd, 0, os.SEEK_HOLE) if size else 0
        if hole < size:
            return f"has a hole at byte {hole} of {size} (truncated behind the daemon while it downloaded)"
        return ""
    finally:
        os.close(fd)


def check_staging(m: Manifest, staging_dir: Path) -> None:
    """Every file of ``m`` in ``staging_dir`` is its rebuilt size with no hole, just before READY.

    Raises:
        BdnError: the first file that is not, naming it and what is wrong.
    """
    for f in m.files:
        bad = _changed_behind(staging_dir / f.path, f.result_size)
        if bad:
            raise BdnError(f"snapshot {m.identity!r}: {f.path} {bad}: not published (prefetch it again)")


def open_first(paths: list[Path]) -> int | None:
    """A read-only fd of the first of ``paths`` that exists, or None."""
    for p in paths:
        try:
            return os.open(p, os.O_RDONLY)
        except FileNotFoundError:
            continue
    return None


def file_size(fd: int) -> int:
    """Size in bytes of the open file ``fd``."""
    return os.fstat(fd).st_size


def pread(fd: int, length: int, offset: int) -> bytes:
    """Up to ``length`` bytes of ``fd`` at ``offset`` (fewer at the end of the file)."""
    return os.pread(fd, length, offset)


def close(fd: int) -> None:
    """Close ``fd``."""
    os.close(fd)
