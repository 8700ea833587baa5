"""The changed tensors of an offer: which tensors of a target differ from the snapshot an engine serves.

An engine offered ``target`` while it serves ``base`` needs to copy only the tensors that differ
(a *partial swap*, docs/ENGINES.md). The daemon knows both snapshots' READY markers (the xxh3-128
digest of every chunk of every rebuilt file, DESIGN.md, "READY") and their safetensors headers, so:

- a tensor new in the target, or with another dtype or shape, is changed;
- a tensor at the same byte range of the same file (same chunk size) is unchanged when every
  chunk covering its range has equal digests in both markers; a chunk with another digest that
  lies wholly inside the tensor's range makes it changed; one the tensor shares with a neighbour
  (its first or last) is settled by comparing only the bytes of that chunk inside the tensor's
  range (early exit at the first difference), so a changed neighbour never drags an unchanged
  tensor along;
- a tensor that moved (other file or offset) is compared byte for byte, early exit.

The answer is exact, and it reads at most two partial chunks per unchanged tensor. ``None``
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
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bdn.fileops import read_header
from bdn.proto.errors import BdnError
from bdn.proto.ready import READY_NAME, parse_ready
from bdn.proto.safetensors_fmt import tensor_index

log = logging.getLogger("bdn.hotload")

__all__ = ["ChangedTensorsCache", "Layout", "Span", "changed_tensors", "layout", "same_bytes_in"]

COMPARE_PIECE = 1 << 20
CACHE_ENTRIES = 8

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
    if (old.file != new.file or old.start != new.start or base.chunk_size != cs
            or old_chunks is None or new_chunks is None):
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
    headers = [(f.path, read_header(directory.joinpath(*f.path.split("/"))))
               for f in marker.files if f.path.endswith(".safetensors")]
    index = tensor_index(headers)
    tensors = {name: Span(path, info.start, info.end, info.dtype, tuple(info.shape))
               for name, (path, info) in index.items()}
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


class ChangedTensorsCache:
    """``await between(base, target)``: the changed tensors, computed on a worker thread once per
    pair and remembered (the last ``CACHE_ENTRIES`` pairs). ``ready_dir(identity)`` locates a
    snapshot; None (and a log line) when a directory cannot be read: the engine compares itself.
    """

    def __init__(self, ready_dir: Callable[[str], Path]) -> None:
        self.ready_dir = ready_dir
        self._done: OrderedDict[tuple[str, str], list[str] | None] = OrderedDict()
        self._running: dict[tuple[str, str], asyncio.Future[list[str] | None]] = {}

    async def between(self, base: str, target: str) -> list[str] | None:
        key = (base, target)
        if key in self._done:
            self._done.move_to_end(key)
            return self._done[key]
        fut = self._running.get(key)
        if fut is None:
            fut = asyncio.ensure_future(self._compute(base, target))
            self._running[key] = fut
        return await asyncio.shield(fut)

    async def _compute(self, base: str, target: str) -> list[str] | None:
        key = (base, target)
        t0 = time.monotonic()
        try:
            names = await asyncio.to_thread(compute, self.ready_dir(base), self.ready_dir(target))
            log.info("changed tensors of %s against %s: %s in %.3f s", target, base,
                     "no list" if names is None else len(names), time.monotonic() - t0)
        except (BdnError, OSError) as e:
            log.warning("changed tensors of %s against %s: %s (the engine compares itself)", target, base, e)
            names = None
        finally:
            self._running.pop(key, None)
        self._done[key] = names
        while len(self._done) > CACHE_ENTRIES:
            self._done.popitem(last=False)
        return names
