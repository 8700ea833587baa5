"""File-level work on checkpoint files: hash and verify chunks, apply a diff file, write safetensors.

The one place where the daemon, the client and the publisher open, map and write the files whose
formats ``bdn/proto`` defines (``bdn/proto`` itself does no I/O). Words as in DESIGN.md: a
*chunk* ``i`` of a file covers bytes ``[i*chunk_size, min((i+1)*chunk_size, size))`` and is named
by its *digest*, the 32-hex-char xxh3-128 of those bytes (``bdn.proto.chunks``); a *diff file*
turns a *base* safetensors file into the *target* (``bdn.proto.arc``).

Files are read through memory maps (no copies; the kernel's page cache is the buffer) and written
with ``pwrite``/``copy_file_range``. Nothing here hands out bytes it has not compared with the
digest it was given. The thread pool for delta apply and diff encoding lives here too
(:func:`thread_map`): zstandard, zlib, numpy and xxhash release the GIL, so tasks run on all cores.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from bdn.proto import arc, sparse
from bdn.proto.chunks import buffer_digests, digest
from bdn.proto.errors import ProtocolError
from bdn.proto.safetensors_fmt import Header, SafetensorsError, encode_raw, header_length, parse_header, raw_tensors

__all__ = [
    "apply_delta_file",
    "apply_sparse_file",
    "chunk_digests",
    "copy_verified",
    "first_mismatch",
    "read_header",
    "save",
    "save_raw",
    "thread_map",
    "verify_chunks",
    "write_diff_file",
    "write_diff_file_from_arrays",
    "write_verified",
]

Path = str | os.PathLike[str]
_T = TypeVar("_T")
_R = TypeVar("_R")


# ---- the thread pool ----------------------------------------------------------------------


def thread_map(workers: int) -> arc.Map[Any, Any]:
    """A :data:`bdn.proto.arc.Map` running its tasks on ``workers`` threads (serially for <= 1).

    Each call starts a pool and joins it before returning: results in item order; the first
    exception a task raises is re-raised after every task has finished or been cancelled.
    """
    if workers <= 1:
        return arc.serial_map

    def run(fn: Callable[[_T], _R], items: Sequence[_T]) -> list[_R]:
        if len(items) <= 1:
            return [fn(item) for item in items]
        with ThreadPoolExecutor(max_workers=min(workers, len(items)), thread_name_prefix="bdn-fileops") as pool:
            futures = [pool.submit(fn, item) for item in items]
            try:
                return [f.result() for f in futures]
            except BaseException:
                for f in futures:
                    f.cancel()
                raise

    return run


# ---- mapping files --------------------------------------------------------------------------


def _map(path: Path, *, write: bool = False, size: int | None = None) -> np.ndarray:
    """The whole file at ``path`` as a flat uint8 array over a memory map (empty for an empty file).

    ``write``: open read-write, creating the file and setting its length to ``size`` first. The map
    is released with the array's last view (numpy's memmap), so an exception holding a view in its
    traceback cannot make a close fail.
    """
    if write:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if size is not None and os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)
            n = os.fstat(fd).st_size
        finally:
            os.close(fd)
    else:
        n = os.stat(path).st_size
    if n == 0:
        return np.zeros(0, dtype=np.uint8)
    return np.memmap(path, dtype=np.uint8, mode="r+" if write else "r", shape=(n,))


# ---- chunk digests ---------------------------------------------------------------------------


def chunk_digests(path: Path, chunk_size: int) -> list[str]:
    """The xxh3-128 hex digest of every ``chunk_size``-byte chunk of the file at ``path``.

    ``[]`` for an empty file. Reads through mmap, without copies. Raises OSError when the file
    cannot be read.
    """
    return buffer_digests(_map(path), chunk_size)


def verify_chunks(
    path: Path,
    chunk_size: int,
    digests: Sequence[str],
    which: Iterable[int] | None = None,
    *,
    size: int | None = None,
) -> list[int]:
    """The indices ``i`` (ascending) whose bytes in the file at ``path`` have digest ``digests[i]``.

    ``which`` limits the check to those indices (default: all of ``digests``); an index outside
    ``digests`` raises IndexError. ``size`` is the file's intended length in bytes (default: its
    length on disk), which fixes each chunk's range; a chunk that does not fit in the file as it
    is on disk (missing or short file) is not in the result. Never raises for a missing or
    unreadable file: it gives ``[]``.
    """
    indices = sorted(set(range(len(digests)) if which is None else which))
    for i in indices:
        if not 0 <= i < len(digests):
            raise IndexError(f"chunk {i} outside the {len(digests)} digests given")
    try:
        view = _map(path)
    except OSError:
        return []
    total = len(view) if size is None else size
    good = []
    for i in indices:
        off = i * chunk_size
        end = min(off + chunk_size, total)
        if off >= end or end > len(view):
            continue
        if digest(view[off:end]) == digests[i]:  # type: ignore[arg-type]  # numpy's stubs give ndarray __buffer__ only from Python 3.12
            good.append(i)
    return good


def first_mismatch(path: Path, chunk_size: int, digests: Sequence[str]) -> tuple[int, str] | None:
    """The first chunk of the file at ``path`` that differs from ``digests``: ``(index, its digest)``.

    ``None`` when the file has exactly ``len(digests)`` chunks and each matches. A file with fewer
    chunks gives the first missing index with digest ``""``; one with more gives
    ``(len(digests), digest of the extra chunk)``. Compare sizes first to report a size error.
    Raises OSError when the file cannot be read.
    """
    view = _map(path)
    n = (len(view) + chunk_size - 1) // chunk_size
    for i in range(max(n, len(digests))):
        got = digest(view[i * chunk_size : (i + 1) * chunk_size]) if i < n else ""  # type: ignore[arg-type]  # numpy's stubs give ndarray __buffer__ only from Python 3.12
        if i >= len(digests) or got != digests[i]:
            return i, got
    return None


# ---- writing verified chunks ----------------------------------------------------------------


def _pwrite_all(fd: int, buf: memoryview, offset: int) -> None:
    pos = 0
    while pos < len(buf):
        pos += os.pwrite(fd, buf[pos:], offset + pos)


def write_verified(buf: Any, digest_hex: str, path: Path, offset: int) -> bool:
    """Hash ``buf``; ``pwrite`` it at byte ``offset`` of the existing file ``path`` only if it matches.

    Returns False (and writes nothing) when xxh3-128 of ``buf`` is not ``digest_hex``. Raises
    OSError when the file cannot be written.
    """
    view = memoryview(buf).cast("B")
    if digest(view) != digest_hex:
        return False
    fd = os.open(path, os.O_WRONLY)
    try:
        _pwrite_all(fd, view, offset)
    finally:
        os.close(fd)
    return True


def _copy_range(src_fd: int, src_off: int, dst_fd: int, dst_off: int, length: int) -> bool:
    """Kernel-side copy; False when ``copy_file_range`` is unavailable or the source is short."""
    copy = getattr(os, "copy_file_range", None)
    if copy is None:
        return False
    done = 0
    while done < length:
        try:
            n = copy(src_fd, dst_fd, length - done, src_off + done, dst_off + done)
        except OSError:  # EXDEV, ENOSYS, EINVAL, EOPNOTSUPP: not on this pair of file systems
            return False
        if n == 0:
            return False
        done += n
    return True


def copy_verified(src: Path, src_off: int, dst: Path, dst_off: int, length: int, digest_hex: str) -> bool:
    """Copy ``length`` bytes of a chunk already on this node from ``src`` into the existing ``dst``.

    The chunk's bytes must have digest ``digest_hex``. Uses ``os.copy_file_range`` where the file
    systems support it and then hashes the bytes now in ``dst``; otherwise reads the range with
    ``pread`` and writes it with :func:`write_verified`. Returns False when ``src`` is shorter than
    the range or the bytes do not match (``dst``'s range may then hold those bytes: the caller
    must not count the chunk as held). Raises OSError for an unreadable or unwritable file.
    """
    sfd = os.open(src, os.O_RDONLY)
    try:
        dfd = os.open(dst, os.O_RDWR)
        try:
            if _copy_range(sfd, src_off, dfd, dst_off, length):
                return digest(os.pread(dfd, length, dst_off)) == digest_hex
            data = os.pread(sfd, length, src_off)
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)
    return len(data) == length and write_verified(data, digest_hex, dst, dst_off)


# ---- safetensors files ----------------------------------------------------------------------


def read_header(path: Path) -> Header:
    """Read and validate the header of the safetensors file at ``path`` (reads 8 + N bytes only).

    Raises SafetensorsError for a malformed file, OSError when it cannot be read.
    """
    with open(path, "rb") as f:
        file_size = os.fstat(f.fileno()).st_size
        first8 = f.read(8)
        n = header_length(first8)
        if 8 + n > file_size:
            raise SafetensorsError(f"safetensors header length {n} runs past the end of the {file_size}-byte file")
        rest = f.read(n)
    return parse_header(first8 + rest, file_size)


def save_raw(
    path: Path, tensors: Mapping[str, tuple[str, tuple[int, ...], Any]], metadata: Mapping[str, str] | None = None
) -> None:
    """Write a safetensors file from raw little-endian bytes ``{name: (dtype, shape, buffer)}``.

    Layout: ``bdn.proto.safetensors_fmt.encode_raw``. Raises SafetensorsError for an invalid name,
    an unknown dtype or a size mismatch, OSError when the file cannot be written.
    """
    prefix, parts = encode_raw(tensors, metadata)
    with open(path, "wb") as f:
        f.write(prefix)
        for part in parts:
            f.write(part)


def save(path: Path, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> None:
    """Write numpy arrays (ml_dtypes bfloat16/float8 included) as a safetensors file at ``path``.

    Deterministic and byte-identical to the reference writer (``safetensors_fmt.raw_tensors``
    says when and why). Raises SafetensorsError for dtypes safetensors cannot store.
    """
    save_raw(path, raw_tensors(tensors), metadata)


# ---- diff files -----------------------------------------------------------------------------


def _map_safetensors(path: Path) -> np.ndarray:
    """Read-only uint8 memory map of a whole safetensors file (released with its last view)."""
    arr = _map(path)
    if len(arr) < 8:
        raise SafetensorsError(f"{os.fspath(path)!s} is {len(arr)} bytes, too short for a safetensors file")
    return arr


def write_diff_file(
    base_path: Path,
    target_path: Path,
    out_path: Path,
    compression_format: str = arc.DEFAULT_COMPRESSION,
    *,
    workers: int = 1,
) -> None:
    """Write the diff file that turns the safetensors file ``base_path`` into ``target_path``.

    Rules and errors: ``bdn.proto.arc.encode_diff`` (TensorMismatch naming the first tensor or
    field that differs, SafetensorsError, UnsupportedFormat); tensors are encoded on ``workers``
    threads.
    """
    content = arc.encode_diff(
        _map_safetensors(base_path), _map_safetensors(target_path), compression_format, map=thread_map(workers)
    )
    save_raw(out_path, *content)


def write_diff_file_from_arrays(
    base: Mapping[str, np.ndarray],
    target: Mapping[str, np.ndarray],
    out_path: Path,
    compression_format: str = arc.DEFAULT_COMPRESSION,
    *,
    workers: int = 1,
) -> None:
    """``write_diff_file`` for in-memory state dicts (``bdn.proto.arc.encode_diff_arrays``)."""
    save_raw(out_path, *arc.encode_diff_arrays(base, target, compression_format, map=thread_map(workers)))


def apply_delta_file(
    base_path: Path,
    diff_path: Path,
    out_path: Path,
    compression_format: str,
    expected_size: int,
    *,
    workers: int = 1,
    name: str | None = None,
) -> None:
    """Rebuild a target safetensors file at ``out_path`` from its base file and a diff file.

    ``target = base XOR diff`` per tensor, with each rebuilt tensor's Adler-32 checked against the
    diff's metadata (``bdn.proto.arc.apply_diff``), tensors decoded on ``workers`` threads.
    ``out_path`` is created if needed and sized to ``expected_size`` bytes (the manifest's size of
    the rebuilt file; a diff that rebuilds another size is refused before anything is written).
    ``name`` labels errors (default: ``out_path``).

    Raises:
        ProtocolError: the diff is malformed, does not fit the base, or rebuilds a size other
            than ``expected_size``; ChecksumError (a ProtocolError) for an Adler-32 mismatch. The
            message names the file and the tensor: ``"model.safetensors: tensor 'w': ..."``.
        OSError: a file cannot be read or written.
    """
    label = name if name is not None else os.fspath(out_path)
    try:
        base, diff = _map(base_path), _map(diff_path)
        base_header = parse_header(base, len(base))
        diff_header = arc.read_diff_header(diff, len(diff))
        size = arc.target_size(base_header, diff_header)
        if size != expected_size:
            raise ProtocolError(f"the delta rebuilds {size} bytes but the manifest says {expected_size}")
        out = _map(out_path, write=True, size=size)
        if size:
            arc.apply_diff(base, base_header, diff, diff_header, out, compression_format, map=thread_map(workers))
            out.flush()  # type: ignore[attr-defined]  # _map gives a np.memmap for a non-empty file
        del base, diff, out
    except ProtocolError as e:
        err = type(e)(f"{label}: {e}")
    else:
        return
    raise err  # raised outside the mapped files' frames (see arc.apply_diff)


def apply_sparse_file(
    path: Path,
    diff_path: Path,
    adlers: Mapping[str, int] | None,
    *,
    workers: int = 1,
    name: str | None = None,
    mapped: Any = None,
) -> sparse.SparseResult:
    """Bring the safetensors file at ``path`` (holding a ``bdn_planes_v1`` diff's base) to the
    target in place, writing only the changed words (``bdn.proto.sparse.apply_sparse``).

    ``adlers``: the base tensors' known Adler-32s (None: computed for changed tensors only).
    ``name`` labels errors (default: ``path``). ``mapped``: a writable shared mapping of the whole
    file already made (``bdn.daemon.apply.hotmaps``), used instead of mapping it for this call.

    Raises:
        ProtocolError: a malformed diff or one that does not fit the file; ChecksumError (a
            ProtocolError) when a tensor's Adler-32 is not the diff's. The file then holds
            partial data. The message names the file.
        OSError: a file cannot be read or written.
    """
    label = name if name is not None else os.fspath(path)
    try:
        buf: Any = _map(path, write=True) if mapped is None else np.frombuffer(mapped, dtype=np.uint8)
        if mapped is not None and len(buf) != os.stat(path).st_size:
            raise ValueError(f"the mapping has {len(buf)} bytes, the file {os.stat(path).st_size}")
        diff = _map(diff_path)
        header = parse_header(buf, len(buf))
        _, streams = arc.read_diff_header(diff, len(diff))
        result = sparse.apply_sparse(buf, header, diff, streams, adlers, map=thread_map(workers))
        if mapped is None:
            buf.flush()
        del buf, diff
    except (ProtocolError, ValueError) as e:
        err = ProtocolError(f"{label}: {e}") if not isinstance(e, ProtocolError) else type(e)(f"{label}: {e}")
    else:
        return result
    raise err  # raised outside the mapped files' frames (see arc.apply_diff)
