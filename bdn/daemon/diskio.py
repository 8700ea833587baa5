"""The file-level work of the daemon, as plain blocking functions run on its worker threads:
verify-and-write a chunk, copy a chunk already on this node, re-verify a resumed download's
chunks, apply a delta, verify the rebuilt files.

Moved verbatim from the daemon's node module (no daemon object is passed in); these bodies are
to be replaced by calls into ``bdn/fileops.py``, the one module of file-level work shared by the
daemon, the client and the publisher.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from pathlib import Path

from bdn.proto import arc
from bdn.proto.chunks import digest as xxh3_digest
from bdn.proto.errors import BdnError, ProtocolError
from bdn.proto.manifest import ChunkRef, Manifest
from bdn.proto.safetensors_fmt import read_header


def verify_and_write(buf: memoryview, want: str, path: Path, offset: int) -> bool:
    """Hash ``buf``; write it at ``offset`` of ``path`` only if the digest matches."""
    if xxh3_digest(buf) != want:
        return False
    fd = os.open(path, os.O_WRONLY)
    try:
        pos = 0
        while pos < len(buf):
            pos += os.pwrite(fd, buf[pos:], offset + pos)
    finally:
        os.close(fd)
    return True


def copy_range(src: Path, src_off: int, dst: Path, dst_off: int, length: int, want: str) -> bool:
    """Copy a chunk already on this node into another file, re-verifying it on the way."""
    with open(src, "rb") as f:
        data = os.pread(f.fileno(), length, src_off)
    if len(data) != length:
        return False
    return verify_and_write(memoryview(data), want, dst, dst_off)


def verify_held(refs: list[ChunkRef], held: Callable[[int], bool], path_of: Callable[[int], Path]) -> list[int]:
    """Positions ``i`` of ``refs`` with ``held(i)`` whose bytes at ``path_of(file_index)`` match
    their digest (a resumed download takes back only what is verified on disk)."""
    good = []
    for i, ref in enumerate(refs):
        if not held(i):
            continue
        try:
            with open(path_of(ref.file_index), "rb") as f:
                data = os.pread(f.fileno(), ref.length, ref.offset)
        except OSError:
            continue
        if len(data) == ref.length and xxh3_digest(data) == ref.digest:
            good.append(i)
    return good


def apply_delta(m: Manifest, base_dir: Path, stored_dir: Path, staging_dir: Path, workers: int) -> None:
    """target = base XOR diff per tensor into the staging files, Adler-32 checked per tensor.

    Raises:
        BdnError: the base lacks a file; ProtocolError: a diff that does not fit the manifest.
    """
    st = staging_dir
    for fi, f in enumerate(m.files):
        if not f.is_diff:
            continue
        base_path = base_dir / f.path
        diff_path = stored_dir / f.path
        if not base_path.is_file():
            raise BdnError(f"base snapshot {m.base_identity!r} has no file {f.path!r} to apply the delta to")
        base_h = read_header(base_path)
        with open(base_path, "rb") as bf, open(diff_path, "rb") as df, open(st / f.path, "r+b") as of:
            dsize = os.fstat(df.fileno()).st_size
            with mmap.mmap(df.fileno(), 0, access=mmap.ACCESS_READ) as dm:
                diff_h = arc.read_diff_header(dm, dsize)
                want = arc.target_size(base_h, diff_h)
                if want != f.result.size:  # type: ignore[union-attr]
                    raise ProtocolError(
                        f"{f.path}: delta rebuilds {want} bytes but the manifest says {f.result.size}"  # type: ignore[union-attr]
                    )
                if f.result.size == 0:  # type: ignore[union-attr]
                    continue
                with mmap.mmap(bf.fileno(), 0, access=mmap.ACCESS_READ) as bm, mmap.mmap(
                    of.fileno(), 0
                ) as om:
                    arc.apply_diff(
                        bm, base_h, dm, diff_h, om, m.compression_format,
                        workers=workers,
                    )
                    om.flush()


def verify_results(m: Manifest, staging_dir: Path) -> None:
    """Every reconstructed chunk's xxh3-128 against the manifest's ``result`` digests.

    Raises:
        ProtocolError: the first chunk that does not match (file, chunk, both digests).
    """
    st = staging_dir
    for fi, f in enumerate(m.files):
        if not f.is_diff or f.result_size == 0:
            continue
        with open(st / f.path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            for ci, want in enumerate(f.result_chunks):
                off = ci * m.chunk_size
                got = xxh3_digest(memoryview(mm)[off : off + m.chunk_size])
                if got != want:
                    raise ProtocolError(
                        f"{f.path}: reconstructed chunk {ci} has digest {got}, manifest says {want}"
                    )


def open_first(paths: list[Path]) -> int | None:
    """A read-only fd of the first of ``paths`` that exists, or None."""
    for p in paths:
        try:
            return os.open(p, os.O_RDONLY)
        except FileNotFoundError:
            continue
    return None


def file_size(fd: int) -> int:
    return os.fstat(fd).st_size


def pread(fd: int, length: int, offset: int) -> bytes:
    return os.pread(fd, length, offset)


def close(fd: int) -> None:
    os.close(fd)
