"""bdn.proto.safetensors_fmt against the reference safetensors library and against hostile headers."""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy as stnp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bdn import fileops
from bdn.proto import safetensors_fmt as sf
from bdn.proto.errors import ProtocolError
from bdn.proto.safetensors_fmt import SafetensorsError


def _sample() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        "model.embed.weight": rng.standard_normal((16, 8)).astype(ml_dtypes.bfloat16),
        "layers.0.w": rng.standard_normal((4, 5)).astype(np.float32),
        "layers.0.b": rng.standard_normal(5).astype(np.float16),
        "scale": rng.standard_normal(3).astype(ml_dtypes.float8_e4m3fn),
        "ids": np.arange(6, dtype=np.int64).reshape(2, 3),
        "mask": np.array([True, False, True]),
        "u": np.arange(4, dtype=np.uint8),
        "empty": np.zeros((0, 4), dtype=np.float32),
        'névé "q"\n': np.ones(2, dtype=np.int32),
    }


def _raw(header: object, data: bytes = b"", pad: bool = True) -> bytes:
    text = (header if isinstance(header, str) else json.dumps(header)).encode()
    if pad:
        text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def _parse(blob: bytes) -> sf.Header:
    return sf.parse_header(blob, len(blob))


def test_save_is_byte_identical_to_reference(tmp_path: Path) -> None:
    tensors = _sample()
    for meta in (None, {}, {"format": "pt"}):
        ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
        fileops.save(ours, tensors, meta)
        stnp.save_file(tensors, theirs, metadata=meta)
        assert ours.read_bytes() == theirs.read_bytes()


def test_round_trip_through_reference_reader(tmp_path: Path) -> None:
    tensors = _sample()
    path = tmp_path / "m.safetensors"
    fileops.save(path, tensors, {"format": "pt", "step": "12", "a": "x"})
    header = fileops.read_header(path)
    assert header.metadata == {"format": "pt", "step": "12", "a": "x"}
    data = path.read_bytes()
    with safetensors.safe_open(path, framework="numpy") as f:
        assert f.metadata() == header.metadata
        assert set(f.keys()) == set(tensors)
        for name, info in header.tensors.items():
            view = sf.tensor_view(data, info)
            assert view.dtype == tensors[name].dtype and view.shape == tensors[name].shape
            assert view.tobytes() == tensors[name].tobytes()
            if info.dtype not in ("BF16", "F8_E4M3"):  # the reference numpy loader lacks ml_dtypes
                np.testing.assert_array_equal(f.get_tensor(name), tensors[name])
    # offsets are absolute, in data order, covering the buffer exactly
    infos = list(header.tensors.values())
    assert infos[0].start == header.data_start and infos[-1].end == len(data) == header.file_size
    assert all(a.end == b.start for a, b in zip(infos, infos[1:]))


def test_parses_reference_written_file(tmp_path: Path) -> None:
    tensors = _sample()
    path = tmp_path / "ref.safetensors"
    stnp.save_file(tensors, path, metadata={"format": "np"})
    header = fileops.read_header(path)
    assert header.metadata == {"format": "np"}
    data = path.read_bytes()
    for name, info in header.tensors.items():
        assert sf.tensor_view(data, info).tobytes() == tensors[name].tobytes()


def test_metadata_order_is_deterministic(tmp_path: Path) -> None:
    meta = {k: str(i) for i, k in enumerate("zyxwvutsrq")}
    fileops.save(tmp_path / "a", {"x": np.zeros(3, np.float32)}, meta)
    fileops.save(tmp_path / "b", {"x": np.zeros(3, np.float32)}, dict(reversed(list(meta.items()))))
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes()


def test_tensor_view_is_zero_copy_over_mmap(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    fileops.save(path, {"w": np.arange(12, dtype=np.float32).reshape(3, 4)})
    header = fileops.read_header(path)
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
        view = sf.tensor_view(mm, header.tensors["w"])
        view[1, 1] = 42.0
        assert struct.unpack_from("<f", mm, header.tensors["w"].start + 5 * 4)[0] == 42.0
        del view
    assert sf.tensor_view(path.read_bytes(), header.tensors["w"])[1, 1] == 42.0


def test_numpy_dtypes() -> None:
    assert sf.numpy_dtype("BF16") == np.dtype(ml_dtypes.bfloat16)
    assert sf.numpy_dtype("F8_E5M2") == np.dtype(ml_dtypes.float8_e5m2)
    assert sf.numpy_dtype("F32") == np.dtype("<f4")
    with pytest.raises(SafetensorsError, match="packed"):
        sf.numpy_dtype("F4")
    with pytest.raises(SafetensorsError, match="unknown"):
        sf.numpy_dtype("F128")
    assert sf.DTYPE_SIZES["BF16"] == 2 and "F4" not in sf.DTYPE_SIZES and sf.DTYPE_BITS["F4"] == 4


def test_packed_dtype_parses() -> None:
    blob = _raw({"q": {"dtype": "F4", "shape": [2, 3], "data_offsets": [0, 3]}}, b"\x01\x02\x03")
    assert _parse(blob).tensors["q"].nbytes == 3
    odd = _raw({"q": {"dtype": "F4", "shape": [3], "data_offsets": [0, 1]}}, b"\x01")
    with pytest.raises(SafetensorsError, match="whole number of bytes"):
        _parse(odd)


def test_save_refuses_unstorable_dtype(tmp_path: Path) -> None:
    with pytest.raises(SafetensorsError, match="no safetensors equivalent"):
        fileops.save(tmp_path / "x", {"s": np.array(["a"], dtype=object)})


def test_error_is_a_protocol_error() -> None:
    assert issubclass(SafetensorsError, ProtocolError)


GOOD = {
    "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
    "b": {"dtype": "U8", "shape": [2], "data_offsets": [8, 10]},
}


@pytest.mark.parametrize(
    ("blob", "needle"),
    [
        (b"\x01\x00", "shorter than its 8-byte"),
        (struct.pack("<Q", sf.MAX_HEADER_BYTES + 1) + b"{}", "exceeds the limit"),
        (struct.pack("<Q", 64) + b"{}", "runs past the end"),
        (_raw("[1, 2]"), "does not start with"),
        (_raw('{"a": 1'), "not valid JSON"),
        (struct.pack("<Q", 8) + b'{"\xff": 1}', "not valid UTF-8"),
        (_raw("{" + '"a":' * 1 + "[" * 100000 + "]" * 100000 + "}"), "not valid JSON"),
        (
            _raw(
                '{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}',
                b"\0" * 4,
            ),
            "repeats the key 'a'",
        ),
        (_raw({"a": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4), "tensor 'a': unknown dtype"),
        (_raw({"a": {"dtype": "F32", "shape": [1.0], "data_offsets": [0, 4]}}, b"\0" * 4), "tensor 'a': shape"),
        (_raw({"a": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, b"\0" * 4), "tensor 'a': shape"),
        (_raw({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4), "tensor 'a': shape"),
        (
            _raw({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4),
            "tensor 'a': data_offsets span 4",
        ),
        (_raw({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, b"\0" * 4), "tensor 'a': data_offsets"),
        (
            _raw({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": 1}}, b"\0" * 4),
            "tensor 'a': entry must",
        ),
        (_raw({"a": [1]}, b""), "tensor 'a': entry is not"),
        (
            _raw({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8),
            "tensor 'a': starts at data offset 4, expected 0",
        ),
        (_raw({**GOOD, "c": {"dtype": "U8", "shape": [2], "data_offsets": [6, 8]}}, b"\0" * 10), "overlaps"),
        (_raw(GOOD, b"\0" * 11), "file is"),
        (_raw(GOOD, b"\0" * 9), "runs past|file is"),
        (_raw({"__metadata__": {"k": 1}, **GOOD}, b"\0" * 10), "value for 'k' is not a string"),
        (_raw({"__metadata__": [1], **GOOD}, b"\0" * 10), "__metadata__ is not"),
        (_raw({"a": {"dtype": "F32", "shape": [10**30], "data_offsets": [0, 4]}}, b"\0" * 4), "tensor 'a'"),
    ],
)
def test_rejects_malformed_headers(blob: bytes, needle: str) -> None:
    with pytest.raises(SafetensorsError, match=needle) as info:
        _parse(blob)
    assert "\n" not in str(info.value)


def test_accepts_null_metadata_and_empty_file() -> None:
    assert _parse(_raw('{"__metadata__": null}')).tensors == {}
    assert _parse(_raw({})).file_size == 16


def test_read_header_of_tiny_file(tmp_path: Path) -> None:
    (tmp_path / "t").write_bytes(b"abc")
    with pytest.raises(SafetensorsError):
        fileops.read_header(tmp_path / "t")


# --- fuzzing: mangled headers raise SafetensorsError and nothing else --------------------------

_VALID = _raw(
    {"__metadata__": {"format": "pt"}, **GOOD, "c": {"dtype": "BF16", "shape": [1, 1], "data_offsets": [10, 12]}},
    bytes(range(12)),
)
_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=20,
)
_entry = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(list(sf.DTYPE_BITS) + ["X", 3]) | _json_values,
        "shape": st.lists(st.integers(-2, 4), max_size=3) | _json_values,
        "data_offsets": st.lists(st.integers(-2, 24), min_size=2, max_size=2) | _json_values,
    },
    optional={"extra": _json_values},
)


def _check(blob: bytes, file_size: int | None = None) -> None:
    try:
        sf.parse_header(blob, len(blob) if file_size is None else file_size)
    except SafetensorsError as e:
        assert "\n" not in str(e)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    edits=st.lists(st.tuples(st.integers(0, len(_VALID) - 1), st.integers(0, 255)), min_size=1, max_size=6),
    cut=st.integers(0, len(_VALID)),
)
def test_fuzz_byte_mutations(edits: list[tuple[int, int]], cut: int) -> None:
    blob = bytearray(_VALID)
    for pos, value in edits:
        blob[pos] = value
    _check(bytes(blob))
    _check(bytes(blob[:cut]))
    _check(bytes(blob), len(blob) + cut)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    header=st.dictionaries(st.text(max_size=6), _entry | _json_values, max_size=4)
    | st.dictionaries(st.just("__metadata__"), _json_values, max_size=1)
    | _json_values,
    data=st.binary(max_size=24),
    pad=st.booleans(),
)
def test_fuzz_structured_headers(header: object, data: bytes, pad: bool) -> None:
    _check(_raw(json.dumps(header), data, pad))


def test_parse_error_leaves_caller_mmap_closable(tmp_path: Path) -> None:
    path = tmp_path / "bad"
    path.write_bytes(_raw({"a": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4))
    with pytest.raises(SafetensorsError):
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            sf.parse_header(mm, len(mm))  # the mmap's close must not hit BufferError


def test_tensor_index_one_rule_for_duplicate_names() -> None:
    def header(**tensors: int) -> sf.Header:
        raw = {n: ("U8", (k,), bytes(k)) for n, k in tensors.items()}
        prefix, parts = sf.encode_raw(raw)
        data = prefix + b"".join(bytes(p) for p in parts)
        return sf.parse_header(data, len(data))

    a, b = header(x=3, y=2), header(z=1)
    index = sf.tensor_index({"a.safetensors": a, "b.safetensors": b})
    assert list(index) == ["x", "y", "z"]
    assert index["z"] == ("b.safetensors", b.tensors["z"])
    assert sf.tensor_index([("a", a), ("b", b)]) == {k: (p.split(".")[0], i) for k, (p, i) in index.items()}
    with pytest.raises(SafetensorsError, match=r"^tensor 'y' is in both a.safetensors and c.safetensors$"):
        sf.tensor_index({"a.safetensors": a, "b.safetensors": b, "c.safetensors": header(y=5)})
