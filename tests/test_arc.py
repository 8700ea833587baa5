"""bdn.proto.arc: the arc_v1/arc_v2 delta codecs, diff files, and interop with fireworks-delta-compression."""

from __future__ import annotations

import mmap
import shutil
import warnings
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from bdn import fileops
from bdn.proto import arc, arc_streams
from bdn.proto import safetensors_fmt as sf
from bdn.proto.errors import ChecksumError, ProtocolError, TensorMismatch, UnsupportedFormat

FORMATS = arc.COMPRESSION_FORMATS
#: The hosted APIs' formats (zstd/zlib frames of the whole XOR); bdn_planes_v1 has its own tests too.
ARC_FORMATS = ("arc_v1", "arc_v2")


# --- formats -----------------------------------------------------------------------------------


def test_check_formats() -> None:
    arc.check_formats("arc_v1")
    arc.check_formats("ARC_V2", None)
    with pytest.raises(
        UnsupportedFormat,
        match=r"^unsupported compression_format 'arc_v3': bdn supports arc_v1, arc_v2, bdn_planes_v1$",
    ):
        arc.check_formats("arc_v3")
    with pytest.raises(UnsupportedFormat, match="bdn supports alder32"):
        arc.check_formats("arc_v2", "crc32")
    arc.check_formats("BDN_PLANES_V1", "alder32")
    with pytest.raises(UnsupportedFormat, match="arc_v1, arc_v2, bdn_planes_v1"):
        arc.encode_xor(b"a", b"b", "arc_v3")
    assert arc.DEFAULT_COMPRESSION == "arc_v2"


def test_fused_adler32_over_pieces_matches_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # apply_diff checks each tensor's Adler-32 as a running value over decode pieces
    monkeypatch.setattr(arc_streams, "_DCHUNK", 777)
    rng = np.random.default_rng(11)
    base = {"a": rng.integers(0, 256, 10_001, dtype=np.uint8), "b": rng.integers(0, 256, 3, dtype=np.uint8)}
    target = {k: v ^ (rng.random(v.size) < 0.1).astype(np.uint8) for k, v in base.items()}
    for fmt in ARC_FORMATS:
        fileops.save(tmp_path / "base", base)
        fileops.save(tmp_path / "target", target)
        fileops.write_diff_file(tmp_path / "base", tmp_path / "target", tmp_path / "d", fmt)
        assert _apply(tmp_path / "base", tmp_path / "d", fmt, workers=1) == (tmp_path / "target").read_bytes()


def test_adler32_matches_zlib() -> None:
    a = np.arange(1000, dtype=np.float32).reshape(10, 100)
    assert arc.adler32(a) == zlib.adler32(a.tobytes())
    assert arc.adler32(b"") == 1


# --- codec round trips ---------------------------------------------------------------------------


def _round_trip(base: np.ndarray, target: np.ndarray, fmt: str) -> None:
    frame = arc.encode_xor(base, target, fmt)
    out = np.empty_like(target)
    arc.decode_xor_into(frame, base, out, fmt)
    assert out.tobytes() == target.tobytes()
    # in place, as on a mapped base file
    work = base.copy()
    arc.decode_xor_into(frame, work, work, fmt)
    assert work.tobytes() == target.tobytes()


_dtypes = st.sampled_from([np.uint8, np.int32, np.float32, np.float16, np.float64])


@settings(max_examples=60, deadline=None)
@given(
    base=hnp.arrays(_dtypes, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=40)),
    seed=st.integers(0, 2**32 - 1),
    density=st.sampled_from([0.0, 0.001, 0.05, 1.0]),
    fmt=st.sampled_from(FORMATS),
)
def test_round_trip_random_sparse_changes(base: np.ndarray, seed: int, density: float, fmt: str) -> None:
    rng = np.random.default_rng(seed)
    target = base.copy()
    raw = target.reshape(-1).view(np.uint8)
    hit = rng.random(raw.size) < density
    raw[hit] = rng.integers(0, 256, int(hit.sum()), dtype=np.uint8)
    _round_trip(base, target, fmt)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 3000), fmt=st.sampled_from(FORMATS))
def test_round_trip_bf16(seed: int, n: int, fmt: str) -> None:
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(n).astype(ml_dtypes.bfloat16)
    target = (base.astype(np.float32) * (1 + rng.standard_normal(n) * 1e-3)).astype(ml_dtypes.bfloat16)
    _round_trip(base, target, fmt)


@pytest.mark.parametrize("fmt", ARC_FORMATS)
def test_round_trip_across_chunks(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # small chunks exercise the multi-chunk paths of both codecs without big buffers
    monkeypatch.setattr(arc_streams, "_CHUNK", 1000)
    monkeypatch.setattr(arc_streams, "_DCHUNK", 999)
    monkeypatch.setattr(arc_streams, "_ZLIB_IN", 37)
    rng = np.random.default_rng(3)
    base = rng.integers(0, 256, 25_013, dtype=np.uint8)
    target = base.copy()
    target[rng.integers(0, base.size, 500)] ^= 0x5A
    _round_trip(base, target, fmt)
    frame = arc.encode_xor(base, target, fmt)
    with pytest.raises(ProtocolError, match="more than"):
        arc.decode_xor_into(frame, base[:-1], np.empty(base.size - 1, np.uint8), fmt)


def test_frame_is_standard() -> None:
    base, target = np.zeros(5000, np.uint8), np.ones(5000, np.uint8)
    v2 = arc.encode_xor(base, target, "arc_v2")
    assert zstandard.frame_content_size(v2) == 5000  # the reference decoder needs the content size
    assert zstandard.ZstdDecompressor().decompress(v2) == b"\x01" * 5000
    assert zlib.decompress(arc.encode_xor(base, target, "arc_v1")) == b"\x01" * 5000


# --- hostile streams -----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ARC_FORMATS)
def test_bad_streams_are_refused(fmt: str) -> None:
    rng = np.random.default_rng(5)
    base = rng.integers(0, 256, 4096, dtype=np.uint8)
    target = base.copy()
    target[::7] = 0
    frame = arc.encode_xor(base, target, fmt)
    out = np.empty_like(base)
    bigger = arc.encode_xor(np.zeros(4097, np.uint8), np.ones(4097, np.uint8), fmt)
    smaller = arc.encode_xor(np.zeros(4095, np.uint8), np.ones(4095, np.uint8), fmt)
    for bad, needle in [
        (bigger, "more than the 4096 bytes"),
        (smaller, "ends after 4095 bytes|truncated"),
        (frame[: len(frame) // 2], "ends after|truncated|not valid"),
        (frame + b"garbage!", "unexpected bytes|not valid"),
        (b"\x00" * 32, "not valid|ends after"),
        (b"", "ends after 0 bytes"),
    ]:
        with pytest.raises(ProtocolError, match=needle):
            arc.decode_xor_into(bad, base, out, fmt)


def _bomb(fmt: str, size: int) -> bytes:
    zeros = bytes(4 << 20)
    cobj = zstandard.ZstdCompressor(level=1).compressobj() if fmt == "arc_v2" else zlib.compressobj(9)
    parts = [cobj.compress(zeros) for _ in range(size // len(zeros))]
    return b"".join(parts) + cobj.flush()


@pytest.mark.parametrize(("fmt", "size"), [("arc_v2", 1 << 30), ("arc_v1", 64 << 20)])
def test_decompression_bomb_is_bounded(fmt: str, size: int) -> None:
    bomb = _bomb(fmt, size)
    assert len(bomb) < size // 200  # zlib tops out near 1000:1, zstd far higher
    base = np.zeros(1000, np.uint8)
    with pytest.raises(ProtocolError, match="more than the 1000 bytes"):
        arc.decode_xor_into(bomb, base, np.empty_like(base), fmt)


# --- diff files ---------------------------------------------------------------------------------


def _state(seed: int = 0) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    base = {
        "embed": rng.standard_normal((64, 48)).astype(ml_dtypes.bfloat16),
        "layers.0.w": rng.standard_normal((32, 32)).astype(np.float32),
        "layers.0.b": rng.standard_normal(32).astype(np.float16),
        "steps": np.arange(3, dtype=np.int64),
        "empty": np.zeros((0, 8), np.float32),
        "flags": np.array([True, False]),
    }
    target = {k: v.copy() for k, v in base.items()}
    target["embed"][5] = 0.5
    target["layers.0.w"] *= 1.001
    target["steps"][1] = 99
    return base, target


def _files(tmp_path: Path, seed: int = 0, meta: dict[str, str] | None = None) -> tuple[Path, Path]:
    base, target = _state(seed)
    meta = {"format": "pt"} if meta is None else meta
    fileops.save(tmp_path / "base.safetensors", base, meta)
    fileops.save(tmp_path / "target.safetensors", target, meta)
    return tmp_path / "base.safetensors", tmp_path / "target.safetensors"


def _apply(base_path: Path, diff_path: Path, fmt: str, workers: int = 1) -> bytes:
    base, diff = base_path.read_bytes(), diff_path.read_bytes()
    bh = sf.parse_header(base, len(base))
    dh = arc.read_diff_header(diff, len(diff))
    out = bytearray(arc.target_size(bh, dh))
    arc.apply_diff(base, bh, diff, dh, out, fmt, map=fileops.thread_map(workers))
    return bytes(out)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("workers", [1, 4])
def test_whole_file_reconstruction_is_bit_exact(tmp_path: Path, fmt: str, workers: int) -> None:
    base_path, target_path = _files(tmp_path)
    diff_path = tmp_path / "diff.safetensors"
    fileops.write_diff_file(base_path, target_path, diff_path, fmt, workers=workers)
    assert _apply(base_path, diff_path, fmt, workers) == target_path.read_bytes()

    header, streams = arc.read_diff_header(diff_path.read_bytes(), diff_path.stat().st_size)
    target_bytes = target_path.read_bytes()
    th = sf.parse_header(target_bytes, len(target_bytes))
    assert set(streams) == set(th.tensors)
    assert list(header.tensors) == sorted(th.tensors)  # one U8 dtype: the reference orders by name
    for name, s in streams.items():
        info = th.tensors[name]
        assert s.target_adler32 == zlib.adler32(target_bytes[info.start : info.end])
        assert header.metadata[name] == str(s.target_adler32)


@pytest.mark.parametrize("fmt", FORMATS)
def test_diff_from_arrays_equals_diff_from_files(tmp_path: Path, fmt: str) -> None:
    base_path, target_path = _files(tmp_path)
    base, target = _state()
    fileops.write_diff_file(base_path, target_path, tmp_path / "a.diff", fmt)
    fileops.write_diff_file_from_arrays(base, target, tmp_path / "b.diff", fmt, workers=2)
    assert (tmp_path / "a.diff").read_bytes() == (tmp_path / "b.diff").read_bytes()


@pytest.mark.parametrize("fmt", FORMATS)
def test_in_place_apply_on_mmap(tmp_path: Path, fmt: str) -> None:
    base_path, target_path = _files(tmp_path)
    diff_path = tmp_path / "diff"
    fileops.write_diff_file(base_path, target_path, diff_path, fmt)
    work = tmp_path / "work"
    shutil.copy(base_path, work)
    diff = diff_path.read_bytes()
    with open(work, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
        bh = sf.parse_header(mm, len(mm))
        arc.apply_diff(mm, bh, diff, arc.read_diff_header(diff, len(diff))[0], mm, fmt, map=fileops.thread_map(3))
    assert work.read_bytes() == target_path.read_bytes()


def _rewrite_diff(src: Path, dst: Path, edit_frames=None, edit_meta=None) -> None:
    data = src.read_bytes()
    header = sf.parse_header(data, len(data))
    frames = {n: bytes(data[i.start : i.end]) for n, i in header.tensors.items()}
    meta = dict(header.metadata)
    if edit_frames:
        edit_frames(frames)
    if edit_meta:
        edit_meta(meta)
    fileops.save_raw(dst, {n: ("U8", (len(f),), f) for n, f in frames.items()}, meta)


@pytest.mark.parametrize("fmt", FORMATS)
def test_wrong_adler32_is_a_checksum_error(tmp_path: Path, fmt: str) -> None:
    base_path, target_path = _files(tmp_path)
    fileops.write_diff_file(base_path, target_path, tmp_path / "d", fmt)
    _rewrite_diff(tmp_path / "d", tmp_path / "bad", edit_meta=lambda m: m.update({"layers.0.b": "12345"}))
    with pytest.raises(ChecksumError, match=r"adler32 mismatch for tensor 'layers.0.b': expected 12345, got \d+"):
        _apply(base_path, tmp_path / "bad", fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_corrupted_frame_is_refused(tmp_path: Path, fmt: str) -> None:
    base_path, target_path = _files(tmp_path)
    fileops.write_diff_file(base_path, target_path, tmp_path / "d", fmt)

    def flip(frames: dict[str, bytes]) -> None:
        f = bytearray(frames["layers.0.w"])
        f[len(f) // 2] ^= 0xFF
        frames["layers.0.w"] = bytes(f)

    _rewrite_diff(tmp_path / "d", tmp_path / "bad", edit_frames=flip)
    with pytest.raises(ProtocolError, match="tensor 'layers.0.w'"):
        _apply(base_path, tmp_path / "bad", fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_oversized_frame_is_refused(tmp_path: Path, fmt: str) -> None:
    base_path, target_path = _files(tmp_path)
    fileops.write_diff_file(base_path, target_path, tmp_path / "d", fmt)
    big = arc.encode_xor(np.zeros(3 * 8 + 1, np.uint8), np.ones(3 * 8 + 1, np.uint8), fmt)
    _rewrite_diff(tmp_path / "d", tmp_path / "bad", edit_frames=lambda f: f.update({"steps": big}))
    needle = (
        "stream is for a 25-byte tensor, the base tensor has 24 bytes"
        if fmt == "bdn_planes_v1"
        else "more than the 24 bytes"
    )
    with pytest.raises(ProtocolError, match=f"tensor 'steps': .*{needle}"):
        _apply(base_path, tmp_path / "bad", fmt)


@pytest.mark.parametrize("workers", [1, 2])
def test_error_leaves_caller_mmaps_closable(tmp_path: Path, workers: int) -> None:
    base_path, target_path = _files(tmp_path)
    fileops.write_diff_file(base_path, target_path, tmp_path / "d")
    _rewrite_diff(tmp_path / "d", tmp_path / "bad", edit_meta=lambda m: m.update({"embed": "1"}))
    work = tmp_path / "work"
    shutil.copy(base_path, work)
    diff = (tmp_path / "bad").read_bytes()
    with pytest.raises(ChecksumError):
        with open(work, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:  # close must not hit BufferError
            arc.apply_diff(
                mm,
                sf.parse_header(mm, len(mm)),
                diff,
                arc.read_diff_header(diff, len(diff)),
                mm,
                "arc_v2",
                map=fileops.thread_map(workers),
            )


def test_malformed_diff_headers(tmp_path: Path) -> None:
    base_path, target_path = _files(tmp_path)
    fileops.write_diff_file(base_path, target_path, tmp_path / "d")
    cases = [
        (lambda m: m.pop("steps"), "no adler32 in __metadata__ for tensor 'steps'"),
        (lambda m: m.update({"steps": "0x12"}), "tensor 'steps' is not an adler32 decimal"),
        (lambda m: m.update({"steps": str(1 << 32)}), "not an adler32 decimal"),
        (lambda m: m.update({"steps": "007"}), "not an adler32 decimal"),
    ]
    for edit, needle in cases:
        _rewrite_diff(tmp_path / "d", tmp_path / "bad", edit_meta=edit)
        data = (tmp_path / "bad").read_bytes()
        with pytest.raises(ProtocolError, match=needle):
            arc.read_diff_header(data, len(data))
    fileops.save(tmp_path / "notdiff", {"w": np.zeros(3, np.float32)}, {"w": "1"})
    data = (tmp_path / "notdiff").read_bytes()
    with pytest.raises(ProtocolError, match="diff tensor 'w' is F32 \\[3\\], expected a 1-D U8 stream"):
        arc.read_diff_header(data, len(data))


def test_diff_and_base_names_must_match(tmp_path: Path) -> None:
    base_path, target_path = _files(tmp_path)
    fileops.write_diff_file(base_path, target_path, tmp_path / "d")
    _rewrite_diff(
        tmp_path / "d", tmp_path / "bad", edit_frames=lambda f: f.pop("flags"), edit_meta=lambda m: m.pop("flags")
    )
    with pytest.raises(ProtocolError, match="no stream for tensor 'flags'"):
        _apply(base_path, tmp_path / "bad", "arc_v2")


# --- base/target mismatches ---------------------------------------------------------------------


def test_mismatches_name_the_tensor(tmp_path: Path) -> None:
    base, target = _state()
    cases = [
        (
            {**target, "layers.0.b": target["layers.0.b"][:-1]},
            "tensor 'layers.0.b': shape \\[32\\] in the base, \\[31\\] in the target",
        ),
        (
            {**target, "steps": target["steps"].astype(np.int32)},
            "tensor 'steps': dtype I64 in the base, I32 in the target",
        ),
        (
            {**{k: v for k, v in target.items() if k != "flags"}, "flagz": target["flags"]},
            "tensor 'flags' is in the base but not in the target",
        ),
        ({**target, "extra": np.zeros(1, np.float32)}, "tensor 'extra' is in the target but not in the base"),
    ]
    fileops.save(tmp_path / "base", base, {"format": "pt"})
    for bad, needle in cases:
        with pytest.raises(TensorMismatch, match=needle):
            fileops.write_diff_file_from_arrays(base, bad, tmp_path / "d")
        fileops.save(tmp_path / "target", bad, {"format": "pt"})
        with pytest.raises(TensorMismatch, match=needle):
            fileops.write_diff_file(tmp_path / "base", tmp_path / "target", tmp_path / "d")


def test_target_header_must_equal_base_header(tmp_path: Path) -> None:
    base, target = _state()
    fileops.save(tmp_path / "base", base, {"format": "pt", "step": "1"})
    fileops.save(tmp_path / "target", target, {"format": "pt", "step": "2"})
    with pytest.raises(TensorMismatch, match="__metadata__ differs between base and target \\(key 'step'\\)"):
        fileops.write_diff_file(tmp_path / "base", tmp_path / "target", tmp_path / "d")
    # same tensors and metadata, different layout: a reference file with other JSON spacing
    fileops.save(tmp_path / "target", target, {"format": "pt", "step": "1"})
    data = bytearray((tmp_path / "target").read_bytes())
    n = int.from_bytes(data[:8], "little")
    text = data[8 : 8 + n].decode().rstrip(" ").replace('"format":', '"format": ')
    assert len(text) <= n
    data[8 : 8 + n] = (text + " " * (n - len(text))).encode()
    (tmp_path / "target").write_bytes(data)
    with pytest.raises(TensorMismatch, match="headers differ in their bytes"):
        fileops.write_diff_file(tmp_path / "base", tmp_path / "target", tmp_path / "d")


# --- interop with the reference implementation --------------------------------------------------


def _fireworks():
    # Never skip silently: the reason goes to the skip summary and, as a warning, to every run's
    # summary (CI installs it: torch==2.13.0, the CPU wheel, then fireworks-delta-compression).
    try:
        import fireworks_delta_compression as fdc
    except ImportError as e:
        reason = (
            f"fireworks-delta-compression (PyPI) cannot be imported ({e}): interop with the hosted "
            f"hot-load format untested"
        )
        warnings.warn(reason, UserWarning, stacklevel=2)
        pytest.skip(reason)
    return fdc


@pytest.mark.parametrize("fmt", ARC_FORMATS)
def test_their_diff_applies_in_bdn(tmp_path: Path, fmt: str) -> None:
    fdc = _fireworks()
    base_path, target_path = _files(tmp_path)
    diff_path = tmp_path / "theirs.safetensors"
    fdc.delta_compress_files_to_file(
        src=str(base_path), dst=str(target_path), diff_file=str(diff_path), compression_format=fmt
    )
    assert _apply(base_path, diff_path, fmt, workers=2) == target_path.read_bytes()


@pytest.mark.parametrize("fmt", ARC_FORMATS)
def test_our_diff_applies_in_theirs(tmp_path: Path, fmt: str) -> None:
    fdc = _fireworks()
    base_path, target_path = _files(tmp_path)
    diff_path = tmp_path / "ours.safetensors"
    fileops.write_diff_file(base_path, target_path, diff_path, fmt)
    work = tmp_path / "work.safetensors"
    shutil.copy(base_path, work)
    fdc.delta_decompress_inplace(base_path=str(work), diff_path=str(diff_path), compression_format=fmt)
    assert work.read_bytes() == target_path.read_bytes()


def test_decode_error_leaves_caller_mmap_closable(tmp_path: Path) -> None:
    path = tmp_path / "t"
    path.write_bytes(bytes(100))
    with pytest.raises(ProtocolError):
        with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
            arc.decode_xor_into(b"not zstd at all", mm, mm, "arc_v2")
