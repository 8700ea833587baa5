"""Delta formats: ``arc_v1`` / ``arc_v2`` of the hosted hot-load APIs, and bdn's ``bdn_planes_v1``.

All three store, per tensor, a compressed form of ``base_bytes XOR target_bytes`` in a diff file
laid out the same way (below); only the per-tensor stream differs.

Source: the ``fireworks-delta-compression`` package (PyPI 0.1.0, MIT; ``backends/arc2.py`` and
``compression.py``), which is what the hot-load services run. What bdn learned from reading it:

* A **diff file** is an ordinary safetensors file with exactly the tensor names of the checkpoint
  shard it patches. Each of its tensors is a 1-D ``U8`` array whose bytes are one compressed
  stream of ``base_bytes XOR target_bytes`` (the raw little-endian bytes of that tensor; equal
  length because shape and dtype must match). ``arc_v2`` compresses with zstd (the ``zstd``
  binding's ``compress(data)``: level 3, one frame, content size in the frame header); ``arc_v1``
  with zlib (``zlib.compress(data)``: level 6, zlib wrapper). Empty tensors still get a frame (of
  zero bytes).
* Its ``__metadata__`` maps every tensor name to ``str(zlib.adler32(target tensor bytes))``, an
  unsigned decimal (``checksum_format: "alder32"``, misspelled as the APIs spell it). Nothing else
  is in it. They write the file with ``safetensors.torch.save_file``, so the layout is the reference
  one: tensors sorted by name (all ``U8``), header padded to 8 bytes; their metadata key order is
  arbitrary (a hash map), bdn sorts it.
* **Applying** (``delta_decompress_inplace``) mmaps the base shard and XORs each decompressed
  stream into the tensor's bytes in place, then checks each tensor's Adler-32. The reconstructed
  file therefore is the **base file's bytes with tensor data replaced**: its header (tensor order,
  offsets, ``__metadata__``, padding) is the base's header, byte for byte. A decompressed stream
  whose length differs from the base tensor's is refused. (Their other entry point,
  ``decompress_delta_into_source``, re-saves through ``save_file`` and drops ``__metadata__``;
  bdn follows the in-place rule, the only one that rebuilds a file byte-identical to the target.)
* Their zstd decoder requires the content size in the frame header, so bdn always writes it. Their
  decoders accept concatenated frames (zstd) and ignore bytes after a zlib stream; bdn accepts the
  former and refuses trailing garbage in both.

Hence bdn's rules:

* ``encode_diff`` (``bdn.fileops.write_diff_file``) refuses (``TensorMismatch``, naming the tensor or the field) a target whose
  header bytes differ from the base's in any way: other tensor names, dtype, shape, layout,
  ``__metadata__`` or JSON formatting. Such a pair must be published as a full snapshot.
* ``apply_diff`` writes the base's header bytes, then ``base XOR stream`` for every tensor, and
  checks the Adler-32 of each reconstructed tensor against the diff's metadata (``ChecksumError``).
  A malformed diff file or stream is a ``ProtocolError``; streams are decoded with their output
  bounded to the base tensor's size, so a small hostile frame cannot expand without limit.

``bdn_planes_v1``, bdn's own format, uses the same diff file with another per-tensor stream: its
layout and codec are :mod:`bdn.proto.planes`. The diff-file container is :mod:`bdn.proto.diff_file`,
the per-task state the codecs share :mod:`bdn.proto.delta_tasks`, the zstd and zlib streams of
``arc_v2`` and ``arc_v1`` :mod:`bdn.proto.arc_streams`; this module is the entry point
for all three formats (its names are the ones callers import).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from bdn.proto import arc_streams, planes
from bdn.proto.delta_tasks import (
    ZLIB_LEVEL,
    ZSTD_LEVEL,
    Ctx,
    Map,
    adler32,
    adler32_combine,
    bytes_of,
    first_error,
    lease,
    raw_adler32,
    serial_map,
)
from bdn.proto.diff_file import (
    DiffContent,
    DiffHeaderLike,
    DiffTensor,
    check_names,
    content,
    diff_tensors,
    read_diff_header,
    streams_of,
    target_size,
)
from bdn.proto.errors import ChecksumError, ProtocolError, TensorMismatch, UnsupportedFormat
from bdn.proto.safetensors_fmt import (
    DTYPE_SIZES,
    Header,
    TensorInfo,
    _q,
    parse_header,
    safetensors_dtype,
)

__all__ = [
    "CHECKSUM_FORMATS",
    "COMPRESSION_FORMATS",
    "DEFAULT_COMPRESSION",
    "ZLIB_LEVEL",
    "ZSTD_LEVEL",
    "DiffContent",
    "DiffHeaderLike",
    "DiffTensor",
    "Map",
    "adler32",
    "adler32_combine",
    "apply_diff",
    "check_formats",
    "decode_xor_into",
    "diff_tensors",
    "encode_diff",
    "encode_diff_arrays",
    "encode_xor",
    "read_diff_header",
    "serial_map",
    "target_size",
]

COMPRESSION_FORMATS: tuple[str, ...] = ("arc_v1", "arc_v2", "bdn_planes_v1")
DEFAULT_COMPRESSION = "arc_v2"
CHECKSUM_FORMATS: tuple[str, ...] = ("alder32",)


def _normalize_format(compression_format: Any) -> str:
    # The reference lower-cases the name before lookup; accept what it accepts.
    fmt = compression_format.lower() if isinstance(compression_format, str) else compression_format
    if fmt not in COMPRESSION_FORMATS:
        raise UnsupportedFormat(
            f"unsupported compression_format {compression_format!r}: bdn supports {', '.join(COMPRESSION_FORMATS)}"
        )
    return fmt


def check_formats(compression_format: str, checksum_format: str | None = "alder32") -> None:
    """Raise UnsupportedFormat unless both formats are ones bdn implements.

    ``compression_format`` is matched case-insensitively (as the reference does); ``checksum_format``
    may be None (absent from a request: the formats always carry Adler-32).
    """
    _normalize_format(compression_format)
    if checksum_format is not None and checksum_format not in CHECKSUM_FORMATS:
        raise UnsupportedFormat(
            f"unsupported checksum_format {checksum_format!r}: bdn supports {', '.join(CHECKSUM_FORMATS)}"
        )


def encode_xor(
    base: Any,
    target: Any,
    compression_format: str = DEFAULT_COMPRESSION,
    level: int | None = None,
    *,
    width: int | None = None,
) -> bytes:
    """One compressed stream of ``base XOR target`` (equal-length byte buffers or arrays).

    ``arc_v2``: one zstd frame with its content size (level ``ZSTD_LEVEL`` unless given);
    ``arc_v1``: one zlib stream (level ``ZLIB_LEVEL`` unless given); ``bdn_planes_v1``: one planes
    stream (module docstring) with elements of ``width`` bytes (default: ``base``'s itemsize when it
    is an ndarray, else 1). The XOR is computed in pieces, so memory beyond the output stays
    bounded. Raises TensorMismatch when the lengths differ, UnsupportedFormat for other formats.
    """
    fmt = _normalize_format(compression_format)
    b, t = bytes_of(base), bytes_of(target)
    if len(b) != len(t):
        raise TensorMismatch(f"base has {len(b)} bytes, target has {len(t)}")
    if fmt == "bdn_planes_v1":
        if width is None and isinstance(base, np.ndarray):
            width = base.dtype.itemsize
        with lease() as cx:
            return planes.encode_stream(cx, b, t, width, ZSTD_LEVEL if level is None else level)
    with lease() as cx:
        return arc_streams.encode(cx, b, t, fmt, level)


def decode_xor_into(frame: Any, base: Any, out: Any, compression_format: str) -> None:
    """``out[:] = base XOR decompress(frame)``, writing straight into ``out``.

    ``frame`` is any buffer (e.g. a memoryview of a mapped diff file); ``base`` and ``out`` are
    byte buffers or arrays of equal byte length; ``out`` must be writable and may be ``base``
    itself (in-place apply). The stream must decompress to exactly ``len(base)`` bytes: output is
    produced in bounded pieces (:mod:`bdn.proto.arc_streams`) and decoding stops one byte past the expected size,
    so a hostile frame cannot expand further. Raises ProtocolError for a corrupt, short, oversized
    or trailing-garbage stream, UnsupportedFormat for other formats, ValueError for a caller's
    size mismatch or a read-only ``out``.
    """
    fmt = _normalize_format(compression_format)
    try:
        with lease() as cx:
            _decode(cx, frame, base, out, fmt)
    except (ProtocolError, ValueError) as e:
        err = type(e)(str(e))
    else:
        return
    # Raised afresh, outside the frames holding numpy views of the caller's buffers (see apply_diff).
    raise err


def _decode(cx: Ctx, frame: Any, base: Any, out: Any, fmt: str) -> int:
    """Decode into ``out``; return the Adler-32 of the bytes written (computed piece by piece)."""
    b, o = bytes_of(base), bytes_of(out)
    if len(b) != len(o):
        raise ValueError(f"out has {len(o)} bytes, base has {len(b)}")
    if not o.flags.writeable:
        raise ValueError("out is read-only")
    n = len(b)
    if fmt == "arc_v2":
        return arc_streams.decode_zstd(cx, frame, b, o, n)
    if fmt == "bdn_planes_v1":
        return planes.decode_stream(cx, frame, b, o, n)
    return arc_streams.decode_zlib(frame, b, o, n)


def apply_diff(
    base_buf: Any,
    base_header: Header,
    diff_buf: Any,
    diff_header: DiffHeaderLike,
    out_buf: Any,
    compression_format: str,
    *,
    map: Map[Any, Any] = serial_map,
) -> None:
    """Rebuild the target file into ``out_buf`` (writable, ``target_size`` bytes).

    ``out_buf`` is either ``base_buf`` itself (in-place, like the reference's mmap apply) or a
    buffer that does not overlap it; ``base_buf`` must not change while this runs.

    Writes the base's header bytes, then every tensor as ``base XOR stream``, and checks each
    rebuilt tensor's Adler-32 against the diff's metadata. ``diff_header`` is what
    ``read_diff_header`` returns (or just its Header). Tensors (for ``bdn_planes_v1``: blocks) are
    independent tasks, largest first, run through ``map`` (serially by default; zstandard, zlib
    and numpy release the GIL, so ``bdn.fileops.thread_map(n)`` decodes on ``n`` cores). Raises
    ChecksumError("adler32 mismatch for tensor 'x': expected E, got G"), ProtocolError for a
    malformed diff (naming the tensor), UnsupportedFormat, ValueError for a wrong-sized ``out_buf``.
    On error ``out_buf`` holds partial data.
    """
    fmt = _normalize_format(compression_format)
    streams = streams_of(diff_header)
    check_names(base_header, streams)
    try:
        err = _apply(base_buf, base_header, diff_buf, streams, out_buf, fmt, map)
    except (ProtocolError, ValueError) as e:
        err = type(e)(str(e))
    # Errors are raised afresh here, never from the frames that hold numpy views of the caller's
    # buffers: a traceback keeping those views alive would make the caller's mmap.close() fail.
    if err is not None:
        raise err


def _apply(
    base_buf: Any,
    base_header: Header,
    diff_buf: Any,
    streams: Mapping[str, DiffTensor],
    out_buf: Any,
    fmt: str,
    map: Map[Any, Any],
) -> Exception | None:
    size = base_header.file_size
    base, diff, out = bytes_of(base_buf), bytes_of(diff_buf), bytes_of(out_buf)
    if len(out) != size:
        raise ValueError(f"out_buf has {len(out)} bytes, the target is {size}")
    if len(base) < size:
        raise ProtocolError(f"base buffer has {len(base)} bytes, its header describes {size}")
    if not out.flags.writeable:
        raise ValueError("out_buf is read-only")
    for s in streams.values():
        if s.frame_end > len(diff):
            raise ProtocolError(f"diff stream for tensor {_q(s.name)} lies past the end of the diff buffer")
    if out.ctypes.data != base.ctypes.data:  # in-place apply: the header is already there
        out[: base_header.data_start] = base[: base_header.data_start]
    infos = sorted(base_header.tensors.values(), key=lambda t: t.nbytes, reverse=True)
    if fmt == "bdn_planes_v1":
        return planes.apply_tensors(base, diff, streams, out, infos, map)

    def one(info: TensorInfo) -> Exception | None:
        # Returns its error instead of raising it: a Future holding a raised exception forms a
        # reference cycle with this frame, which would pin the buffer views until the next gc.
        s = streams[info.name]
        region = out[info.start : info.end]
        try:
            with lease() as cx:
                got = _decode(cx, diff[s.frame_start : s.frame_end], base[info.start : info.end], region, fmt)
        except ProtocolError as e:
            return type(e)(f"tensor {_q(info.name)}: {e}")
        if got != s.target_adler32:
            return ChecksumError(f"adler32 mismatch for tensor {_q(info.name)}: expected {s.target_adler32}, got {got}")
        return None

    return first_error(one, infos, map)


def _encode_all(
    pairs: list[tuple[str, np.ndarray, np.ndarray, int]], fmt: str, map: Map[Any, Any]
) -> tuple[dict[str, bytes], dict[str, str]]:
    """Encode ``(name, base bytes, target bytes, element width)`` pairs; (streams, Adler-32 decimals)."""
    if fmt == "bdn_planes_v1":
        return planes.encode_tensors(pairs, map)

    def one(item: tuple[str, np.ndarray, np.ndarray, int]) -> tuple[str, bytes, str]:
        name, b, t, _ = item
        return name, encode_xor(b, t, fmt), str(raw_adler32(t))

    results = map(one, pairs) if len(pairs) > 1 else serial_map(one, pairs)
    return {n: f for n, f, _ in results}, {n: c for n, _, c in results}


def _first_difference(base: list[str] | set[str], target: list[str] | set[str]) -> str:
    missing = sorted(set(base) - set(target))
    if missing:
        return f"tensor {_q(missing[0])} is in the base but not in the target"
    extra = sorted(set(target) - set(base))
    return f"tensor {_q(extra[0])} is in the target but not in the base"


def encode_diff(
    base_buf: Any,
    target_buf: Any,
    compression_format: str = DEFAULT_COMPRESSION,
    *,
    map: Map[Any, Any] = serial_map,
) -> DiffContent:
    """The diff file that turns the safetensors file bytes ``base_buf`` into ``target_buf``.

    Both are whole files in memory (bytes, mmap, uint8 array). The target's header bytes must
    equal the base's (see the module docstring): otherwise TensorMismatch names the first tensor,
    or the field, that differs. Returns :data:`DiffContent`: the same tensor names, each a 1-D U8
    stream of base XOR target, and ``__metadata__`` {name: decimal Adler-32 of the target
    tensor}. Tensors (blocks) are encoded through ``map``. Raises SafetensorsError for malformed
    inputs, UnsupportedFormat.
    """
    fmt = _normalize_format(compression_format)
    base, target = bytes_of(base_buf), bytes_of(target_buf)
    bh, th = parse_header(base, len(base)), parse_header(target, len(target))
    if set(bh.tensors) != set(th.tensors):
        raise TensorMismatch(_first_difference(list(bh.tensors), list(th.tensors)))
    for name, b in bh.tensors.items():
        t = th.tensors[name]
        if b.dtype != t.dtype:
            raise TensorMismatch(f"tensor {_q(name)}: dtype {b.dtype} in the base, {t.dtype} in the target")
        if b.shape != t.shape:
            raise TensorMismatch(f"tensor {_q(name)}: shape {list(b.shape)} in the base, {list(t.shape)} in the target")
    for name, b in bh.tensors.items():
        if (b.start, b.end) != (th.tensors[name].start, th.tensors[name].end):
            raise TensorMismatch(
                f"tensor {_q(name)}: stored at a different offset in the target; the arc formats rebuild the "
                f"target with the base's header, so base and target must share one layout"
            )
    if bh.metadata != th.metadata:
        keys = sorted(k for k in set(bh.metadata) | set(th.metadata) if bh.metadata.get(k) != th.metadata.get(k))
        raise TensorMismatch(
            f"__metadata__ differs between base and target (key {_q(keys[0])}); the arc formats rebuild the "
            f"target with the base's header, so publish a full snapshot or keep __metadata__ unchanged"
        )
    if bytes(base[: bh.data_start]) != bytes(target[: th.data_start]):
        raise TensorMismatch(
            "base and target headers differ in their bytes (JSON formatting or order); the arc formats rebuild "
            "the target with the base's header"
        )
    # Element width for bdn_planes_v1: bytes per element (the arc formats ignore it).
    pairs = [
        (name, base[i.start : i.end], target[i.start : i.end], DTYPE_SIZES.get(i.dtype, 1))
        for name, i in bh.tensors.items()
    ]
    return content(*_encode_all(pairs, fmt, map))


def encode_diff_arrays(
    base: Mapping[str, np.ndarray],
    target: Mapping[str, np.ndarray],
    compression_format: str = DEFAULT_COMPRESSION,
    *,
    map: Map[Any, Any] = serial_map,
) -> DiffContent:
    """``encode_diff`` for in-memory state dicts ``{name: array}`` (ml_dtypes arrays included).

    The base and target files are assumed to be written by ``bdn.fileops.save`` with the same
    metadata, so equal names, dtypes and shapes give equal headers. Raises TensorMismatch naming the
    first tensor that differs in name, dtype or shape.
    """
    fmt = _normalize_format(compression_format)
    if set(base) != set(target):
        raise TensorMismatch(_first_difference(set(base), set(target)))
    pairs: list[tuple[str, np.ndarray, np.ndarray, int]] = []
    for name in sorted(base):
        b, t = np.asarray(base[name]), np.asarray(target[name])
        bd, td = safetensors_dtype(b), safetensors_dtype(t)
        if bd != td:
            raise TensorMismatch(f"tensor {_q(name)}: dtype {bd} in the base, {td} in the target")
        if b.shape != t.shape:
            raise TensorMismatch(f"tensor {_q(name)}: shape {list(b.shape)} in the base, {list(t.shape)} in the target")
        # File bytes are little-endian; XOR what the files would hold.
        if b.dtype.byteorder == ">":
            b = b.astype(b.dtype.newbyteorder("<"))
        if t.dtype.byteorder == ">":
            t = t.astype(t.dtype.newbyteorder("<"))
        pairs.append((name, bytes_of(b), bytes_of(t), b.dtype.itemsize))
    return content(*_encode_all(pairs, fmt, map))


# File-level entry points that lived here until bdn/proto became I/O-free (bdn.fileops now).
