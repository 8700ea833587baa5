"""
``bdn_planes_v1``: bdn's own delta format (hot-load services of other vendors do not read it).

Own code, not a library: no other tool writes or reads this format. The diff-file container and
the ``arc_v1``/``arc_v2`` codecs are :mod:`bdn.proto.arc`; this module is the per-tensor stream.

The diff file is exactly as above (same tensor names, 1-D ``U8`` tensors, ``__metadata__`` the
decimal Adler-32 of each target tensor, ``checksum_format`` "alder32"); each tensor's bytes are one
*planes stream* instead of one zstd frame. Why: an optimizer step changes a few percent of the
elements, by small amounts. Coding the positions as small gaps and each byte of the changed XOR
words as its own plane (byte 0 of every word, then byte 1, ...) gives zstd's entropy stage narrow
distributions; arc_v2 mixes them in one byte stream. Measured 1.57-1.82x smaller than arc_v2 on
synthetic bf16 steps, MiniLM and real AdamW steps (BENCHMARKS.md, "Delta formats"). Blocks are
coded independently, so one large tensor decodes on all cores.

The tensor's ``n`` bytes are read as ``m = n / w`` little-endian unsigned words of ``w`` bytes
(``w``: the dtype's size, or 1 for a dtype of another size; ``x``: the word-wise XOR), cut into blocks
of ``B`` words (the last one shorter). All integers are little-endian.

=========  ====  =====================================================================
offset     size  field
=========  ====  =====================================================================
0          4     magic ``b"BDNP"``
4          1     version, 1
5          1     ``w``: 1, 2, 4 or 8
6          2     reserved, 0
8          8     ``n``: the tensor's byte length (must equal the base tensor's; ``n % w == 0``)
16         4     ``B``: words per block; ``4096 <= B`` and ``B * w <= 16 MiB``
20         4     ``nblocks`` = ceil(m / B) (0 for an empty tensor)
24         13*N  one record per block: ``mode`` u8, ``k`` u32, ``e`` u32, ``len`` u32
24+13*N    ...   the blocks' payloads, concatenated in block order: ``len`` bytes each
=========  ====  =====================================================================

The stream ends exactly after the last payload. Per block of ``b`` words, by ``mode``:

* 0, *same*: ``x`` is zero over the block. ``k = e = len = 0``, no payload.
* 1, *sparse*: ``k`` words differ (``1 <= k <= b``), at increasing indices ``i_1 < ... < i_k``
  within the block. The payload is one zstd frame (content size in its header, no bytes after
  it) of exactly ``k + 4e + k*w`` bytes: ``k`` gap bytes ``g_j = i_j - i_(j-1)`` (with
  ``i_0 = -1``, so every gap is >= 1), where a gap >= 255 is written as 255 and its value goes,
  in order, to ``e`` u32 *escaped gaps* (each >= 255) that follow; then ``w`` byte planes of ``k``
  bytes each, plane ``j`` holding byte ``j`` of every changed XOR word ``x[i_1], ..., x[i_k]``.
* 2, *dense*: ``k = e = 0``; the payload is one zstd frame of exactly ``b*w`` bytes: the ``w``
  byte planes of the whole block's ``x``.

The encoder (zstd level 3, ``B = 2**20``) writes *dense* only when more than 1/8 of the block's
words change and it is smaller than *sparse*. The decoder checks, before using it, every field
against the base tensor's size: magic, version, width, ``n``, ``B``, ``nblocks``, each record
(mode, ``k <= b``, ``e <= k``, lengths that add up to the stream), each frame's declared content
size (decompression writes into a buffer of exactly that size: zip-bomb safe), gaps >= 1, escape
counts, escaped gaps >= 255, the last index < ``b``, and no bytes after a frame. Any failure is a
ProtocolError naming the tensor and block. ``target = base XOR x``; each block's Adler-32 is
computed while it is in cache and combined (``adler32_combine``) into the tensor's, which must
equal the diff's metadata (ChecksumError).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import zstandard

from bdn.proto import planes_scan
from bdn.proto.delta_tasks import (
    ZSTD_LEVEL,
    Ctx,
    Map,
    adler32_combine,
    bytes_of,
    first_error,
    lease,
    raw_adler32,
    serial_map,
)
from bdn.proto.diff_file import DiffTensor
from bdn.proto.errors import ChecksumError, ProtocolError, TensorMismatch
from bdn.proto.safetensors_fmt import TensorInfo, _q

_P_MAGIC = b"BDNP"
_P_VERSION = 1
_P_HEAD = struct.Struct("<4sBBHQII")  # magic, version, width, reserved, n_bytes, block, nblocks
_P_REC = struct.Struct("<BIII")  # per block: mode, k (changed words), e (escaped gaps), payload length
_P_WIDTHS: dict[int, type] = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
#: Elements per block the encoder writes (tests shrink it). The decoder accepts any block size in
#: [_P_MIN_BLOCK, _P_MAX_BLOCK_BYTES / width]: the lower bound keeps a hostile stream from turning
#: each few bytes of input into a Python-level task, the upper bound caps per-block memory.
PLANES_BLOCK = 1 << 20
_P_MIN_BLOCK = 1 << 12
_P_MAX_BLOCK_BYTES = 1 << 24
_P_SPARSE, _P_DENSE, _P_SAME = 1, 2, 0
_P_BATCH = 1 << 20
_P_PIECE = 1 << 20


def _planes_of(words: np.ndarray, w: int) -> bytes:
    """Byte planes of little-endian words: plane j = byte j of every word, planes concatenated."""
    return np.ascontiguousarray(words.view(np.uint8).reshape(-1, w).T).tobytes()


def _changed(x: np.ndarray) -> np.ndarray:
    """Indices of the nonzero words of ``x`` (increasing), as ``np.flatnonzero(x)``, faster.

    numpy's ``nonzero`` of a word array takes a branch per word (0.6 GB/s of CPU time here at
    2 % changed bf16); of a bool array it is 4x faster, and when few 8-byte groups change at
    all, finding those groups first and then the words inside them is faster again (6.5 GB/s
    at 0.1 %, measured in CPU time).
    """
    n = len(x)
    w = x.itemsize
    if w >= 8 or n % (8 // w) or x.ctypes.data % 8:
        return np.flatnonzero(x != 0)
    groups = x.view(np.uint64) != 0
    count = int(np.count_nonzero(groups))
    if count == 0:
        return np.empty(0, dtype=np.intp)
    if count * 32 >= len(groups):  # many groups changed: expanding them costs more than it saves
        return np.flatnonzero(x != 0)
    per = n // len(groups)
    g = np.flatnonzero(groups)
    sub = x.reshape(-1, per)[g]
    return ((g[:, None] * per) + np.arange(per))[sub != 0]


def _sparse_fields(cx: Ctx, b: np.ndarray, t: np.ndarray) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """(k, gap bytes, escaped gaps as little-endian u32, changed XOR words) of one block.

    One pass of the compiled kernel (:mod:`bdn.proto.planes_scan`) when numba is there; else
    numpy's XOR, :func:`_changed`, gaps and gather.
    """
    if planes_scan.available():
        found = planes_scan.scan(
            b, t, cx.pscratch(planes_scan.scratch_bytes(len(b))), cx.scratch(b.nbytes).view(b.dtype)
        )
        if found is not None:
            return found
    x = np.bitwise_xor(b, t, out=cx.scratch(b.nbytes).view(b.dtype))
    nz = _changed(x)
    gaps = np.diff(nz, prepend=-1)
    return len(nz), np.minimum(gaps, 255).astype(np.uint8), gaps[gaps >= 255].astype("<u4"), x[nz]


def _encode_block(cx: Ctx, b: np.ndarray, t: np.ndarray, w: int, level: int) -> tuple[int, int, int, bytes]:
    """(mode, k, e, payload) of one block; ``b``/``t`` are little-endian word arrays."""
    k, g8, over, vals = _sparse_fields(cx, b, t)
    if k == 0:
        return _P_SAME, 0, 0, b""
    cctx = cx.cctx(level)
    sparse = cctx.compress(b"".join((g8.tobytes(), over.astype("<u4", copy=False).tobytes(), _planes_of(vals, w))))
    if k > len(b) // 8:  # dense can only win when many words change
        x = np.bitwise_xor(b, t, out=cx.scratch(b.nbytes).view(b.dtype))
        dense = cctx.compress(_planes_of(x, w))
        if len(dense) < len(sparse):
            return _P_DENSE, 0, 0, dense
    return _P_SPARSE, k, len(over), sparse


def _planes_width(nbytes: int, width: int | None) -> int:
    # Dtypes wider than 8 bytes or odd widths (none in safetensors today) fall back to bytes.
    return width if width in _P_WIDTHS and nbytes % width == 0 else 1


def _planes_blocks(b: np.ndarray, t: np.ndarray, w: int) -> list[tuple[np.ndarray, np.ndarray]]:
    dt = np.dtype(_P_WIDTHS[w]).newbyteorder("<")
    bw, tw = b.view(dt), t.view(dt)
    return [(bw[s : s + PLANES_BLOCK], tw[s : s + PLANES_BLOCK]) for s in range(0, len(bw), PLANES_BLOCK)]


def _planes_assemble(n: int, w: int, blocks: list[tuple[int, int, int, bytes]]) -> bytes:
    if len(blocks) >= 1 << 32:
        raise TensorMismatch(f"tensor of {n} bytes needs {len(blocks)} blocks, more than bdn_planes_v1 can index")
    head = _P_HEAD.pack(_P_MAGIC, _P_VERSION, w, 0, n, PLANES_BLOCK, len(blocks))
    recs = [_P_REC.pack(mode, k, e, len(p)) for mode, k, e, p in blocks]
    return b"".join([head, *recs, *(p for *_, p in blocks)])


def encode_stream(cx: Ctx, b: np.ndarray, t: np.ndarray, width: int | None, level: int) -> bytes:
    """One bdn_planes_v1 stream of ``b XOR t`` (equal-length uint8 arrays), blocks coded serially."""
    w = _planes_width(len(b), width)
    blocks = [_encode_block(cx, bb, tb, w, level) for bb, tb in _planes_blocks(b, t, w)]
    return _planes_assemble(len(b), w, blocks)


class _PlanesBlock(NamedTuple):
    """One block of a parsed stream: payload ``[start, end)`` of the stream, bytes ``[lo, hi)`` of the tensor."""

    index: int  # type: ignore[assignment]  # the block's position; shadows tuple.index, which nothing calls
    mode: int
    k: int
    e: int
    start: int
    end: int
    lo: int
    hi: int


def parse_stream(stream: np.ndarray, n: int) -> tuple[int, list[_PlanesBlock]]:
    """Validate a stream's header and block table against a base tensor of ``n`` bytes.

    Returns (width, blocks). Every field is checked before it is used to index anything, so a
    hostile stream raises ProtocolError here or decodes into exactly ``n`` bytes.
    """
    total = len(stream)
    if total < _P_HEAD.size:
        raise ProtocolError(f"bdn_planes_v1 stream is {total} bytes, shorter than its {_P_HEAD.size}-byte header")
    magic, version, w, reserved, n_bytes, block, nblocks = _P_HEAD.unpack_from(stream, 0)  # type: ignore[arg-type]  # numpy's stubs give ndarray __buffer__ only from Python 3.12
    if magic != _P_MAGIC:
        raise ProtocolError(f"not a bdn_planes_v1 stream (magic {bytes(magic)!r})")
    if version != _P_VERSION or reserved != 0:
        raise ProtocolError(f"bdn_planes_v1 stream has version {version}, reserved {reserved}; bdn reads version 1, 0")
    if w not in _P_WIDTHS:
        raise ProtocolError(f"bdn_planes_v1 element width {w} is not 1, 2, 4 or 8")
    if n_bytes != n:
        raise ProtocolError(f"bdn_planes_v1 stream is for a {n_bytes}-byte tensor, the base tensor has {n} bytes")
    if n % w:
        raise ProtocolError(f"base tensor of {n} bytes is not a whole number of {w}-byte elements")
    if not _P_MIN_BLOCK <= block or block * w > _P_MAX_BLOCK_BYTES:
        raise ProtocolError(
            f"bdn_planes_v1 block of {block} elements of {w} bytes is outside [{_P_MIN_BLOCK}, {_P_MAX_BLOCK_BYTES // w}]"
        )
    m = n // w
    want_blocks = -(-m // block)
    if nblocks != want_blocks:
        raise ProtocolError(f"bdn_planes_v1 stream has {nblocks} blocks, a {n}-byte tensor needs {want_blocks}")
    table_end = _P_HEAD.size + nblocks * _P_REC.size
    if table_end > total:
        raise ProtocolError(
            f"bdn_planes_v1 block table ({nblocks} blocks) lies past the end of the {total}-byte stream"
        )
    # A plain loop: most tensors have one block, where numpy's per-call overhead would dominate
    # (and this runs before the pool starts, so it is serial time).
    blocks: list[_PlanesBlock] = []
    pos, lo = table_end, 0
    for i, (mode, k, e, ln) in enumerate(_P_REC.iter_unpack(memoryview(stream)[_P_HEAD.size : table_end])):  # type: ignore[arg-type]  # numpy's stubs give ndarray __buffer__ only from Python 3.12
        elems = block if i < nblocks - 1 else m - (nblocks - 1) * block
        if not (
            (mode == _P_SAME and k == e == ln == 0)
            or (mode == _P_SPARSE and 1 <= k <= elems and e <= k and ln >= 1)
            or (mode == _P_DENSE and k == e == 0 and ln >= 1)
        ):
            raise ProtocolError(
                f"bdn_planes_v1 block {i} record is invalid (mode {mode}, k {k}, escapes {e}, "
                f"payload {ln} bytes, block of {elems} elements)"
            )
        blocks.append(_PlanesBlock(i, mode, k, e, pos, pos + ln, lo, lo + elems * w))
        pos += ln
        lo += elems * w
    if pos != total:
        raise ProtocolError(
            f"bdn_planes_v1 payloads add up to {pos - table_end} bytes, the stream has {total - table_end} after its block table"
        )
    return w, blocks


def _zstd_exact(cx: Ctx, payload: np.ndarray, size: int) -> np.ndarray:
    """Decompress a payload that must be exactly one zstd frame of exactly ``size`` bytes.

    The frame's declared content size is checked first and python-zstandard's one-shot decode
    writes into a buffer of exactly that size, so output never exceeds ``size`` (zip-bomb safe).
    """
    try:
        declared = zstandard.frame_content_size(payload)  # type: ignore[arg-type]  # zstandard reads any buffer; its stubs name bytes-likes only
    except zstandard.ZstdError as e:
        raise ProtocolError(f"payload is not a zstd frame: {str(e)[:200]}") from None
    if declared != size:
        raise ProtocolError(f"payload's zstd frame declares {declared} bytes, expected {size}")
    try:
        # allow_extra_data=False: the library refuses bytes after the frame (one C call, no walk
        # of the frame's blocks here)
        raw = cx.dctx().decompress(payload, allow_extra_data=False)  # type: ignore[arg-type]  # zstandard reads any buffer; its stubs name bytes-likes only
    except zstandard.ZstdError as e:
        try:  # which error: a valid frame followed by bytes, or no valid frame
            cx.dctx().decompress(payload)  # type: ignore[arg-type]  # as above
        except zstandard.ZstdError:
            raise ProtocolError(f"payload is not valid zstd: {str(e)[:200]}") from None
        raise ProtocolError("payload has bytes after its zstd frame") from None
    if len(raw) != size:  # pragma: no cover - the library enforces the declared size
        raise ProtocolError(f"payload decompresses to {len(raw)} bytes, expected {size}")
    return np.frombuffer(raw, dtype=np.uint8)


def _words_from_planes(planes: np.ndarray, w: int, out: np.ndarray) -> np.ndarray:
    """Interleave ``w`` byte planes (``planes`` is w*k bytes) into k little-endian words in ``out``.

    Shifting whole planes into the word array measured 4-8x faster than a transposed copy.
    """
    p = planes.reshape(w, -1)
    np.copyto(out, p[w - 1])
    for j in range(w - 2, -1, -1):
        out <<= 8
        out |= p[j]
    return out


def _decode_planes_block(cx: Ctx, stream: np.ndarray, blk: _PlanesBlock, b: np.ndarray, o: np.ndarray, w: int) -> int:
    """Decode one block into ``o`` (``b``/``o``: the block's base and output bytes); return its Adler-32."""
    in_place = o.ctypes.data == b.ctypes.data
    dt: np.dtype[Any] = np.dtype(_P_WIDTHS[w]).newbyteorder("<")
    elems = (blk.hi - blk.lo) // w
    payload = stream[blk.start : blk.end]
    if blk.mode == _P_DENSE:
        raw = _zstd_exact(cx, payload, elems * w)
        x = _words_from_planes(raw, w, cx.pscratch(elems * w).view(dt))
        np.bitwise_xor(b.view(dt), x, out=o.view(dt))
        return raw_adler32(o)
    if blk.mode == _P_SPARSE:
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
        idx = np.cumsum(gaps)
        idx -= 1
        if int(idx[-1]) >= elems:  # gaps are >= 1, so idx is increasing: the last is the largest
            raise ProtocolError(f"changed element {int(idx[-1])} lies past the block's {elems} elements")
        vals = _words_from_planes(raw[k + 4 * e :], w, np.empty(k, dtype=dt))
        # Copy, scatter and checksum piece by piece, while each piece is in cache.
        step = _P_PIECE // w
        cuts = np.searchsorted(idx, np.arange(step, elems, step)).tolist()
        adler = 1
        for p, (i, j) in enumerate(zip([0, *cuts], [*cuts, k])):
            lo, hi = p * step * w, min((p + 1) * step, elems) * w
            if not in_place:
                np.copyto(o[lo:hi], b[lo:hi])
            if j > i:
                ov = o[lo:hi].view(dt)
                ov[idx[i:j] - p * step] ^= vals[i:j]
            adler = raw_adler32(o[lo:hi], adler)
        return adler
    if in_place:
        return raw_adler32(o)
    adler = 1
    for lo in range(0, len(o), _P_PIECE):  # copy and checksum in cache-sized pieces
        np.copyto(o[lo : lo + _P_PIECE], b[lo : lo + _P_PIECE])
        adler = raw_adler32(o[lo : lo + _P_PIECE], adler)
    return adler


def decode_stream(cx: Ctx, stream: Any, b: np.ndarray, o: np.ndarray, n: int) -> int:
    """Decode one whole stream serially into ``o``; return the Adler-32 of the ``n`` bytes written.

    ``stream``: the tensor's ``bdn_planes_v1`` bytes; ``b``/``o``: the base and output tensors as
    ``uint8`` arrays of ``n`` bytes (may be the same buffer). Raises ProtocolError (naming the
    block) for a stream that does not fit a base of ``n`` bytes.
    """
    s = bytes_of(stream)
    w, blocks = parse_stream(s, n)
    adler = 1
    for blk in blocks:
        try:
            got = _decode_planes_block(cx, s, blk, b[blk.lo : blk.hi], o[blk.lo : blk.hi], w)
        except ProtocolError as e:
            raise ProtocolError(f"bdn_planes_v1 block {blk.index}: {e}") from None
        adler = adler32_combine(adler, got, blk.hi - blk.lo)
    return adler


def apply_tensors(
    base: np.ndarray,
    diff: np.ndarray,
    streams: Mapping[str, DiffTensor],
    out: np.ndarray,
    infos: list[TensorInfo],
    map: Map[Any, Any],
) -> Exception | None:
    """bdn_planes_v1 apply: every block of every tensor is one task, so one large tensor uses all cores.

    Each task writes its block of ``out`` and returns its Adler-32; a tensor's Adler-32 is the
    ``adler32_combine`` of its blocks' in order (computed while each block is still in cache,
    instead of a second pass over the tensor).
    """
    parsed: list[tuple[TensorInfo, np.ndarray, int, list[_PlanesBlock]]] = []
    for info in infos:  # every table is validated before any block is decoded
        s = streams[info.name]
        stream = diff[s.frame_start : s.frame_end]
        try:
            w, blocks = parse_stream(stream, info.nbytes)
        except ProtocolError as e:
            return ProtocolError(f"tensor {_q(info.name)}: {e}")
        parsed.append((info, stream, w, blocks))
    adlers: list[list[int]] = [[1] * len(blocks) for *_, blocks in parsed]

    def one(batch: list[tuple[int, _PlanesBlock]]) -> Exception | None:
        # Returns its error instead of raising it (see bdn.proto.arc._apply).
        with lease() as cx:
            for ti, blk in batch:
                info, stream, w, _ = parsed[ti]
                lo, hi = info.start + blk.lo, info.start + blk.hi
                try:
                    adlers[ti][blk.index] = _decode_planes_block(cx, stream, blk, base[lo:hi], out[lo:hi], w)
                except ProtocolError as e:
                    return ProtocolError(f"tensor {_q(info.name)}: bdn_planes_v1 block {blk.index}: {e}")
        return None

    # Small blocks (small tensors) are grouped into tasks of >= _P_BATCH bytes: per-task overhead
    # and GIL hand-offs cost more than decoding a few KiB (MiniLM decoded slower on 2 threads
    # than on 1 before this). Tensors come largest first, so large blocks stay one task each.
    batches: list[list[tuple[int, _PlanesBlock]]] = []
    size = _P_BATCH
    for ti, (*_, blocks) in enumerate(parsed):
        for blk in blocks:
            if size >= _P_BATCH:
                batches.append([])
                size = 0
            batches[-1].append((ti, blk))
            size += blk.hi - blk.lo
    err = first_error(one, batches, map)
    if err is not None:
        return err
    for (info, _, _, blocks), block_adlers in zip(parsed, adlers):
        got = 1
        for blk, a in zip(blocks, block_adlers):
            got = adler32_combine(got, a, blk.hi - blk.lo)
        want = streams[info.name].target_adler32
        if got != want:
            return ChecksumError(f"adler32 mismatch for tensor {_q(info.name)}: expected {want}, got {got}")
    return None


def encode_tensors(
    pairs: list[tuple[str, np.ndarray, np.ndarray, int]], map: Map[Any, Any]
) -> tuple[dict[str, bytes], dict[str, str]]:
    # Blocks of all tensors and the tensors' Adler-32s are tasks of one map, as in decoding: a
    # single large tensor uses every core.
    """``bdn_planes_v1`` streams of many tensors at once: ``pairs`` are ``(name, base bytes,
    target bytes, element width)``; blocks of every tensor are tasks of one ``map`` (so one large
    tensor uses every core). Returns ``({name: stream}, {name: decimal Adler-32 of the target})``."""
    # Each task also takes the Adler-32 of its block of the target while the block is in cache;
    # a tensor's is the adler32_combine of its blocks' (one pass over the target, not two).
    widths = [_planes_width(len(b), w) for _, b, _, w in pairs]
    tasks = [(pi, blk) for pi, (_, b, t, _) in enumerate(pairs) for blk in _planes_blocks(b, t, widths[pi])]

    def one(task: tuple[int, tuple[np.ndarray, np.ndarray]]) -> tuple[int, int, tuple[int, int, int, bytes]]:
        pi, (bb, tb) = task
        with lease() as cx:
            coded = _encode_block(cx, bb, tb, widths[pi], ZSTD_LEVEL)
        return raw_adler32(tb.view(np.uint8)), tb.nbytes, coded

    done = map(one, tasks) if len(tasks) > 2 else serial_map(one, tasks)
    per: list[list[tuple[int, int, int, bytes]]] = [[] for _ in pairs]
    adlers = [1] * len(pairs)
    for (pi, _), (adler, nbytes, coded) in zip(tasks, done):
        per[pi].append(coded)
        adlers[pi] = adler32_combine(adlers[pi], adler, nbytes)
    streams = {name: _planes_assemble(len(b), widths[pi], per[pi]) for pi, (name, b, _, _) in enumerate(pairs)}
    return streams, {name: str(a) for (name, *_), a in zip(pairs, adlers)}
