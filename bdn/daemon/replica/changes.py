"""The changed tensors of an offer: which tensors of a target differ from the snapshot an engine serves.

An engine offered ``target`` while it serves ``base`` needs to copy only the tensors that differ
(a *partial swap*, docs/ENGINES.md). The daemon knows both snapshots' READY markers (the xxh3-128
digest of every chunk of every rebuilt file, FORMATS.md, "READY") and their safetensors headers, so:

- a tensor new in the target, or with another dtype or shape, is changed;
- a tensor at the same byte range of the same file (same chunk size) is unchanged when every
  chunk covering its range has equal digests in both markers; a chunk with another digest that
  lies wholly inside the tensor's range makes it changed; one the tensor shares with a neighbour
  (its first or last) is settled by comparing only the bytes of that chunk inside the tensor's
  range (early exit at the first difference), so a changed neighbour never drags an unchanged
  tensor along;
- a tensor that moved (other file or offset) is compared byte for byte, early exit.

The answer is exact, and it reads at most two partial chunks per unchanged tensor. Two ways to it:

- **from the delta's streams** (:func:`from_diffs`, the common hot-load: the engine serves the
  delta's base). The delta rebuilds every tensor as ``base XOR stream`` (``bdn.proto.arc``) with
  the base's header, so a tensor is unchanged exactly when its stream decodes to zeros. A stream
  longer than ``SMALL_STREAM`` bytes is counted changed without decoding it (an all-zero tensor
  compresses to a few hundred bytes; a wrong "changed" only copies more, never leaves stale
  bytes); a small one is decoded piece by piece (bounded memory) and checked, or, for
  ``bdn_planes_v1``, judged by its block records alone (``sparse.stream_changes``: no decode). This needs only the
  base's READY directory and the target's verified stored diff files, so the daemon computes it
  while the target is still ``applying`` (:meth:`ChangedTensorsCache.start`), and the offer at
  READY does not wait for it. Why not the digests: the chunk size is 16 MiB, so a chunk shared by
  a changed and an unchanged tensor had to be compared byte for byte (measured: 0.47-0.56 s
  between READY and the offer for 13 of 51 matrices changed, 0.59 GB model).
- **from the two READY directories** (:func:`compute`, any other pair), as below. ``None``
(no list: the engine compares itself) when the target lacks a tensor of the base (a partial swap
would leave it in place) or a name appears in two files.

``changed_tensors`` is the pure rule over two :class:`Layout` s and a ``same_bytes`` callback;
``layout`` and ``same_bytes_in`` read a READY directory; ``ChangedTensorsCache`` runs them off the
event loop and remembers recent answers.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import zstandard

from bdn.fileops import read_header
from bdn.proto import arc, sparse
from bdn.proto.errors import BdnError
from bdn.proto.ready import READY_NAME, parse_ready
from bdn.proto.safetensors_fmt import tensor_index

log = logging.getLogger("bdn.hotload")

__all__ = [
    "ChangedTensorsCache",
    "DeltaSource",
    "Layout",
    "Span",
    "changed_tensors",
    "changed_words",
    "from_diffs",
    "layout",
    "ranges_from_diffs",
    "same_bytes_in",
]

COMPARE_PIECE = 1 << 20
CACHE_ENTRIES = 8
SMALL_STREAM = 64 << 10  # a longer diff stream counts as changed without decoding it
DECODE_PIECE = 1 << 20

# same_bytes(base_file, base_offset, target_file, target_offset, length) -> bool
SameBytes = Callable[[str, int, str, int, int], bool]


@dataclass(frozen=True)
class Span:
    """One tensor: its file (relative path), absolute byte range ``[start, end)``, dtype and shape."""

    file: str
    start: int
    end: int
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Layout:
    """What the daemon knows of one ready snapshot: chunk size, chunk digests per file, tensors.

    ``tensors`` is in file order, then offset order (the order the answer keeps).
    """

    identity: str
    chunk_size: int
    chunks: dict[str, tuple[str, ...]]
    tensors: dict[str, Span]


def _chunk_range(start: int, end: int, cs: int) -> range:
    return range(start // cs, (end - 1) // cs + 1)


def _tensor_changed(name: str, old: Span, new: Span, base: Layout, target: Layout, same: SameBytes) -> bool:
    if old.dtype != new.dtype or old.shape != new.shape or old.end - old.start != new.end - new.start:
        return True
    n = new.end - new.start
    if n == 0:
        return False
    cs = target.chunk_size
    old_chunks, new_chunks = base.chunks.get(old.file), target.chunks.get(new.file)
    if (
        old.file != new.file
        or old.start != new.start
        or base.chunk_size != cs
        or old_chunks is None
        or new_chunks is None
    ):
        return not same(old.file, old.start, new.file, new.start, n)
    span = _chunk_range(new.start, new.end, cs)
    if span.stop > len(old_chunks) or span.stop > len(new_chunks):
        return not same(old.file, old.start, new.file, new.start, n)
    for i in span:
        if old_chunks[i] == new_chunks[i]:
            continue
        lo, hi = max(new.start, i * cs), min(new.end, (i + 1) * cs)
        if lo == i * cs and hi == (i + 1) * cs:
            return True  # a whole chunk inside the tensor differs
        if not same(old.file, lo, new.file, lo, hi - lo):
            return True
    return False


def changed_tensors(base: Layout, target: Layout, same: SameBytes) -> list[str] | None:
    """The names of ``target``'s tensors that differ from ``base`` (see the module doc), in the
    target's order; None when the target lacks a tensor of the base.

    ``same(base_file, base_offset, target_file, target_offset, length)`` says whether those byte
    ranges hold equal bytes; it is called only for ranges the digests cannot settle.
    """
    if set(base.tensors) - set(target.tensors):
        return None
    out = []
    for name, new in target.tensors.items():
        old = base.tensors.get(name)
        if old is None or _tensor_changed(name, old, new, base, target, same):
            out.append(name)
    return out


def layout(directory: Path) -> Layout:
    """The layout of the READY snapshot directory ``directory`` (its marker and headers).

    Raises BdnError (a marker or header that does not parse, a tensor named in two files) or
    OSError (a file that cannot be read).
    """
    marker = parse_ready((directory / READY_NAME).read_bytes())
    headers = [
        (f.path, read_header(directory.joinpath(*f.path.split("/"))))
        for f in marker.files
        if f.path.endswith(".safetensors")
    ]
    index = tensor_index(headers)
    tensors = {
        name: Span(path, info.start, info.end, info.dtype, tuple(info.shape)) for name, (path, info) in index.items()
    }
    return Layout(marker.identity, marker.chunk_size, {f.path: tuple(f.chunks) for f in marker.files}, tensors)


def same_bytes_in(base_dir: Path, target_dir: Path) -> SameBytes:
    """A ``same`` callback reading the two directories' files (``pread`` in 1 MiB pieces, stops at
    the first difference)."""

    def same(bfile: str, boff: int, tfile: str, toff: int, length: int) -> bool:
        fa = os.open(base_dir.joinpath(*bfile.split("/")), os.O_RDONLY)
        try:
            fb = os.open(target_dir.joinpath(*tfile.split("/")), os.O_RDONLY)
            try:
                done = 0
                while done < length:
                    n = min(COMPARE_PIECE, length - done)
                    a, b = os.pread(fa, n, boff + done), os.pread(fb, n, toff + done)
                    if len(a) != n or a != b:
                        return False
                    done += n
                return True
            finally:
                os.close(fb)
        finally:
            os.close(fa)

    return same


def compute(base_dir: Path, target_dir: Path) -> list[str] | None:
    """``changed_tensors`` between two READY directories (blocking: reads headers and a few chunks)."""
    return changed_tensors(layout(base_dir), layout(target_dir), same_bytes_in(base_dir, target_dir))


@dataclass(frozen=True)
class DeltaSource:
    """A delta target's stored diff files: its ``base`` identity, the ``stored_dir`` holding them,
    their paths relative to it (``diff_files``), every ``*.safetensors`` path of the target
    (``tensor_files``) and the ``compression_format`` (``bdn.proto.arc.COMPRESSION_FORMATS``)."""

    base: str
    stored_dir: Path
    diff_files: tuple[str, ...]
    tensor_files: tuple[str, ...]
    compression_format: str


def delta_source(m: Any, stored_dir: Path) -> DeltaSource | None:
    """The :class:`DeltaSource` of manifest ``m`` (``bdn.proto.manifest.Manifest``) whose stored
    files are in ``stored_dir``; None when ``m`` is no delta or its diff files are not all there
    (a delta rebuilt from peers' chunks has none)."""
    if not m.is_delta or m.base_identity is None or not m.compression_format:
        return None
    diffs = tuple(f.path for f in m.files if f.is_diff and f.path.endswith(".safetensors"))
    if not diffs or not all(stored_dir.joinpath(*p.split("/")).is_file() for p in diffs):
        return None
    tensor_files = tuple(f.path for f in m.files if f.path.endswith(".safetensors"))
    return DeltaSource(m.base_identity, stored_dir, diffs, tensor_files, m.compression_format)


WORDS_CODEC = "bdn_planes_v1"


def changed_words(delta: DeltaSource | None, base: str, job: Any) -> dict[str, Any]:
    """The offer's optional ``changed_words`` field (docs/ENGINES.md, "Word-level swaps"), or ``{}``.

    ``{"changed_words": {"codec": "bdn_planes_v1", "base": base, "files": {target file: absolute
    path of its stored diff file}}}``, given only when every fact an engine relies on holds: the
    target is a ``bdn_planes_v1`` delta on ``base`` (the snapshot the engine serves), every
    ``*.safetensors`` file of the target is stored as a diff, the stored layer is complete
    (every diff chunk verified against the manifest, so no unverified byte is
    offered) and each diff file is on disk at the manifest's size. ``job``: the target's record
    (``bdn.daemon.snapshots.snapshot.SnapshotJob``: its ``manifest`` and ``stored`` bitfield). The files live in the target's stored directory, kept as
    long as the target is: the offer's lease keeps it from GC until the engine acknowledged it or
    failed (DESIGN.md, "Engine link and leases"). Stats the diff files (a few, in shm).
    """
    stored, m = getattr(job, "stored", None), getattr(job, "manifest", None)  # (test fakes lack them)
    if (
        delta is None
        or m is None
        or delta.base != base
        or delta.compression_format.lower() != WORDS_CODEC
        or stored is None
        or not stored.complete
        or set(delta.tensor_files) - set(delta.diff_files)
    ):
        return {}
    sizes = {f.path: f.size for f in m.files if f.is_diff}
    files: dict[str, str] = {}
    for rel in delta.diff_files:
        path = delta.stored_dir.joinpath(*rel.split("/"))
        try:
            if path.stat().st_size != sizes.get(rel):
                return {}
        except OSError:
            return {}
        files[rel] = str(path)
    return {"changed_words": {"codec": WORDS_CODEC, "base": base, "files": files}}


def _zero_stream(frame: bytes, n: int, fmt: str) -> bool:
    """True when ``frame`` decodes (``fmt``) to exactly ``n`` zero bytes; False for anything else,
    a malformed frame included (the apply step reports those; here they only mean "changed")."""
    try:
        if fmt == "arc_v2":
            done = 0
            with zstandard.ZstdDecompressor().stream_reader(frame, read_across_frames=True) as r:
                while True:
                    piece = r.read(DECODE_PIECE)
                    if not piece:
                        return done == n
                    done += len(piece)
                    if done > n or np.frombuffer(piece, np.uint8).any():
                        return False
        if fmt == "arc_v1":
            d, data, done = zlib.decompressobj(), frame, 0
            while data and not d.eof:
                piece = d.decompress(data, DECODE_PIECE)
                data = d.unconsumed_tail
                done += len(piece)
                if done > n or np.frombuffer(piece, np.uint8).any():
                    return False
            return d.eof and done == n
        # bdn_planes_v1: its block records say which words change, nothing is decoded (decoding
        # 51 small streams whole took 0.34 s between READY and the offer at 0.1 % changed)
        return not sparse.stream_changes(frame, n)
    except (BdnError, zstandard.ZstdError, zlib.error, ValueError):
        return False


def _diff_streams(path: Path) -> tuple[dict[str, arc.DiffTensor], int]:
    """A diff file's streams (its header only is read) and its size."""
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        head = fh.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        if n <= 0 or 8 + n > size or n > 100 << 20:
            raise BdnError(f"{path.name}: not a diff file (header length {n}, file size {size})")
        _header, streams = arc.read_diff_header(head + fh.read(n), size)
    return streams, size


def from_diffs(base_dir: Path, delta: DeltaSource) -> list[str] | None:
    """The changed tensors of a delta target against its own base (see the module doc), in the
    target's order (the base's header is the target's); None when the rule does not apply (a
    tensor file stored whole, not as a diff; a stream for a tensor the base lacks).

    Raises BdnError / OSError for an unreadable base directory or diff file.
    """
    base = layout(base_dir)
    if set(delta.tensor_files) - set(delta.diff_files):
        return None
    fmt = delta.compression_format.lower()
    changed: set[str] = set()
    for rel in delta.diff_files:
        path = delta.stored_dir.joinpath(*rel.split("/"))
        streams, _size = _diff_streams(path)
        with open(path, "rb") as fh:
            for name, st in streams.items():
                span = base.tensors.get(name)
                if span is None or span.file != rel:
                    return None
                length = st.frame_end - st.frame_start
                if length > SMALL_STREAM:
                    changed.add(name)
                    continue
                fh.seek(st.frame_start)
                if not _zero_stream(fh.read(length), span.end - span.start, fmt):
                    changed.add(name)
    return [name for name in base.tensors if name in changed]


def ranges_from_diffs(base_dir: Path, delta: DeltaSource, names: list[str]) -> dict[str, list[list[int]]]:
    """The changed byte ranges of each tensor in ``names`` (a :func:`from_diffs` answer), ABSOLUTE
    offsets ``[start, end)`` in the tensor's file: for ``bdn_planes_v1`` the 4 KiB pages of the
    tensor that hold a changed word, merged to at most 64 ranges (``bdn.proto.sparse.stream_ranges``,
    decoding only where the words are); for the arc formats the whole tensor. Raises BdnError /
    OSError for an unreadable file."""
    base = layout(base_dir)
    want = set(names)
    out: dict[str, list[list[int]]] = {}
    planes = delta.compression_format.lower() == "bdn_planes_v1"
    for rel in delta.diff_files:
        path = delta.stored_dir.joinpath(*rel.split("/"))
        streams, _size = _diff_streams(path)
        header = read_header(base_dir.joinpath(*rel.split("/"))) if planes else None
        with open(path, "rb") as fh:
            for name, st in streams.items():
                span = base.tensors.get(name)
                if name not in want or span is None:
                    continue
                if header is None:
                    out[name] = [[span.start, span.end]]
                    continue
                fh.seek(st.frame_start)
                frame = fh.read(st.frame_end - st.frame_start)
                out[name] = [[a, b] for a, b in sparse.stream_ranges(frame, header.tensors[name])]
    return out


class SparseRanges(Protocol):
    """What the daemon's sparse applies know of a target (``bdn.daemon.apply.forward.Forward``)."""

    def planned(self, identity: str) -> bool:
        """A sparse apply of ``identity`` is about to run or running."""
        ...

    def ranges(self, identity: str) -> dict[str, list[list[int]]] | None:
        """The changed ranges of every tensor of ``identity`` against its base (absolute file
        offsets, ``bdn.proto.sparse.SparseResult.ranges``) when a sparse apply brought every diff
        file forward; None otherwise."""
        ...


class ChangedTensorsCache:
    """``await between(base, target, delta)``: the changed tensors, computed on a worker thread once
    per pair and remembered (the last ``CACHE_ENTRIES`` pairs); ``start(base, target, delta)``
    begins the computation from the delta's streams before the target is READY, and ``between``
    joins it. ``ready_dir(identity)`` locates a snapshot; None (and a log line) when nothing can be
    read: the engine compares itself.

    ``sparse``: the sparse applies' ranges. A ``bdn_planes_v1`` target that a sparse apply brings
    forward gets its changed ranges from that apply (which decoded every changed word anyway)
    instead of decoding the streams a second time beside it (``ranges_from_diffs``; profiled in
    ``bench/hotload``: a quarter of the apply's CPU, on the same 2 cores, while it ran).
    """

    def __init__(self, ready_dir: Callable[[str], Path], sparse: SparseRanges | None = None) -> None:
        self.ready_dir = ready_dir
        self.sparse = sparse
        self._done: OrderedDict[tuple[str, str], list[str] | None] = OrderedDict()
        self._ranges: dict[tuple[str, str], dict[str, list[list[int]]]] = {}
        self._running: dict[tuple[str, str], asyncio.Future[list[str] | None]] = {}
        self._deferred: set[tuple[str, str]] = set()  # pairs whose ranges a sparse apply gives

    def start(self, base: str, target: str, delta: DeltaSource) -> None:
        """Compute from ``delta``'s streams now (``delta.base == base``; the target need not be READY)."""
        key = (base, target)
        if delta.base == base and key not in self._done and key not in self._running:
            self._running[key] = asyncio.ensure_future(self._compute(base, target, delta, ready=False))

    async def between(self, base: str, target: str, delta: DeltaSource | None = None) -> list[str] | None:
        """The answer for READY ``target`` against READY ``base`` (``delta``: the target's stored diffs)."""
        key = (base, target)
        if key in self._done:
            self._done.move_to_end(key)
            return await self._with_ranges(key, delta, self._done[key])
        fut = self._running.get(key)
        if fut is not None:
            names = await asyncio.shield(fut)
            if key in self._done:
                return await self._with_ranges(key, delta, names)
        fut = self._running.get(key)
        if fut is None:
            fut = asyncio.ensure_future(self._compute(base, target, delta, ready=True))
            self._running[key] = fut
        return await self._with_ranges(key, delta, await asyncio.shield(fut))

    async def _with_ranges(
        self, key: tuple[str, str], delta: DeltaSource | None, names: list[str] | None
    ) -> list[str] | None:
        """Fill in the ranges a sparse apply was to give (now READY: it gave them, or fell back)."""
        if names is None or key in self._ranges or key not in self._deferred:
            return names
        self._deferred.discard(key)
        known = self.sparse.ranges(key[1]) if self.sparse is not None else None
        if known is not None:
            self._ranges[key] = {n: known.get(n, []) for n in names}
        elif delta is not None:
            try:
                self._ranges[key] = await asyncio.to_thread(ranges_from_diffs, self.ready_dir(key[0]), delta, names)
            except (BdnError, OSError) as e:
                log.warning("changed ranges of %s from its diff files: %s", key[1], e)
        return names

    async def _compute(self, base: str, target: str, delta: DeltaSource | None, ready: bool) -> list[str] | None:
        """``ready`` False: only the delta's streams may be used, and no answer is remembered
        unless they gave one (the READY directories are compared later)."""
        key = (base, target)
        t0 = time.monotonic()
        names, how = None, "no list"
        try:
            if delta is not None and delta.base == base:
                try:
                    names = await asyncio.to_thread(from_diffs, self.ready_dir(base), delta)
                    how = "from the delta's streams"
                    if names is not None:
                        if self.sparse is not None and self.sparse.planned(target):
                            self._deferred.add(key)  # the sparse apply decodes them: taken at READY
                        else:
                            self._ranges[key] = await asyncio.to_thread(
                                ranges_from_diffs, self.ready_dir(base), delta, names
                            )
                except (BdnError, OSError) as e:
                    log.warning("changed tensors of %s from its diff files: %s", target, e)
            if names is None and not ready:
                return None
            if names is None:
                names = await asyncio.to_thread(compute, self.ready_dir(base), self.ready_dir(target))
                how = "from the READY directories"
            log.info(
                "changed tensors of %s against %s: %s %s in %.3f s",
                target,
                base,
                "no list" if names is None else len(names),
                how,
                time.monotonic() - t0,
            )
        except (BdnError, OSError) as e:
            log.warning("changed tensors of %s against %s: %s (the engine compares itself)", target, base, e)
            names = None
        finally:
            self._running.pop(key, None)
        self._done[key] = names
        while len(self._done) > CACHE_ENTRIES:
            old = self._done.popitem(last=False)[0]
            self._ranges.pop(old, None)
            self._deferred.discard(old)
        return names

    def ranges_of(self, base: str, target: str) -> dict[str, Any]:
        """``{"changed_ranges": {tensor: [[start, end], ...]}}`` for a pair :meth:`between` answered
        from the delta's streams (``ranges_from_diffs``), else ``{}``: the offer's optional field."""
        r = self._ranges.get((base, target))
        return {} if r is None else {"changed_ranges": r}
