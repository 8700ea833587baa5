"""A layer's chunks as a compact sequence over the manifest.

A snapshot of a million chunks must not cost a million Python objects: :class:`ChunkList` keeps
one integer per file (where the file's chunks start in the layer's order) and builds the
:class:`~bdn.proto.manifest.ChunkRef` of position ``i`` only when it is asked for. The order is
the manifest's (files in order, each file's chunks in order), the order of have-bitfields
(DESIGN.md, "Moving chunks").
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Sequence
from typing import overload

import numpy as np

from bdn.proto.errors import BdnError
from bdn.proto.manifest import ChunkRef, Manifest


class SnapshotTooLarge(BdnError):
    """A manifest over the configured ``max_chunks_per_snapshot`` / ``max_files_per_snapshot``."""


def check_limits(m: Manifest, max_chunks: int, max_files: int) -> None:
    """Refuse a manifest with more files or chunks (stored plus rebuilt) than the limits.

    Raises:
        SnapshotTooLarge: the message names the snapshot, its count and the limit.
    """
    if max_files and len(m.files) > max_files:
        raise SnapshotTooLarge(
            f"snapshot {m.identity} lists {len(m.files)} files, over max_files_per_snapshot = {max_files}"
        )
    n = sum(len(f.chunks) + (len(f.result.chunks) if f.result is not None else 0) for f in m.files)
    if max_chunks and n > max_chunks:
        raise SnapshotTooLarge(f"snapshot {m.identity} lists {n} chunks, over max_chunks_per_snapshot = {max_chunks}")


class ChunkList(Sequence[ChunkRef]):
    """The chunks of one layer (``result=False``: the stored objects; ``True``: the rebuilt
    files) of ``m``: ``len``, ``[i]`` -> ChunkRef, iteration, ``position(ref)`` -> ``i``,
    ``digest(i)`` without building the ref. Memory: O(files), not O(chunks)."""

    __slots__ = ("m", "result", "_starts", "_n")

    def __init__(self, m: Manifest, result: bool) -> None:
        self.m = m
        self.result = result
        starts, n = [], 0
        for f in m.files:
            starts.append(n)
            n += len(f.result_chunks if result else f.chunks)
        self._starts = starts
        self._n = n

    def __len__(self) -> int:
        return self._n

    def _locate(self, i: int) -> tuple[int, int]:
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(i)
        fi = bisect.bisect_right(self._starts, i) - 1
        while len(self._chunks(fi)) == 0:  # files without chunks share a start with the next
            fi += 1
        return fi, i - self._starts[fi]

    def _chunks(self, fi: int) -> Sequence[str]:
        f = self.m.files[fi]
        return f.result_chunks if self.result else f.chunks

    def _ref(self, fi: int, ci: int) -> ChunkRef:
        f = self.m.files[fi]
        size = f.result_size if self.result else f.size
        off = ci * self.m.chunk_size
        return ChunkRef(fi, f.path, ci, off, min(self.m.chunk_size, size - off), self._chunks(fi)[ci])

    @overload
    def __getitem__(self, i: int) -> ChunkRef: ...
    @overload
    def __getitem__(self, i: slice) -> list[ChunkRef]: ...

    def __getitem__(self, i: int | slice) -> ChunkRef | list[ChunkRef]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._n))]
        return self._ref(*self._locate(i))

    def __iter__(self) -> Iterator[ChunkRef]:
        cs = self.m.chunk_size
        for fi, f in enumerate(self.m.files):
            size = f.result_size if self.result else f.size
            for ci, d in enumerate(self._chunks(fi)):
                off = ci * cs
                yield ChunkRef(fi, f.path, ci, off, min(cs, size - off), d)

    def digest(self, i: int) -> str:
        """The xxh3-128 digest (hex) of chunk ``i``."""
        fi, ci = self._locate(i)
        return self._chunks(fi)[ci]

    def digests(self) -> Iterator[str]:
        """Every chunk's digest, in order."""
        for fi in range(len(self.m.files)):
            yield from self._chunks(fi)

    def position(self, ref: ChunkRef) -> int:
        """Where ``ref`` (a chunk of this layer) is in the order."""
        return self._starts[ref.file_index] + ref.index

    def holds(self, ref: ChunkRef) -> int | None:
        """Where ``ref`` is in the order if it is one of this layer's chunks (same file, place
        and digest), else None; builds no ChunkRef."""
        fi, ci = ref.file_index, ref.index
        if not 0 <= fi < len(self._starts):
            return None
        chunks = self._chunks(fi)
        if not 0 <= ci < len(chunks) or ref.offset != ci * self.m.chunk_size or chunks[ci] != ref.digest:
            return None
        return self._starts[fi] + ci

    def bytes_of(self, positions: Iterable[int]) -> int:
        """Total length of the chunks at ``positions`` (distinct), without building their refs:
        every chunk is ``chunk_size`` long but the last of each file."""
        pos = np.fromiter(positions, dtype=np.int64)
        if not len(pos):
            return 0
        cs = self.m.chunk_size
        total = len(pos) * cs
        lasts, short = [], []
        for fi, f in enumerate(self.m.files):
            k = len(self._chunks(fi))
            if k:
                size = f.result_size if self.result else f.size
                lasts.append(self._starts[fi] + k - 1)
                short.append(cs - (size - (k - 1) * cs))
        hit = np.isin(np.asarray(lasts, dtype=np.int64), pos)
        return int(total - np.asarray(short, dtype=np.int64)[hit].sum())
