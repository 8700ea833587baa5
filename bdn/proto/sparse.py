"""Sparse apply of a ``bdn_planes_v1`` diff: write only the changed words of a buffer that holds
the base, and keep each tensor's Adler-32 by updating it from the changed bytes alone
(DESIGN.md, "Sparse apply").

Why it is correct. A planes stream says which words of a tensor changed (a *same* block: none; a
*sparse* block: exactly the ``k`` indices it lists; a *dense* block: any of them) and what they are
XORed with (:mod:`bdn.proto.planes`). A buffer that holds the base's bytes therefore becomes the
target by XORing those words in place; every other byte already is the target's. Adler-32 (RFC
1950) of ``n`` bytes ``d_0 .. d_(n-1)`` is ``a = 1 + sum d_p``, ``b = n + sum (n - p) d_p`` (mod
65521), linear in each byte, so changing byte ``p`` from ``o`` to ``v`` adds ``v - o`` to ``a`` and
``(n - p)(v - o)`` to ``b``: the target tensor's checksum follows from the base tensor's and the
changed bytes, and is compared with the diff's metadata exactly as a full apply compares it.

The base tensor's checksum comes from the caller (``adlers``: what the buffer is known to hold,
e.g. the previous diff's metadata); a changed tensor whose checksum the caller does not know is
checksummed here before it is written (one pass over that tensor only).

No I/O and no threads: the caller maps the buffer and passes a :data:`bdn.proto.delta_tasks.Map`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bdn.proto import sparse_kernel
from bdn.proto.delta_tasks import (
    Map,
    bytes_of,
    first_error,
    lease,
    raw_adler32,
    serial_map,
)
from bdn.proto.diff_file import DiffTensor, check_names
from bdn.proto.errors import ChecksumError, ProtocolError
from bdn.proto.planes import (
    _P_DENSE,
    _P_SAME,
    _P_WIDTHS,
    _PlanesBlock,
    _words_from_planes,
    _zstd_exact,
    parse_stream,
)
from bdn.proto.safetensors_fmt import Header, TensorInfo, _q

__all__ = [
    "MAX_RANGES",
    "PAGE",
    "SparseResult",
    "adler_update",
    "apply_sparse",
    "apply_sparse_tensors",
    "changed_bytes",
    "changed_per_tensor",
    "stream_changes",
    "check_untouched",
    "coalesce",
    "stream_ranges",
    "touched_chunks",
]

_MOD = 65521
#: Changed ranges are whole pages of the tensor (4 KiB, counted from the tensor's first byte):
#: what an engine or a page cache reads anyway, and thousands of times fewer than changed words.
PAGE = 4096
_PAGE_SHIFT = 12
#: A tensor's changed ranges are merged until at most this many remain (the largest gaps stay
#: breaks): an offer of a 0.1 %-scattered tensor lists a few ranges, not a million words.
MAX_RANGES = 64


@dataclass
class SparseResult:
    """What :func:`apply_sparse` did to one file.

    ``ranges``: per changed tensor, ``[start, end)`` ABSOLUTE file byte offsets covering every
    changed byte (whole :data:`PAGE`-sized pages of the tensor, merged, at most :data:`MAX_RANGES`
    per tensor); ``adlers``: every tensor's
    Adler-32 after the apply (the diff's metadata, each checked for a changed tensor);
    ``written``: bytes written (changed words times their width, dense blocks whole);
    ``checksummed``: bytes read only to learn a base tensor's Adler-32 the caller did not know.
    """

    ranges: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    adlers: dict[str, int] = field(default_factory=dict)
    written: int = 0
    checksummed: int = 0


def changed_bytes(diff: Any, streams: Mapping[str, DiffTensor], base_header: Header) -> int:
    """Bytes a sparse apply of this diff writes (from the block records alone, no decoding):
    ``k * w`` per sparse block, the whole block for a dense one. Raises ProtocolError for a
    malformed stream."""
    return sum(changed_per_tensor(diff, streams, base_header).values())


def stream_changes(stream: Any, nbytes: int) -> bool:
    """Whether the ``bdn_planes_v1`` stream of a tensor of ``nbytes`` bytes changes any word, from
    its block records alone (no plane is decoded: a tensor of only *same* blocks is left exactly as
    its base). Raises ProtocolError for a malformed stream."""
    _w, blocks = parse_stream(bytes_of(stream), nbytes)
    return any(blk.mode != _P_SAME for blk in blocks)


def changed_per_tensor(diff: Any, streams: Mapping[str, DiffTensor], base_header: Header) -> dict[str, int]:
    """``{tensor name: bytes a sparse apply writes to it}`` for every tensor whose stream changes a
    word (block records alone, as :func:`changed_bytes`); a tensor of only *same* blocks is absent.
    Raises ProtocolError (naming the tensor) for a malformed stream or one past the diff's end."""
    d = bytes_of(diff)
    out: dict[str, int] = {}
    for info in base_header.tensors.values():
        s = streams[info.name]
        if s.frame_end > len(d):
            raise ProtocolError(f"diff stream for tensor {_q(info.name)} lies past the end of the diff buffer")
        try:
            w, blocks = parse_stream(d[s.frame_start : s.frame_end], info.nbytes)
        except ProtocolError as e:
            raise ProtocolError(f"tensor {_q(info.name)}: {e}") from None
        n = sum((blk.hi - blk.lo) if blk.mode == _P_DENSE else blk.k * w for blk in blocks if blk.mode != _P_SAME)
        if any(blk.mode != _P_SAME for blk in blocks):
            out[info.name] = n
    return out


def adler_update(adler: int, n: int, pos: np.ndarray, old: np.ndarray, new: np.ndarray) -> int:
    """Adler-32 of ``n`` bytes after the bytes at positions ``pos`` changed from ``old`` to ``new``.

    ``adler``: the checksum before; ``pos``: int64 byte positions ``< n`` (each once); ``old`` /
    ``new``: the bytes there (uint8 arrays as long as ``pos``). RFC 1950's sums are linear in each
    byte (module docstring), so this reads only the changed bytes.
    """
    da, db = _sums(n, pos, old.astype(np.int64), new.astype(np.int64))
    return _combine(adler, da, db)


def _sums(n: int, pos: np.ndarray, old: np.ndarray, new: np.ndarray) -> tuple[int, int]:
    d = new - old
    wgt = (n - pos) % _MOD
    return int(d.sum()) % _MOD, int(np.dot(wgt, d)) % _MOD


def _combine(adler: int, da: int, db: int) -> int:
    a = ((adler & 0xFFFF) + da) % _MOD
    b = ((adler >> 16) + db) % _MOD
    return (b << 16) | a


def coalesce(starts: np.ndarray, ends: np.ndarray, limit: int = MAX_RANGES) -> list[tuple[int, int]]:
    """Sorted ``[start, end)`` ranges merged until at most ``limit`` remain (the ``limit - 1``
    largest gaps stay; ties keep the earlier gaps). Input: ascending ``starts`` and ``ends``;
    ranges that touch or overlap (``starts[i + 1] <= ends[i]``) are always merged."""
    if len(starts) == 0:
        return []
    gaps = starts[1:] - ends[:-1]
    breaks = np.flatnonzero(gaps > 0)
    if len(breaks) >= limit:
        # the limit-1 largest gaps stay breaks: a linear-time threshold, then the first ones at it
        thr = np.partition(gaps[breaks], len(breaks) - (limit - 1))[len(breaks) - (limit - 1)]
        above = breaks[gaps[breaks] > thr]
        at = breaks[gaps[breaks] == thr][: limit - 1 - len(above)]
        breaks = np.sort(np.concatenate((above, at)))
    lo = np.concatenate(([starts[0]], starts[breaks + 1]))
    hi = np.concatenate((ends[breaks], [ends[-1]]))
    return list(zip(lo.tolist(), hi.tolist()))


def _sparse_indices(
    cx: Any, payload: np.ndarray, blk: _PlanesBlock, w: int, elems: int
) -> tuple[np.ndarray, np.ndarray]:
    """A sparse block's changed word indices (ascending, int64) and its decoded payload."""
    k, e = blk.k, blk.e
    raw = _zstd_exact(cx, payload, k + 4 * e + k * w)
    g8 = raw[:k]
    if not g8.all():
        raise ProtocolError("a gap of 0 between changed elements")
    esc = np.flatnonzero(g8 == 255)
    if len(esc) != e:
        raise ProtocolError(f"{len(esc)} escaped gaps, the block record says {e}")
    gaps = g8.astype(np.int64)
    if e:
        over = raw[k : k + 4 * e].view("<u4")
        if int(over.min()) < 255:
            raise ProtocolError("an escaped gap below 255")
        gaps[esc] = over
    nz = np.cumsum(gaps, dtype=np.int64)
    nz -= 1
    if int(nz[-1]) >= elems:
        raise ProtocolError(f"changed element {int(nz[-1])} lies past the block's {elems} elements")
    return nz, raw


def _block_sums(before: int, after: int, blk: _PlanesBlock, n: int) -> tuple[int, int]:
    """The block's contribution ``(da, db)`` to its tensor's sums from the block's Adler-32 before
    and after: for L bytes at ``lo`` it gives S = sum d and W = sum (L - i) d, and
    sum (n - p) d = (n - lo - L) S + W."""
    ds = ((after & 0xFFFF) - (before & 0xFFFF)) % _MOD
    dw = ((after >> 16) - (before >> 16)) % _MOD
    return ds, ((n - blk.lo - (blk.hi - blk.lo)) * ds + dw) % _MOD


def _block_pages(blk: _PlanesBlock) -> tuple[np.ndarray, np.ndarray]:
    """The pages of the tensor the block covers, as one run ``([first], [end])``."""
    return np.array([blk.lo >> _PAGE_SHIFT]), np.array([((blk.hi - 1) >> _PAGE_SHIFT) + 1])


def _block(
    cx: Any,
    stream: np.ndarray,
    blk: _PlanesBlock,
    buf: np.ndarray,
    w: int,
    n: int,
    fused: bool = False,
) -> tuple[int, int, np.ndarray, np.ndarray, int]:
    """Apply one block in place (``buf``: the tensor's bytes); returns ``(da, db, page run starts,
    page run ends, bytes written)``, pages of the tensor, each sum mod 65521. ``fused``: XOR a
    heavy block (:func:`_is_heavy`) with the compiled kernel when it is available."""
    dt = np.dtype(_P_WIDTHS[w]).newbyteorder("<")
    elems = (blk.hi - blk.lo) // w
    words = buf[blk.lo : blk.hi].view(dt)
    payload = stream[blk.start : blk.end]
    seg = buf[blk.lo : blk.hi]
    if fused and _is_heavy(blk, w):
        # One sequential sweep decodes each changed word's index and XORs it in place
        # (sparse_kernel.xor_block); the block's contribution to the tensor's sums comes from
        # its Adler-32 before and after (SIMD, the block in cache: _block_sums).
        dense = blk.mode == _P_DENSE
        raw = _zstd_exact(cx, payload, elems * w if dense else blk.k * (1 + w) + 4 * blk.e)
        before = raw_adler32(seg)
        st = sparse_kernel.xor_block(words, raw, 0 if dense else blk.k, 0 if dense else blk.e)
        if st is not None:
            if st != sparse_kernel.OK:
                _sparse_indices(cx, payload, blk, w, elems)  # raises the numpy decoder's message
                raise ProtocolError("its fields are invalid")  # pragma: no cover - both decoders check the same fields
            after = raw_adler32(seg)
            written = blk.hi - blk.lo if dense else blk.k * w
            return _block_sums(before, after, blk, n) + _block_pages(blk) + (written,)
        # the kernel failed to load: nothing was written, the numpy path below applies the block
    if blk.mode == _P_DENSE:
        # More than 1/8 of the words change: XOR the whole block in one sequential pass, and take
        # the block's contribution to the tensor's sums from its Adler-32 before and after (SIMD,
        # sequential) instead of per word (_block_sums).
        raw = _zstd_exact(cx, payload, elems * w)
        x = _words_from_planes(raw, w, cx.pscratch(elems * w).view(dt))
        before = raw_adler32(seg)
        np.bitwise_xor(words, x, out=words)
        after = raw_adler32(seg)
        return _block_sums(before, after, blk, n) + _block_pages(blk) + (blk.hi - blk.lo,)
    else:
        nz, raw = _sparse_indices(cx, payload, blk, w, elems)
        vals = _words_from_planes(raw[blk.k + 4 * blk.e :], w, np.empty(blk.k, dtype=dt))
        if _is_heavy(blk, w):
            # A sixteenth of the block's bytes or more: two sequential Adler-32 passes over the
            # block cost less than the per-word sums below (as for a dense block).
            before = raw_adler32(seg)
            words[nz] ^= vals
            after = raw_adler32(seg)
            return _block_sums(before, after, blk, n) + _block_pages(blk) + (len(nz) * w,)
    return _per_word(words, nz, vals, w, n, blk.lo)


def _per_word(
    words: np.ndarray, nz: np.ndarray, vals: np.ndarray, w: int, n: int, lo: int
) -> tuple[int, int, np.ndarray, np.ndarray, int]:
    """XOR ``vals`` into ``words[nz]`` (``words``: the words from tensor byte ``lo`` on; ``nz``
    ascending int64 word indices) and return ``(da, db, pages, pages, bytes written)`` from the
    changed words' bytes alone (module docstring); the pages are runs of one page each."""
    old: np.ndarray = words[nz]
    new: np.ndarray = old ^ vals
    words[nz] = new
    # Byte j of word i sits at tensor position p = lo + i*w + j: sum (n - p) d = (n - lo) S -
    # sum (i*w mod 65521) d - sum j d (mod 65521), S = sum d; the products stay far below 2**63
    # (weights < 2**16, |d| <= 255 a byte, <= 2**31 words).
    nb, ob = new.view(np.uint8).reshape(-1, w), old.view(np.uint8).reshape(-1, w)
    dd = nb[:, 0].astype(np.int64)
    dd -= ob[:, 0]
    extra = 0
    for j in range(1, w):
        dj = nb[:, j].astype(np.int32)
        dj -= ob[:, j]
        dd += dj
        extra += j * int(dj.sum())
    s1 = int(dd.sum())
    q = nz * w
    sq = int(np.dot(q % _MOD, dd)) + extra
    da, db = s1 % _MOD, ((n - lo) * s1 - sq) % _MOD
    # Pages of the tensor holding changed words (a word never straddles a page: 4096 % w == 0 and
    # words sit at multiples of w from the tensor's start); q is ascending, so runs are adjacent.
    page = (q + lo) >> _PAGE_SHIFT
    keep = np.empty(len(page), dtype=bool)
    keep[:1] = True
    np.not_equal(page[1:], page[:-1], out=keep[1:])
    pages = page[keep]
    return da, db, pages, pages + 1, len(nz) * w


def _is_heavy(blk: _PlanesBlock, w: int) -> bool:
    """A dense block, or a sparse one whose changed words are a sixteenth of its bytes or more:
    applied alone by :func:`_block` (XOR in one sweep, Adler-32 of the block before and after).
    At that density two sequential Adler-32 passes (SIMD, the block in cache) cost less than
    per-word sums, and a sequential sweep less than the light runs' gather and scatter
    (``bench/nodework``, clustered 2 %: blocks with every other word changed)."""
    return blk.mode == _P_DENSE or blk.k * w * 16 >= blk.hi - blk.lo


#: Light sparse blocks of one tensor applied together by :func:`_light_run` (one gather, XOR,
#: scatter and checksum pass for them all instead of a dozen numpy calls per block).
RUN_BLOCKS = 32
#: ... and of at most this many changed words together (a block with more is a run alone): a
#: worker's memory for a run is about 70 bytes a changed word (indices, words, sums), ~70 MiB here.
RUN_WORDS = 1 << 20
#: A file whose blocks write fewer bytes than this is applied on the calling thread.
SERIAL_BYTES = 8 << 20


def _light_run(
    cx: Any,
    stream: np.ndarray,
    blks: list[_PlanesBlock],
    buf: np.ndarray,
    w: int,
    n: int,
) -> tuple[int, int, np.ndarray, np.ndarray, int]:
    """Apply consecutive light sparse blocks of one tensor in place in one vectorised pass
    (``buf``: the tensor's bytes); the same result as :func:`_block` of each, summed. Raises
    ProtocolError naming the first bad block."""
    dt = np.dtype(_P_WIDTHS[w]).newbyteorder("<")
    idx: list[np.ndarray] = []
    vals: list[np.ndarray] = []
    for blk in blks:
        try:
            nz, raw = _sparse_indices(cx, stream[blk.start : blk.end], blk, w, (blk.hi - blk.lo) // w)
        except ProtocolError as e:
            raise ProtocolError(f"bdn_planes_v1 block {blk.index}: {e}") from None
        nz += blk.lo // w
        idx.append(nz)
        vals.append(_words_from_planes(raw[blk.k + 4 * blk.e :], w, np.empty(blk.k, dtype=dt)))
    words = buf[: n - n % w].view(dt)
    return _per_word(words, np.concatenate(idx), np.concatenate(vals), w, n, 0)


def _fused_run(
    cx: Any,
    stream: np.ndarray,
    blks: list[_PlanesBlock],
    buf: np.ndarray,
    w: int,
    n: int,
) -> tuple[int, int, np.ndarray, np.ndarray, int] | None:
    """:func:`_light_run` in one compiled pass (:mod:`bdn.proto.sparse_kernel`): the blocks'
    zstd frames decoded into one reused buffer, then one kernel call for the run; the same
    result, page runs merged. None when the kernel is unavailable. Raises ProtocolError naming
    the first bad block (with the numpy decoder's message for it)."""
    sizes = [blk.k * (1 + w) + 4 * blk.e for blk in blks]
    raw = cx.scratch(sum(sizes))
    rows = []
    at = 0
    for blk, size in zip(blks, sizes):
        try:
            raw[at : at + size] = _zstd_exact(cx, stream[blk.start : blk.end], size)
        except ProtocolError as e:
            raise ProtocolError(f"bdn_planes_v1 block {blk.index}: {e}") from None
        rows.append((at, blk.k, blk.e, blk.lo // w, (blk.hi - blk.lo) // w))
        at += size
    words = buf[: n - n % w].view(np.dtype(_P_WIDTHS[w]).newbyteorder("<"))
    k = sum(blk.k for blk in blks)
    # a run of pages ends where the next starts at least a page later: no more runs than changed
    # words, nor than half the pages the blocks span (plus one)
    span = ((blks[-1].hi - 1) >> _PAGE_SHIFT) - (blks[0].lo >> _PAGE_SHIFT) + 1
    runs = np.empty((min(k, span // 2 + 1), 2), dtype=np.int64)
    got = sparse_kernel.run(words, raw, np.array(rows, dtype=np.int64), n, runs)
    if got is None:
        return None
    st, row, da, db, nruns = got
    if st != sparse_kernel.OK:
        blk = blks[row]
        try:  # the numpy decoder names what is wrong with the block
            _sparse_indices(cx, stream[blk.start : blk.end], blk, w, (blk.hi - blk.lo) // w)
            detail = "its fields are invalid"  # pragma: no cover - the two decoders check the same fields
        except ProtocolError as e:
            detail = str(e)
        raise ProtocolError(f"bdn_planes_v1 block {blk.index}: {detail}")
    return da, db, runs[:nruns, 0].copy(), runs[:nruns, 1].copy(), k * w


def apply_sparse(
    buf: Any,
    base_header: Header,
    diff_buf: Any,
    streams: Mapping[str, DiffTensor],
    adlers: Mapping[str, int] | None = None,
    *,
    map: Map[Any, Any] = serial_map,
    fused: bool | None = None,
) -> SparseResult:
    """Turn ``buf`` (writable, holding exactly the base file's bytes) into the target in place,
    writing only changed words; check every changed tensor's Adler-32.

    ``base_header``: the base file's parsed header (the target's is the same, :mod:`bdn.proto.arc`);
    ``diff_buf``/``streams``: a ``bdn_planes_v1`` diff file and its streams (``read_diff_header``);
    ``adlers``: what the caller knows of the base tensors' Adler-32s (a missing name is computed
    from ``buf`` before its tensor is written, if it changes). Blocks are tasks through ``map``
    (heavy blocks alone, light ones in runs of :data:`RUN_BLOCKS`), on the calling thread when
    they write fewer than :data:`SERIAL_BYTES` together. ``fused``: apply sparse blocks with the
    compiled kernel (:mod:`bdn.proto.sparse_kernel`); None (the default) when it is available,
    False for the numpy path (the same bytes, sums and ranges; tests and benchmarks compare them).

    Raises:
        ProtocolError: a stream does not fit the base (naming tensor and block); nothing of that
            file is trustworthy then.
        ChecksumError: a changed tensor's Adler-32 after the apply is not the diff's, or an
            unchanged tensor's known Adler-32 is not the diff's: the buffer did not hold the base
            (or the diff is not for it). ``buf`` then holds partial data.
        ValueError: ``buf`` is read-only or not the base's size.
    """
    # plain ndarray views: slicing a numpy.memmap costs a subclass object per slice
    b = bytes_of(buf).view(np.ndarray)
    size = base_header.file_size
    if len(b) != size:
        raise ValueError(f"buffer has {len(b)} bytes, the base is {size}")
    if not b.flags.writeable:
        raise ValueError("buffer is read-only")
    views = {info.name: b[info.start : info.end] for info in base_header.tensors.values()}
    return apply_sparse_tensors(views, base_header, diff_buf, streams, adlers, map=map, fused=fused)


def apply_sparse_tensors(
    tensors: Mapping[str, np.ndarray],
    base_header: Header,
    diff_buf: Any,
    streams: Mapping[str, DiffTensor],
    adlers: Mapping[str, int] | None = None,
    *,
    map: Map[Any, Any] = serial_map,
    fused: bool | None = None,
) -> SparseResult:
    """:func:`apply_sparse` on tensors held apart rather than in one file buffer: an engine's
    parameters, each known to hold its base tensor's bytes (docs/ENGINES.md, "Word-level swaps").

    ``tensors``: ``{name: writable flat uint8 array of that tensor's bytes}``; it must hold every
    tensor of ``base_header`` whose stream changes a word (an unchanged one may be absent). The
    rest as :func:`apply_sparse`: the same blocks, bytes, checks and errors; ``SparseResult.ranges``
    are still the file's absolute offsets (``base_header``'s). Raises ValueError, before anything
    is written, for a changed tensor missing from ``tensors``, of another size or read-only.
    """
    d = bytes_of(diff_buf).view(np.ndarray)
    check_names(base_header, streams)
    known = dict(adlers or {})
    fused = sparse_kernel.available() if fused is None else fused and sparse_kernel.available()
    infos = sorted(base_header.tensors.values(), key=lambda t: t.nbytes, reverse=True)
    parsed: list[tuple[TensorInfo, np.ndarray, int, list[_PlanesBlock]]] = []
    res = SparseResult()
    for info in infos:
        s = streams[info.name]
        if s.frame_end > len(d):
            raise ProtocolError(f"diff stream for tensor {_q(info.name)} lies past the end of the diff buffer")
        stream = d[s.frame_start : s.frame_end]
        try:
            w, blocks = parse_stream(stream, info.nbytes)
        except ProtocolError as e:
            raise ProtocolError(f"tensor {_q(info.name)}: {e}") from None
        live = [blk for blk in blocks if blk.mode != _P_SAME]
        if not live:
            want = s.target_adler32
            if info.name in known and known[info.name] != want:
                raise ChecksumError(
                    f"adler32 mismatch for unchanged tensor {_q(info.name)}: the buffer is known to hold "
                    f"{known[info.name]}, the diff says {want}"
                )
            res.adlers[info.name] = want
            continue
        parsed.append((info, stream, w, live))
    for info, *_ in parsed:
        view = tensors.get(info.name)
        if view is None or len(view) != info.nbytes or view.dtype != np.uint8 or not view.flags.writeable:
            raise ValueError(
                f"tensor {_q(info.name)} changes but no writable buffer of its {info.nbytes} bytes is given"
            )
    missing = [info for info, *_ in parsed if info.name not in known]

    def checksum(info: TensorInfo) -> tuple[str, int]:
        return info.name, raw_adler32(tensors[info.name])

    for name, a in map(checksum, missing) if len(missing) > 1 else serial_map(checksum, missing):
        known[name] = a
        res.checksummed += base_header.tensors[name].nbytes
    # Tasks: each heavy block alone, light sparse blocks in runs of up to RUN_BLOCKS consecutive ones.
    tasks: list[tuple[int, int, list[_PlanesBlock]]] = []
    for ti, (_, _, w, live) in enumerate(parsed):
        # a run never spans a heavy block, so the tensor's tasks are in block order
        light: list[_PlanesBlock] = []
        for blk in live:
            if _is_heavy(blk, w):
                if light:
                    tasks.append((ti, len(tasks), light))
                    light = []
                tasks.append((ti, len(tasks), [blk]))
                continue
            if light and (len(light) == RUN_BLOCKS or sum(x.k for x in light) + blk.k > RUN_WORDS):
                tasks.append((ti, len(tasks), light))
                light = []
            light.append(blk)
        if light:
            tasks.append((ti, len(tasks), light))
    res_of: list[Any] = [None] * len(tasks)

    def one(task: tuple[int, int, list[_PlanesBlock]]) -> Exception | None:
        ti, slot, blks = task
        info, stream, w, _ = parsed[ti]
        tb = tensors[info.name]
        try:
            with lease() as cx:
                if len(blks) == 1 and _is_heavy(blks[0], w):
                    try:
                        res_of[slot] = _block(cx, stream, blks[0], tb, w, info.nbytes, fused)
                    except ProtocolError as e:
                        raise ProtocolError(f"bdn_planes_v1 block {blks[0].index}: {e}") from None
                else:
                    got = _fused_run(cx, stream, blks, tb, w, info.nbytes) if fused else None
                    res_of[slot] = got if got is not None else _light_run(cx, stream, blks, tb, w, info.nbytes)
        except ProtocolError as e:
            return ProtocolError(f"tensor {_q(info.name)}: {e}")
        return None

    # Little to write (0.1 % of a model's values): threads cost more (GIL hand-offs, a busy
    # machine's scheduler) than they save, so the file's tasks run on this thread.
    work = sum(
        (blk.hi - blk.lo) if blk.mode == _P_DENSE else blk.k * parsed[ti][2] for ti, _, blks in tasks for blk in blks
    )
    err = first_error(one, tasks, map if work >= SERIAL_BYTES else serial_map)
    if err is not None:
        raise err
    out: list[list[Any]] = [[] for _ in parsed]
    for ti, slot, _ in tasks:
        out[ti].append(res_of[slot])
    for (info, _, _, _), blocks in zip(parsed, out):
        da = sum(r[0] for r in blocks) % _MOD
        db = sum(r[1] for r in blocks) % _MOD
        got = _combine(known[info.name], da, db)
        want = streams[info.name].target_adler32
        if got != want:
            raise ChecksumError(f"adler32 mismatch for tensor {_q(info.name)}: expected {want}, got {got}")
        res.adlers[info.name] = got
        res.written += sum(r[4] for r in blocks)
        # page runs, ascending (tasks in block order); a page may end one and start the next,
        # which coalesce merges (a gap <= 0 is no break)
        first = np.concatenate([r[2] for r in blocks])
        if len(first):
            lo = (first << _PAGE_SHIFT) + info.start
            hi = np.minimum(np.concatenate([r[3] for r in blocks]) << _PAGE_SHIFT, info.nbytes) + info.start
            res.ranges[info.name] = coalesce(lo, hi)
    return res


def touched_chunks(ranges: Mapping[str, list[tuple[int, int]]], size: int, chunk_size: int) -> list[int]:
    """Indices of the ``chunk_size``-byte chunks of a ``size``-byte file that any range touches."""
    hit: set[int] = set()
    for rs in ranges.values():
        for lo, hi in rs:
            if hi > lo:
                hit.update(range(lo // chunk_size, (min(hi, size) - 1) // chunk_size + 1))
    return sorted(hit)


def check_untouched(touched: list[int], before: list[str], after: list[str], path: str) -> None:
    """Every chunk no range touched must keep its digest: ``after[i] == before[i]`` (the manifest's
    digest of the target against the buffer's known digest of the base; strings, no I/O).

    Raises ChecksumError naming the first chunk whose digest the target changes although the diff
    leaves its bytes alone (the buffer does not hold the diff's base, or the manifest is not this
    diff's), or when the chunk counts differ.
    """
    if len(before) != len(after):
        raise ChecksumError(f"{path}: the buffer has {len(before)} chunks, the target {len(after)}")
    t = set(touched)
    for i, (b, a) in enumerate(zip(before, after)):
        if i not in t and a != b:
            raise ChecksumError(f"{path}: chunk {i} is untouched by the diff but its digest changes ({b} -> {a})")


def stream_ranges(stream: Any, info: TensorInfo) -> list[tuple[int, int]]:
    """The changed ranges of one tensor's ``bdn_planes_v1`` stream without applying it: whole
    :data:`PAGE` s of the tensor holding a changed word (a dense block: the whole block), ABSOLUTE
    file offsets from ``info``, merged to at most :data:`MAX_RANGES`. ``[]`` for an unchanged
    tensor. Raises ProtocolError for a stream that does not fit the tensor."""
    s = bytes_of(stream)
    w, blocks = parse_stream(s, info.nbytes)
    pages: list[np.ndarray] = []
    with lease() as cx:
        for blk in blocks:
            if blk.mode == _P_SAME:
                continue
            if blk.mode == _P_DENSE:
                pages.append(np.arange(blk.lo >> _PAGE_SHIFT, ((blk.hi - 1) >> _PAGE_SHIFT) + 1, dtype=np.int64))
                continue
            nz, _ = _sparse_indices(cx, s[blk.start : blk.end], blk, w, (blk.hi - blk.lo) // w)
            pages.append((nz * w + blk.lo) >> _PAGE_SHIFT)
    if not pages:
        return []
    p = np.concatenate(pages)
    p = p[np.concatenate(([True], p[1:] != p[:-1]))]
    lo = (p << _PAGE_SHIFT) + info.start
    hi = np.minimum((p + 1) << _PAGE_SHIFT, info.nbytes) + info.start
    return coalesce(lo, hi)
