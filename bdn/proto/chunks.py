"""Chunks: fixed-size byte ranges of one stored object, addressed by the xxh3-128 of their bytes.

Source: DESIGN.md ("Words: chunk"). Chunk ``i`` of an object of ``size`` bytes covers
``[i*chunk_size, min((i+1)*chunk_size, size))``; an empty object has no chunks. A digest is the
32-character lowercase hex of XXH3-128 (the canonical big-endian form ``xxhash.xxh3_128_hexdigest``
prints).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

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


def concat_digests(buffers: Sequence[Any], chunk_size: int, map: Any = None) -> list[str]:
    """Digests of every chunk of the concatenation of ``buffers`` (no copy of the buffers).

    A chunk that spans buffers is hashed piece by piece (streaming XXH3-128). ``map(fn, items)``
    runs the per-chunk tasks (``bdn.fileops.thread_map(n)`` hashes on ``n`` cores; xxhash
    releases the GIL); serially by default.
    """
    views = [memoryview(b).cast("B") if not isinstance(b, memoryview) or b.format != "B" else b for b in buffers]
    tasks: list[list[memoryview]] = []
    cur: list[memoryview] = []
    room = chunk_size
    for v in views:
        pos = 0
        while pos < len(v):
            take = min(room, len(v) - pos)
            cur.append(v[pos : pos + take])
            pos += take
            room -= take
            if room == 0:
                tasks.append(cur)
                cur, room = [], chunk_size
    if cur:
        tasks.append(cur)

    def one(pieces: list[memoryview]) -> str:
        if len(pieces) == 1:
            return digest(pieces[0])
        h = xxhash.xxh3_128()
        for p in pieces:
            h.update(p)
        return h.hexdigest()

    return list(map(one, tasks)) if map is not None else [one(t) for t in tasks]


# ``file_digests(path, chunk_size)`` is ``bdn.fileops.chunk_digests`` now (bdn/proto does no I/O).


class Digests(Sequence[str]):
    """A file's chunk digests in one bytes block, 16 bytes per digest (a tuple of
    32-char strings costs 89 bytes a digest with its tuple slot: 89 MB for a million chunks). Reads like the tuple it replaces: ``d[i]`` / iteration give the lowercase hex digest,
    ``d[a:b]`` a tuple, and it equals (and hashes like) the tuple of the same digests."""

    __slots__ = ("_raw",)

    def __init__(self, raw: bytes) -> None:
        if len(raw) % 16:
            raise ValueError(f"{len(raw)} bytes is not a whole number of 16-byte digests")
        self._raw = bytes(raw)

    @classmethod
    def of(cls, hexes: Iterable[str]) -> Digests:
        """From lowercase hex digests (validated by the caller: ``DIGEST_RE``)."""
        return cls(bytes.fromhex("".join(hexes)))

    @property
    def raw(self) -> bytes:
        """The digests back to back, 16 bytes each."""
        return self._raw

    def __len__(self) -> int:
        return len(self._raw) >> 4

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[str, ...]: ...

    def __getitem__(self, i: int | slice) -> str | tuple[str, ...]:
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(len(self))))
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(i)
        return self._raw[i << 4 : (i + 1) << 4].hex()

    def __iter__(self) -> Iterator[str]:
        raw = self._raw
        for o in range(0, len(raw), 16):
            yield raw[o : o + 16].hex()

    def __contains__(self, value: object) -> bool:
        if not (isinstance(value, str) and DIGEST_RE.match(value)):
            return False
        b = bytes.fromhex(value)
        at = self._raw.find(b)
        while at >= 0:
            if at % 16 == 0:
                return True
            at = self._raw.find(b, at + 1)
        return False

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Digests):
            return self._raw == other._raw
        if isinstance(other, (tuple, list)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"Digests({len(self)} digests)"
