"""The safetensors file format: a strict parser for untrusted headers and a deterministic writer.

Format (https://github.com/huggingface/safetensors, README "Format" and ``safetensors/src/tensor.rs``)::

    [0, 8)        N: unsigned 64-bit little-endian, the header length in bytes
    [8, 8+N)      the header: a UTF-8 JSON object, right-padded with spaces (0x20)
    [8+N, EOF)    the data buffer

The header maps each tensor name to ``{"dtype": str, "shape": [int, ...], "data_offsets": [begin,
end]}`` (``begin``/``end`` relative to the data buffer, ``end`` exclusive), plus an optional
``"__metadata__"`` object of string -> string. Tensor bytes are little-endian, C order. The spec
requires the data buffer to be covered exactly: tensors are contiguous, without gaps or overlaps,
and the last one ends at the end of the file.

bdn parses headers itself (rather than through ``safetensors.safe_open``) because it needs absolute
byte offsets to map tensors inside shared-memory files and diff files, and because the header comes
from a bucket or a peer: every rule is checked and every failure is one ``SafetensorsError`` line
that names the tensor.

Sub-byte dtypes (``F4``, ``F6_E2M3``, ``F6_E3M2``) are packed; their byte size is
``prod(shape) * bits / 8``, which must be a whole number. They parse and delta-compress like any
other tensor, but have no numpy view.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bdn.proto.errors import ProtocolError


class SafetensorsError(ProtocolError):
    """A safetensors file or header broke the format (message names the tensor where there is one)."""


# Layout rank: the reference writer (safetensors/src/tensor.rs, ``enum Dtype``) sorts tensors by
# descending position in this tuple, then by name. Keep the reference's order exactly.
DTYPE_ORDER: tuple[str, ...] = (
    "BOOL",
    "F4",
    "F6_E2M3",
    "F6_E3M2",
    "U8",
    "I8",
    "F8_E5M2",
    "F8_E4M3",
    "F8_E8M0",
    "F8_E4M3FNUZ",
    "F8_E5M2FNUZ",
    "I16",
    "U16",
    "F16",
    "BF16",
    "I32",
    "U32",
    "F32",
    "C64",
    "F64",
    "I64",
    "U64",
)
_DTYPE_RANK: dict[str, int] = {name: rank for rank, name in enumerate(DTYPE_ORDER)}

#: Bits per element of every dtype the spec defines (BOOL is stored as one byte).
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}
#: Bytes per element of every whole-byte dtype (the packed F4/F6 types are in ``DTYPE_BITS`` only).
DTYPE_SIZES: dict[str, int] = {k: v // 8 for k, v in DTYPE_BITS.items() if v % 8 == 0}

#: Largest header bdn accepts, in bytes: the reference's MAX_HEADER_SIZE (safetensors/src/tensor.rs),
#: 100,000,000 bytes (not 100 MiB); a longer header is refused there too.
MAX_HEADER_BYTES = 100_000_000
METADATA_KEY = "__metadata__"
_TENSOR_KEYS = frozenset(("dtype", "shape", "data_offsets"))
_NAME_IN_ERRORS = 120  # long or hostile names are cut in error lines


def _q(name: str) -> str:
    """Quote a name for a one-line error: repr() escapes newlines; very long names are cut."""
    text = repr(name)
    return text if len(text) <= _NAME_IN_ERRORS else text[:_NAME_IN_ERRORS] + "...'"


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file. ``start``/``end`` are ABSOLUTE file offsets, end exclusive."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data (``data_offsets`` end minus start)."""
        return self.end - self.start

    @property
    def numel(self) -> int:
        """Number of elements (the product of ``shape``; 1 for a scalar)."""
        return math.prod(self.shape)


@dataclass(frozen=True)
class Header:
    """A validated header. ``data_start`` = 8 + N; ``tensors`` iterates in data-offset order."""

    data_start: int
    metadata: dict[str, str]
    tensors: dict[str, TensorInfo] = field(default_factory=dict)

    @property
    def file_size(self) -> int:
        """Size in bytes of the whole file this header describes (it covers the buffer exactly)."""
        last = max((t.end for t in self.tensors.values()), default=self.data_start)
        return max(last, self.data_start)


def header_length(first8: bytes | bytearray | memoryview) -> int:
    """N, the header length in bytes, from the file's first 8 bytes (u64 little-endian).

    Raises SafetensorsError when fewer than 8 bytes are given or N exceeds ``MAX_HEADER_BYTES``.
    """
    if len(first8) < 8:
        raise SafetensorsError(f"safetensors file is {len(first8)} bytes, shorter than its 8-byte length prefix")
    (n,) = struct.unpack_from("<Q", first8, 0)
    if n > MAX_HEADER_BYTES:
        raise SafetensorsError(f"safetensors header length {n} exceeds the limit of {MAX_HEADER_BYTES} bytes")
    if n < 2:
        raise SafetensorsError(f"safetensors header length {n} is too short for a JSON object")
    return int(n)


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # Two parsers that pick different duplicates would see different files; refuse outright.
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise SafetensorsError(f"safetensors header repeats the key {_q(key)}")
        out[key] = value
    return out


def _is_uint(value: Any) -> bool:
    return type(value) is int and value >= 0  # bool is an int subclass: refuse it


def _copy_head(buf: Any, n: int) -> tuple[bytes, int]:
    """The first ``n`` bytes of ``buf`` as a copy, and the buffer's length in bytes.

    Copies so that no memoryview of the caller's buffer outlives this call, not even in an error's
    traceback: a live export would make the caller's ``mmap.close()`` raise BufferError.
    """
    with memoryview(buf) as mv:
        if mv.format == "B" and mv.ndim == 1:
            return bytes(mv[:n]), mv.nbytes
        with mv.cast("B") as flat:
            return bytes(flat[:n]), flat.nbytes


def parse_header(buf: bytes | bytearray | memoryview | Any, file_size: int) -> Header:
    """Validate and parse the header of a safetensors file of ``file_size`` bytes.

    ``buf`` is any buffer (bytes, mmap, memoryview, uint8 array) holding at least the first 8 + N
    bytes of the file. Checks: N bounds; the header is a UTF-8 JSON object without duplicate keys;
    every dtype is known; shapes are lists of non-negative ints; ``end - begin`` equals the
    tensor's byte size; tensors cover the data buffer exactly (no gap, no overlap, last one ends at
    ``file_size``); ``__metadata__`` is string -> string. Raises SafetensorsError (one line).
    """
    first8, available = _copy_head(buf, 8)
    n = header_length(first8)
    data_start = 8 + n
    if data_start > file_size:
        raise SafetensorsError(f"safetensors header length {n} runs past the end of the {file_size}-byte file")
    if available < data_start:
        raise SafetensorsError(f"buffer holds {available} bytes, less than the {data_start}-byte header")
    raw = _copy_head(buf, data_start)[0][8:]
    if raw[:1] != b"{":
        raise SafetensorsError("safetensors header does not start with '{'")
    try:
        text = raw.decode("utf-8")
        obj = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except SafetensorsError:
        raise
    except UnicodeDecodeError as e:
        raise SafetensorsError(f"safetensors header is not valid UTF-8 (byte {e.start})") from None
    except (ValueError, RecursionError) as e:
        raise SafetensorsError(f"safetensors header is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(obj, dict):
        raise SafetensorsError("safetensors header is not a JSON object")

    metadata: dict[str, str] = {}
    raw_meta = obj.pop(METADATA_KEY, None)
    if raw_meta is not None:
        if not isinstance(raw_meta, dict):
            raise SafetensorsError("safetensors __metadata__ is not a JSON object")
        for key, value in raw_meta.items():
            if not isinstance(value, str):
                raise SafetensorsError(f"safetensors __metadata__ value for {_q(key)} is not a string")
        metadata = dict(raw_meta)

    entries: list[tuple[int, int, str, str, tuple[int, ...]]] = []
    for name, entry in obj.items():
        if not isinstance(entry, dict):
            raise SafetensorsError(f"tensor {_q(name)}: entry is not a JSON object")
        if set(entry) != _TENSOR_KEYS:
            raise SafetensorsError(
                f"tensor {_q(name)}: entry must have exactly dtype, shape, data_offsets "
                f"(has {', '.join(_q(k) for k in sorted(map(str, entry)))[:200]})"
            )
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
            raise SafetensorsError(f"tensor {_q(name)}: unknown dtype {_q(str(dtype))}")
        if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
            raise SafetensorsError(f"tensor {_q(name)}: shape is not a list of non-negative integers")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(_is_uint(o) for o in offsets)
            or offsets[0] > offsets[1]
        ):
            raise SafetensorsError(f"tensor {_q(name)}: data_offsets is not [begin, end] with 0 <= begin <= end")
        bits = math.prod(shape) * DTYPE_BITS[dtype]
        if bits % 8:
            raise SafetensorsError(f"tensor {_q(name)}: {dtype} shape {shape} is not a whole number of bytes")
        if offsets[1] - offsets[0] != bits // 8:
            raise SafetensorsError(
                f"tensor {_q(name)}: data_offsets span {offsets[1] - offsets[0]} bytes, "
                f"but {dtype} shape {shape} needs {bits // 8}"
            )
        entries.append((offsets[0], offsets[1], name, dtype, tuple(shape)))

    # Sort by offsets (ties only between empty tensors: then by name, so the order is stable).
    entries.sort(key=lambda e: (e[0], e[1], e[2]))
    expected = 0
    tensors: dict[str, TensorInfo] = {}
    for begin, end, name, dtype, shape in entries:
        if begin != expected:
            what = "overlaps the previous tensor" if begin < expected else "leaves a gap before it"
            raise SafetensorsError(
                f"tensor {_q(name)}: starts at data offset {begin}, expected {expected} ({what}; "
                f"the format requires contiguous tensors)"
            )
        expected = end
        tensors[name] = TensorInfo(name, dtype, shape, data_start + begin, data_start + end)
    if data_start + expected != file_size:
        raise SafetensorsError(
            f"safetensors tensors end at byte {data_start + expected}, but the file is {file_size} bytes"
        )
    return Header(data_start=data_start, metadata=metadata, tensors=tensors)


def tensor_index(files: Mapping[str, Header] | Iterable[tuple[str, Header]]) -> dict[str, tuple[str, TensorInfo]]:
    """Where each tensor of a sharded checkpoint lives: ``{tensor name: (file path, TensorInfo)}``.

    ``files`` maps each ``*.safetensors`` file's path (as the snapshot names it) to its parsed
    header, in the snapshot's file order; the result keeps that order, then each header's. The one
    rule for a name found in two shards: refuse, as the safetensors/Hugging Face loaders do (a
    checkpoint must name each tensor once). Raises SafetensorsError("tensor 'x' is in both a and b").
    """
    index: dict[str, tuple[str, TensorInfo]] = {}
    for path, header in files.items() if isinstance(files, Mapping) else files:
        for name, info in header.tensors.items():
            if name in index:
                raise SafetensorsError(f"tensor {_q(name)} is in both {index[name][0]} and {path}")
            index[name] = (path, info)
    return index


def _numpy_dtypes() -> dict[str, np.dtype]:
    # ml_dtypes is imported here, on the first numpy view, not with this module: its import costs
    # ~0.8 s of CPU (5-8 s on a busy 2-core machine), and bdnd, bdnctl and bdn-publish never view a
    # tensor as numpy. A declared dependency, but numpy views must not break without it.
    try:
        import ml_dtypes as _ml_dtypes
    except ImportError:  # pragma: no cover - exercised only in stripped-down environments
        _ml_dtypes = None  # type: ignore[assignment]  # the module, or None without it
    table: dict[str, np.dtype] = {
        "BOOL": np.dtype(np.bool_),
        "U8": np.dtype("u1"),
        "I8": np.dtype("i1"),
        "I16": np.dtype("<i2"),
        "U16": np.dtype("<u2"),
        "F16": np.dtype("<f2"),
        "I32": np.dtype("<i4"),
        "U32": np.dtype("<u4"),
        "F32": np.dtype("<f4"),
        "C64": np.dtype("<c8"),
        "F64": np.dtype("<f8"),
        "I64": np.dtype("<i8"),
        "U64": np.dtype("<u8"),
    }
    if _ml_dtypes is not None:
        table["BF16"] = np.dtype(_ml_dtypes.bfloat16)
        for st_name, ml_name in (
            ("F8_E5M2", "float8_e5m2"),
            ("F8_E4M3", "float8_e4m3fn"),
            ("F8_E8M0", "float8_e8m0fnu"),
            ("F8_E4M3FNUZ", "float8_e4m3fnuz"),
            ("F8_E5M2FNUZ", "float8_e5m2fnuz"),
        ):
            ml_type = getattr(_ml_dtypes, ml_name, None)
            table[st_name] = np.dtype(ml_type) if ml_type is not None else np.dtype("u1")
    else:  # raw bit patterns: same size, so views and deltas still line up
        table["BF16"] = np.dtype("<u2")
        for st_name in ("F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ"):
            table[st_name] = np.dtype("u1")
    return table


_NUMPY_DTYPES: dict[str, np.dtype] = {}  # filled by _tables() on first use
# numpy dtype name -> safetensors name, for the writer. Insertion order makes the integer names win
# when ml_dtypes is missing and BF16/F8 fall back to uint views.
_FROM_NUMPY: dict[str, str] = {}


def _tables() -> tuple[dict[str, np.dtype], dict[str, str]]:
    """(safetensors name -> numpy dtype, numpy dtype name -> safetensors name), built once.

    Two threads building them at once build the same tables; ``_NUMPY_DTYPES`` is filled last, so
    a caller that sees it filled sees ``_FROM_NUMPY`` filled too.
    """
    if not _NUMPY_DTYPES:
        table = _numpy_dtypes()
        from_numpy: dict[str, str] = {}
        for st, dt in table.items():
            from_numpy.setdefault(dt.name, st)
        _FROM_NUMPY.update(from_numpy)
        _NUMPY_DTYPES.update(table)
    return _NUMPY_DTYPES, _FROM_NUMPY


def numpy_dtype(dtype: str) -> np.dtype:
    """The numpy dtype of a safetensors dtype name (little-endian).

    BF16 and the F8 types map to ml_dtypes types (raw uint16/uint8 when ml_dtypes is missing).
    Raises SafetensorsError for unknown names and for the packed sub-byte types (F4, F6_*).
    """
    table, _ = _tables()
    if dtype in table:
        return table[dtype]
    if dtype in DTYPE_BITS:
        raise SafetensorsError(f"dtype {dtype} is packed below one byte per element and has no numpy view")
    raise SafetensorsError(f"unknown safetensors dtype {_q(str(dtype))}")


def tensor_view(buf: Any, info: TensorInfo) -> np.ndarray:
    """Zero-copy numpy view of one tensor over ``buf`` (bytes, mmap, memoryview, ...) of the whole file.

    Shape ``info.shape``, dtype ``numpy_dtype(info.dtype)``; writable iff ``buf`` is. Raises
    SafetensorsError when the buffer is too short or the dtype has no numpy view.
    """
    dt = numpy_dtype(info.dtype)
    try:
        flat = np.frombuffer(buf, dtype=np.uint8, count=info.nbytes, offset=info.start)
    except ValueError:
        raise SafetensorsError(
            f"tensor {_q(info.name)}: bytes [{info.start}, {info.end}) lie outside the buffer"
        ) from None
    return flat.view(dt).reshape(info.shape)


def safetensors_dtype(array: np.ndarray) -> str:
    """The safetensors dtype name of a numpy array's dtype; SafetensorsError if it has none."""
    try:
        return _tables()[1][array.dtype.name]
    except KeyError:
        raise SafetensorsError(f"numpy dtype {array.dtype} has no safetensors equivalent") from None


def _json_str(s: str) -> str:
    # serde_json and json.dumps(ensure_ascii=False) escape the same set (", \, control chars with
    # lowercase \u00xx) and leave non-ASCII as raw UTF-8, so headers match the reference writer.
    return json.dumps(s, ensure_ascii=False)


def serialize_header(
    tensors: Mapping[str, tuple[str, tuple[int, ...], int]], metadata: Mapping[str, str] | None
) -> tuple[bytes, list[str]]:
    """Build the 8-byte prefix plus padded header for ``{name: (dtype, shape, nbytes)}``.

    Returns (prefix_and_header, names in data order). Layout is the reference writer's: tensors
    sorted by descending dtype rank then name, compact JSON with ``__metadata__`` first, padded with
    spaces to a multiple of 8 bytes. Metadata keys are sorted (the reference uses a hash map, so its
    order is arbitrary; sorting makes bdn's output deterministic).

    Raises SafetensorsError for metadata that is not ``str -> str``; ``dtype`` must be one of
    the format's dtype names (KeyError otherwise: callers pass dtypes they have validated).
    """
    order = sorted(tensors, key=lambda name: (-_DTYPE_RANK[tensors[name][0]], name))
    parts: list[str] = []
    if metadata is not None:
        for key, value in metadata.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise SafetensorsError(f"metadata must map str to str (key {_q(str(key))})")
        items = ",".join(f"{_json_str(k)}:{_json_str(metadata[k])}" for k in sorted(metadata))
        parts.append(f'"{METADATA_KEY}":{{{items}}}')
    offset = 0
    for name in order:
        dtype, shape, nbytes = tensors[name]
        shape_text = ",".join(str(int(d)) for d in shape)
        parts.append(
            f'{_json_str(name)}:{{"dtype":"{dtype}","shape":[{shape_text}],'
            f'"data_offsets":[{offset},{offset + nbytes}]}}'
        )
        offset += nbytes
    header = ("{" + ",".join(parts) + "}").encode("utf-8")
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header, order


def encode_raw(
    tensors: Mapping[str, tuple[str, tuple[int, ...], Any]],
    metadata: Mapping[str, str] | None = None,
) -> tuple[bytes, list[memoryview]]:
    """A safetensors file from raw little-endian bytes ``{name: (dtype, shape, buffer)}``.

    Returns ``(prefix, parts)``: the file is ``prefix`` (8-byte length and padded header) followed
    by ``parts`` in order (zero-copy views of the given buffers). Each buffer is any C-contiguous
    buffer object whose length matches dtype and shape. Raises SafetensorsError for an invalid
    name, an unknown dtype or a size mismatch. ``bdn.fileops.save_raw`` writes it to a file.
    """
    sizes: dict[str, tuple[str, tuple[int, ...], int]] = {}
    views: dict[str, memoryview] = {}
    for name, (dtype, shape, data) in tensors.items():
        if not isinstance(name, str) or name == METADATA_KEY:
            raise SafetensorsError(f"invalid tensor name {_q(str(name))}")
        if dtype not in DTYPE_BITS:
            raise SafetensorsError(f"tensor {_q(name)}: unknown dtype {_q(str(dtype))}")
        mv = (
            memoryview(data).cast("B")
            if not isinstance(data, np.ndarray)
            else memoryview(data.reshape(-1).view(np.uint8))  # type: ignore[arg-type]  # numpy's stubs: __buffer__ from 3.12
        )
        bits = math.prod(shape) * DTYPE_BITS[dtype]
        if bits % 8 or bits // 8 != mv.nbytes:
            raise SafetensorsError(f"tensor {_q(name)}: {mv.nbytes} bytes do not match {dtype} shape {list(shape)}")
        sizes[name] = (dtype, tuple(int(d) for d in shape), mv.nbytes)
        views[name] = mv
    prefix, order = serialize_header(sizes, metadata)
    return prefix, [views[name] for name in order]


def raw_tensors(tensors: Mapping[str, np.ndarray]) -> dict[str, tuple[str, tuple[int, ...], Any]]:
    """numpy arrays (ml_dtypes bfloat16/float8 included) as ``encode_raw``'s ``{name: (dtype, shape, buffer)}``.

    Big-endian arrays are converted to little-endian and non-contiguous ones copied; others are
    not copied. Raises SafetensorsError for dtypes safetensors cannot store.

    ``bdn.fileops.save`` writes these: byte-identical to ``safetensors.numpy.save_file`` whenever
    that is deterministic (at most one metadata key). bdn writes its own file instead of calling it
    because the reference serialises ``__metadata__`` from a hash map: with two or more keys, two
    saves of the same checkpoint can order them differently, which would change content digests
    and make a base and a target that should share a header differ (the arc formats rebuild the
    target with the base's header).
    """
    raw: dict[str, tuple[str, tuple[int, ...], Any]] = {}
    for name, array in tensors.items():
        arr = np.asarray(array)
        dtype = safetensors_dtype(arr)
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        arr = np.ascontiguousarray(arr)
        raw[name] = (dtype, tuple(arr.shape), arr)
    return raw


# File-level functions that lived here until bdn/proto became I/O-free (bdn.fileops now).
