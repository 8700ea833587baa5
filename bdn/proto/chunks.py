"""Chunks: fixed-size byte ranges of one stored object, addressed by the xxh3-128 of their bytes.

Source: DESIGN.md ("Words: chunk"). Chunk ``i`` of an object of ``size`` bytes covers
``[i*chunk_size, min((i+1)*chunk_size, size))``; an empty object has no chunks. A digest is the
32-character lowercase hex of XXH3-128 (the canonical big-endian form ``xxhash.xxh3_128_hexdigest``
prints).
"""

from __future__ import annotations

import re
from typing import Any

import xxhash


DEFAULT_CHUNK_SIZE = 16 << 20
MIN_CHUNK_SIZE = 4 << 10
MAX_CHUNK_SIZE = 1 << 30
DIGEST_RE = re.compile(r"\A[0-9a-f]{32}\Z")


def digest(data: bytes | bytearray | memoryview) -> str:
    """XXH3-128 of ``data`` as 32 lowercase hex chars (runs at memory speed, no copy)."""
    return xxhash.xxh3_128_hexdigest(data)


def num_chunks(size: int, chunk_size: int) -> int:
    """Number of chunks of an object of ``size`` bytes (0 for an empty object)."""
    return (size + chunk_size - 1) // chunk_size


def chunk_range(size: int, chunk_size: int, index: int) -> tuple[int, int]:
    """``(offset, length)`` in bytes of chunk ``index``; raises IndexError outside the object."""
    offset = index * chunk_size
    if index < 0 or offset >= size:
        raise IndexError(f"chunk {index} outside object of {size} bytes")
    return offset, min(chunk_size, size - offset)


def buffer_digests(buf: Any, chunk_size: int) -> list[str]:
    """Digests of every chunk of ``buf`` (any buffer: bytes, mmap, uint8 array; zero-copy slices)."""
    view = memoryview(buf)
    try:
        return [digest(view[o : o + chunk_size]) for o in range(0, len(view), chunk_size)]
    finally:
        view.release()


# ``file_digests(path, chunk_size)`` is ``bdn.fileops.chunk_digests`` now (bdn/proto does no I/O).
