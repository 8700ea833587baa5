"""bdn_planes_v1: round trips, block-parallel apply, adler32_combine, hostile streams, and a swarm.

The stream layout is specified in bdn/proto/arc.py's module docstring; the hostile-stream tests
build streams field by field from that text (``_stream``), not through the encoder.
"""

from __future__ import annotations

import mmap
import shutil
import struct
import sys
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bdn import fileops
from bdn.proto import arc, planes, planes_scan
from bdn.proto import safetensors_fmt as sf
from bdn.proto.errors import ChecksumError, ProtocolError

FMT = "bdn_planes_v1"
SMALL = 4096  # the decoder's smallest accepted block: many blocks from small arrays


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(planes, "PLANES_BLOCK", SMALL)
    monkeypatch.setattr(planes, "_P_BATCH", 1)  # every block its own pool task
    monkeypatch.setattr(planes, "_P_PIECE", 1000)  # several copy/scatter/checksum pieces per block


def _modes(stream: bytes, n: int) -> list[int]:
    _, blocks = planes.parse_stream(np.frombuffer(stream, np.uint8), n)
    return [b.mode for b in blocks]


# --- adler32_combine --------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(a=st.binary(max_size=3000), b=st.binary(max_size=3000), pad=st.integers(0, 200_000))
def test_adler32_combine_matches_zlib_of_the_concatenation(a: bytes, b: bytes, pad: int) -> None:
    # pad: long runs make len2 exceed the modulus 65521 (and its multiples) many times over
    b = b + bytes([0xFF]) * pad if pad % 2 else b + bytes(pad)
    got = arc.adler32_combine(zlib.adler32(a), zlib.adler32(b), len(b))
    assert got == zlib.adler32(a + b)


def test_adler32_combine_edges() -> None:
    assert arc.adler32_combine(1, 1, 0) == 1  # empty + empty
    x = b"\xff" * 65521 * 3
    assert arc.adler32_combine(zlib.adler32(x), zlib.adler32(x), len(x)) == zlib.adler32(x + x)
    assert arc.adler32_combine(zlib.adler32(b"abc"), 1, 0) == zlib.adler32(b"abc")


# --- round trips ------------------------------------------------------------------------------


def _changed(base: np.ndarray, density: float, rng: np.random.Generator) -> np.ndarray:
    target = base.copy()
    hit = rng.random(base.size) < density
    if base.dtype == np.uint8:
        target[hit] ^= rng.integers(1, 256, int(hit.sum()), dtype=np.uint8)
    else:  # small relative moves, as an optimizer step makes
        moved = base[hit].astype(np.float32) * (1 + rng.standard_normal(int(hit.sum())).astype(np.float32) * 0.05)
        target[hit] = moved.astype(base.dtype)
    return target


def _round_trip(base: np.ndarray, target: np.ndarray) -> bytes:
    stream = arc.encode_xor(base, target, FMT)
    out = np.full_like(base, 7)
    arc.decode_xor_into(stream, base, out, FMT)
    assert out.tobytes() == target.tobytes()
    work = base.copy()  # in place, as on a mapped base file
    arc.decode_xor_into(stream, work, work, FMT)
    assert work.tobytes() == target.tobytes()
    return stream


@pytest.mark.usefixtures("small_blocks")
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float32, np.uint8, np.float64], ids=str)
@pytest.mark.parametrize("n", [0, 1, 2, 4095, 4096, 3 * 4096 + 7, 20_011])
@pytest.mark.parametrize("density", [0.0, 0.0004, 0.02, 0.4, 1.0])
def test_round_trip(dtype: type, n: int, density: float) -> None:
    rng = np.random.default_rng(n * 10 + int(density * 1000))
    base = rng.standard_normal(n).astype(dtype) if dtype != np.uint8 else rng.integers(0, 256, n, dtype=np.uint8)
    _round_trip(base, _changed(base, density, rng))


@pytest.mark.usefixtures("small_blocks")
def test_every_block_mode_and_escaped_gaps_are_exercised() -> None:
    rng = np.random.default_rng(1)
    base = rng.standard_normal(5 * SMALL).astype(ml_dtypes.bfloat16)
    target = base.copy()
    target[SMALL + 3] += 1  # block 1: sparse, first gap 4
    target[SMALL + 3000] += 1  # a gap >= 255: escaped
    target[2 * SMALL :] = _changed(base[2 * SMALL :], 0.9, rng)[: 3 * SMALL]  # dense
    target[4 * SMALL :] = base[4 * SMALL :]  # block 4: unchanged again
    stream = _round_trip(base, target)
    assert _modes(stream, base.nbytes) == [0, 1, 2, 2, 0]
    _, blocks = planes.parse_stream(np.frombuffer(stream, np.uint8), base.nbytes)
    assert (blocks[1].k, blocks[1].e) == (2, 1)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(0, 30_000),
    density=st.sampled_from([0.0, 0.001, 0.03, 0.5]),
    dtype=st.sampled_from([ml_dtypes.bfloat16, np.float16, np.float32, np.int64, np.uint8]),
)
def test_round_trip_random(small_blocks: None, seed: int, n: int, density: float, dtype: type) -> None:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, n * np.dtype(dtype).itemsize, dtype=np.uint8).view(dtype)
    target = base.copy()
    raw = target.view(np.uint8)
    hit = rng.random(raw.size) < density
    raw[hit] = rng.integers(0, 256, int(hit.sum()), dtype=np.uint8)
    _round_trip(base, target)


# --- the encoder's kernel (bdn/proto/planes_scan.py) against numpy -----------------------------


def _needs_kernel() -> None:
    if not planes_scan.available():
        pytest.skip("numba is not installed (pip install 'bdn[fast]'): the encoder's kernel is not compiled")


def _words(rng: np.random.Generator, n: int, w: int, density: float, offset: int) -> tuple[np.ndarray, np.ndarray]:
    """Base and target words (width ``w``) starting ``offset`` bytes into their buffers (unaligned when odd)."""
    dt = np.dtype(f"<u{w}")
    raw = rng.integers(0, 256, (2, n * w + offset), dtype=np.uint8)
    base, target = raw[0, offset:].view(dt), raw[1, offset:].view(dt)
    target[:] = base
    hit = rng.random(n) < density
    target[hit] ^= rng.integers(1, 1 << min(8 * w, 63), int(hit.sum()), dtype=np.uint64).astype(dt)
    if density and n:
        target[-1] ^= 1  # a change in the tail after the last whole 8-byte group, when there is one
    return base, target


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(0, 9000),
    w=st.sampled_from([1, 2, 4, 8]),
    density=st.sampled_from([0.0, 0.0005, 0.004, 0.03, 0.3, 1.0]),
    offset=st.sampled_from([0, 0, 1, 2, 4]),
)
def test_scan_kernel_finds_what_numpy_finds(seed: int, n: int, w: int, density: float, offset: int) -> None:
    _needs_kernel()
    rng = np.random.default_rng(seed)
    base, target = _words(rng, n, w, density, offset)
    scratch = np.empty(planes_scan.scratch_bytes(n) + 8, dtype=np.uint64).view(np.uint8)
    vals = np.full(n, 0xAB, dtype=base.dtype)
    got = planes_scan.scan(base, target, scratch, vals)
    assert got is not None
    k, g8, esc, changed = got
    nz = np.flatnonzero(base != target)
    gaps = np.diff(nz, prepend=-1)
    assert k == len(nz)
    assert g8.tolist() == np.minimum(gaps, 255).tolist()
    assert esc.tolist() == gaps[gaps >= 255].tolist()
    assert changed.tolist() == (base ^ target)[nz].tolist()


@pytest.mark.usefixtures("small_blocks")
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float32, np.uint8, np.float64], ids=str)
@pytest.mark.parametrize("density", [0.0004, 0.02, 0.4])
def test_kernel_and_numpy_encoders_write_the_same_stream(
    monkeypatch: pytest.MonkeyPatch, dtype: type, density: float
) -> None:
    _needs_kernel()
    rng = np.random.default_rng(int(density * 1e4))
    base = (
        rng.standard_normal(3 * SMALL + 5).astype(dtype)
        if dtype != np.uint8
        else rng.integers(0, 256, 3 * SMALL + 5, dtype=np.uint8)
    )
    target = _changed(base, density, rng)
    target[2 * SMALL + 1] = base[2 * SMALL + 1] + 1 if dtype != np.uint8 else base[2 * SMALL + 1] ^ 1
    target[2 * SMALL + 2000] = base[2 * SMALL + 2000] + 1 if dtype != np.uint8 else base[2 * SMALL + 2000] ^ 1
    with_kernel = _round_trip(base, target)
    monkeypatch.setattr(planes_scan, "_kernel", False)  # as where numba is absent
    assert not planes_scan.available()
    assert arc.encode_xor(base, target, FMT) == with_kernel


def test_warm_loads_the_kernel_for_every_width() -> None:
    _needs_kernel()
    assert planes_scan.warm() is True
    for w in (1, 2, 4, 8):  # each width's compiled code is there: a scan of an aligned block works
        b = np.zeros(4096, dtype=f"<u{w}")
        t = b.copy()
        t[[5, 4000]] = 3
        got = planes_scan.scan(b, t, np.empty(planes_scan.scratch_bytes(4096), np.uint64).view(np.uint8), b.copy())
        assert got is not None and got[0] == 2 and got[1].tolist() == [6, 255] and got[2].tolist() == [3995]


def test_without_numba_the_encoder_uses_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "numba", None)  # import numba raises ImportError
    monkeypatch.setattr(planes_scan, "_kernel", None)
    assert not planes_scan.available()
    b = np.arange(8, dtype=np.uint16)
    assert planes_scan.scan(b, b ^ 1, np.empty(planes_scan.scratch_bytes(8), np.uint8), np.empty(8, np.uint16)) is None
    _round_trip(b, b ^ 1)  # the numpy path


def test_width_falls_back_to_bytes() -> None:
    base = np.arange(10, dtype=np.uint8)
    target = base ^ 1
    for width in (None, 3, 16, 4):  # 4 does not divide 10: bytes
        stream = arc.encode_xor(base, target, FMT, width=width)
        assert stream[5] == 1
        out = np.empty_like(base)
        arc.decode_xor_into(stream, base, out, FMT)
        assert out.tobytes() == target.tobytes()


# --- diff files -------------------------------------------------------------------------------


def _state(seed: int = 0) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    base = {
        "big": rng.standard_normal(9 * SMALL + 123).astype(ml_dtypes.bfloat16),
        "f32": rng.standard_normal((70, 130)).astype(np.float32),
        "u8": rng.integers(0, 256, 5000, dtype=np.uint8),
        "one": np.ones(1, np.float16),
        "empty": np.zeros((0, 4), np.float32),
        "same": rng.standard_normal(300).astype(np.float32),
    }
    target = {k: v.copy() for k, v in base.items()}
    target["big"] = _changed(base["big"], 0.02, rng)
    target["f32"] = _changed(base["f32"].reshape(-1), 0.6, rng).reshape(70, 130)
    target["u8"][::97] ^= 0x40
    target["one"][0] = 2
    return base, target


def _files(tmp_path: Path) -> tuple[Path, Path]:
    base, target = _state()
    fileops.save(tmp_path / "base.safetensors", base, {"format": "pt"})
    fileops.save(tmp_path / "target.safetensors", target, {"format": "pt"})
    return tmp_path / "base.safetensors", tmp_path / "target.safetensors"


def _apply(base_path: Path, diff: bytes, workers: int) -> bytes:
    base = base_path.read_bytes()
    bh = sf.parse_header(base, len(base))
    dh = arc.read_diff_header(diff, len(diff))
    out = bytearray(arc.target_size(bh, dh))
    arc.apply_diff(base, bh, diff, dh, out, FMT, map=fileops.thread_map(workers))
    return bytes(out)


@pytest.mark.usefixtures("small_blocks")
@pytest.mark.parametrize("workers", [1, 2, 8])
@pytest.mark.parametrize("batch", [1, 3 * SMALL])
def test_whole_file_apply_is_bit_exact(
    tmp_path: Path, workers: int, batch: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(planes, "_P_BATCH", batch)  # pool tasks of one block, or of several
    base_path, target_path = _files(tmp_path)
    fileops.write_diff_file(base_path, target_path, tmp_path / "d", FMT, workers=workers)
    diff = (tmp_path / "d").read_bytes()
    assert _apply(base_path, diff, workers) == target_path.read_bytes()
    header, streams = arc.read_diff_header(diff, len(diff))
    tb = target_path.read_bytes()
    th = sf.parse_header(tb, len(tb))
    for name, s in streams.items():  # metadata is the target's Adler-32, as in arc_v1/arc_v2
        info = th.tensors[name]
        assert header.metadata[name] == str(zlib.adler32(tb[info.start : info.end]))
        assert diff[s.frame_start : s.frame_start + 4] == b"BDNP"
    assert len(_modes(diff[streams["big"].frame_start : streams["big"].frame_end], th.tensors["big"].nbytes)) == 10
    # in place on a mapped copy of the base, blocks on a pool
    work = tmp_path / "work"
    shutil.copy(base_path, work)
    with open(work, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
        arc.apply_diff(
            mm,
            sf.parse_header(mm, len(mm)),
            diff,
            arc.read_diff_header(diff, len(diff)),
            mm,
            FMT,
            map=fileops.thread_map(4),
        )
    assert work.read_bytes() == target_path.read_bytes()


@pytest.mark.usefixtures("small_blocks")
def test_diff_is_the_same_from_files_arrays_and_any_worker_count(tmp_path: Path) -> None:
    base_path, target_path = _files(tmp_path)
    base, target = _state()
    fileops.write_diff_file(base_path, target_path, tmp_path / "a", FMT, workers=1)
    fileops.write_diff_file(base_path, target_path, tmp_path / "b", FMT, workers=5)
    fileops.write_diff_file_from_arrays(base, target, tmp_path / "c", FMT, workers=3)
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes() == (tmp_path / "c").read_bytes()


@pytest.mark.usefixtures("small_blocks")
@pytest.mark.parametrize("workers", [1, 3])
def test_wrong_adler32_names_the_tensor(tmp_path: Path, workers: int) -> None:
    base_path, target_path = _files(tmp_path)
    fileops.write_diff_file(base_path, target_path, tmp_path / "d", FMT)
    data = (tmp_path / "d").read_bytes()
    h = sf.parse_header(data, len(data))
    frames = {n: bytes(data[i.start : i.end]) for n, i in h.tensors.items()}
    fileops.save_raw(
        tmp_path / "bad", {n: ("U8", (len(f),), f) for n, f in frames.items()}, {**h.metadata, "big": "99"}
    )
    with pytest.raises(ChecksumError, match=r"^adler32 mismatch for tensor 'big': expected 99, got \d+$"):
        _apply(base_path, (tmp_path / "bad").read_bytes(), workers)


# --- hostile streams --------------------------------------------------------------------------


def _stream(
    n: int,
    recs: list[tuple[int, int, int, bytes]],
    *,
    w: int = 1,
    block: int = SMALL,
    nblocks: int | None = None,
    magic: bytes = b"BDNP",
    version: int = 1,
    reserved: int = 0,
) -> bytes:
    """A stream built from the docstring's layout: header, 13-byte records, payloads."""
    head = struct.pack("<4sBBHQII", magic, version, w, reserved, n, block, len(recs) if nblocks is None else nblocks)
    table = b"".join(struct.pack("<BIII", mode, k, e, len(p)) for mode, k, e, p in recs)
    return head + table + b"".join(p for *_, p in recs)


def _z(raw: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=3).compress(raw)


def _decode(stream: bytes, n: int) -> np.ndarray:
    base = np.zeros(n, np.uint8)
    out = np.empty_like(base)
    arc.decode_xor_into(stream, base, out, FMT)
    return out


def test_hand_built_stream_decodes() -> None:
    # 5000 bytes, w=1: block 0 sparse with changes at 0 and 300 (gap 300 escaped), block 1 dense
    sparse = _z(bytes([1, 255]) + struct.pack("<I", 300) + bytes([0xAA, 0xBB]))
    dense = _z(bytes(range(256)) * 3 + bytes(904 - 768))
    out = _decode(_stream(5000, [(1, 2, 1, sparse), (2, 0, 0, dense)]), 5000)
    want = np.zeros(5000, np.uint8)
    want[0], want[300] = 0xAA, 0xBB
    want[4096:] = np.frombuffer(bytes(range(256)) * 3 + bytes(904 - 768), np.uint8)
    assert out.tobytes() == want.tobytes()


def _bomb_frame(size: int, with_size: bool) -> bytes:
    c = zstandard.ZstdCompressor(level=1)
    obj = c.compressobj(size=size if with_size else -1)
    zeros = bytes(1 << 20)
    return b"".join(obj.compress(zeros) for _ in range(size >> 20)) + obj.flush()


SPARSE_OK = _z(bytes([5]) + b"\x01")  # one change at index 4, XOR 0x01


@pytest.mark.parametrize(
    ("stream", "n", "needle"),
    [
        (b"BDNP", 10, "shorter than its 24-byte header"),
        (_stream(10, [(0, 0, 0, b"")], magic=b"BDP1"), 10, "not a bdn_planes_v1 stream"),
        (_stream(10, [(0, 0, 0, b"")], version=2), 10, "version 2"),
        (_stream(10, [(0, 0, 0, b"")], reserved=1), 10, "reserved 1"),
        (_stream(12, [(0, 0, 0, b"")], w=3), 12, "element width 3"),
        (_stream(11, [(0, 0, 0, b"")]), 10, "for a 11-byte tensor, the base tensor has 10"),
        (_stream(10, [(0, 0, 0, b"")], w=4), 10, "not a whole number of 4-byte elements"),
        (_stream(10, [(0, 0, 0, b"")], block=4095), 10, "block of 4095 elements"),
        (_stream(16, [(0, 0, 0, b"")], block=1 << 22, w=8), 16, "block of 4194304 elements of 8 bytes"),
        (_stream(10, [(0, 0, 0, b"")], nblocks=2), 10, "has 2 blocks, a 10-byte tensor needs 1"),
        (_stream(0, [], nblocks=1), 0, "has 1 blocks, a 0-byte tensor needs 0"),
        (_stream(10, [(0, 0, 0, b"")])[:30], 10, "block table .* lies past the end"),
        (_stream(10, [(3, 0, 0, b"")]), 10, "block 0 record is invalid \\(mode 3"),
        (_stream(10, [(0, 1, 0, b"")]), 10, "record is invalid"),
        (_stream(10, [(0, 0, 0, b"x")]), 10, "record is invalid"),
        (_stream(10, [(1, 0, 0, SPARSE_OK)]), 10, "record is invalid \\(mode 1, k 0"),
        (_stream(10, [(1, 11, 0, SPARSE_OK)]), 10, "k 11, .* block of 10 elements"),
        (_stream(10, [(1, 1, 2, SPARSE_OK)]), 10, "escapes 2"),
        (_stream(10, [(2, 1, 0, SPARSE_OK)]), 10, "record is invalid \\(mode 2, k 1"),
        (_stream(10, [(1, 1, 0, SPARSE_OK)]) + b"!", 10, "payloads add up to .* bytes, the stream has"),
        (_stream(10, [(1, 1, 0, SPARSE_OK)])[:-1], 10, "payloads add up to"),
        (_stream(10, [(1, 1, 0, b"not zstd")]), 10, "block 0: payload is not a zstd frame"),
        (_stream(10, [(1, 2, 0, SPARSE_OK)]), 10, "frame declares 2 bytes, expected 4"),
        (_stream(10, [(2, 0, 0, SPARSE_OK)]), 10, "frame declares 2 bytes, expected 10"),
        (_stream(10, [(1, 1, 0, SPARSE_OK + b"xx")]), 10, "bytes after its zstd frame"),
        (_stream(10, [(1, 1, 0, SPARSE_OK + SPARSE_OK)]), 10, "bytes after its zstd frame"),
        (_stream(10, [(1, 1, 0, _z(b"\x00\x01"))]), 10, "a gap of 0"),
        (_stream(10, [(1, 1, 0, _z(b"\xff\x01"))]), 10, "1 escaped gaps, the block record says 0"),
        (
            _stream(10, [(1, 1, 1, _z(b"\x05" + struct.pack("<I", 300) + b"\x01"))]),
            10,
            "0 escaped gaps, the block record says 1",
        ),
        (_stream(10, [(1, 1, 1, _z(b"\xff" + struct.pack("<I", 7) + b"\x01"))]), 10, "an escaped gap below 255"),
        (_stream(10, [(1, 1, 0, _z(b"\x0b\x01"))]), 10, "changed element 10 lies past the block's 10 elements"),
        (
            _stream(5000, [(0, 0, 0, b""), (1, 1, 1, _z(b"\xff" + struct.pack("<I", 2**32 - 1) + b"\x01"))]),
            5000,
            "block 1: changed element 4294967294 lies past the block's 904 elements",
        ),
        (_stream(1 << 20, [(2, 0, 0, _bomb_frame(1 << 28, True))], block=1 << 20), 1 << 20, "declares 268435456 bytes"),
        (_stream(1 << 20, [(2, 0, 0, _bomb_frame(1 << 26, False))], block=1 << 20), 1 << 20, "declares -1 bytes"),
    ],
)
def test_hostile_streams_are_refused(stream: bytes, n: int, needle: str) -> None:
    with pytest.raises(ProtocolError, match=needle):
        _decode(stream, n)


def _valid_streams() -> list[tuple[bytes, int]]:
    rng = np.random.default_rng(9)
    out = []
    for w, density in [(2, 0.01), (4, 0.5), (1, 0.001), (8, 0.05)]:
        n = 2 * SMALL + 300
        base = rng.integers(0, 256, n * w, dtype=np.uint8)
        target = base.copy()
        hit = rng.random(base.size) < density
        target[hit] ^= rng.integers(1, 256, int(hit.sum()), dtype=np.uint8)
        saved = planes.PLANES_BLOCK
        planes.PLANES_BLOCK = SMALL
        try:
            out.append((arc.encode_xor(base, target, FMT, width=w), n * w))
        finally:
            planes.PLANES_BLOCK = saved
    return out


VALID = _valid_streams()
_U32_FIELDS = [8, 12, 16, 20] + [24 + 13 * i + off for i in range(3) for off in (1, 5, 9)]


@st.composite
def _mangled(draw: st.DrawFn) -> tuple[bytes, int]:
    stream, n = draw(st.sampled_from(VALID))
    s = bytearray(stream)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "field", "cut", "insert", "delete"]))
        if not s:
            break
        i = draw(st.integers(0, len(s) - 1))
        if op == "flip":
            s[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set":
            s[i] = draw(st.integers(0, 255))
        elif op == "field":  # header and record integers: lengths, counts, sizes
            f = draw(st.sampled_from([o for o in _U32_FIELDS if o + 4 <= len(s)] or [0]))
            v = draw(st.one_of(st.integers(0, 2**32 - 1), st.integers(0, 20_000)))
            s[f : f + 4] = v.to_bytes(4, "little")
        elif op == "cut":
            del s[i:]
        elif op == "insert":
            s[i:i] = draw(st.binary(min_size=1, max_size=40))
        else:
            del s[i : i + draw(st.integers(1, 40))]
    return bytes(s), n


@settings(max_examples=400, deadline=None)
@given(case=_mangled())
def test_fuzz_mangled_streams_raise_only_protocol_errors(case: tuple[bytes, int]) -> None:
    stream, n = case
    base = np.arange(n, dtype=np.uint64).astype(np.uint8)
    out = np.empty_like(base)
    try:
        arc.decode_xor_into(stream, base, out, FMT)
    except ProtocolError as e:
        assert "\n" not in str(e)


@st.composite
def _forged(draw: st.DrawFn) -> tuple[bytes, int]:
    """Well-formed zstd payloads with hostile contents: reaches the checks past decompression."""
    w = draw(st.sampled_from([1, 2, 4, 8]))
    elems = draw(st.integers(1, 2 * SMALL + 50))
    n = elems * w
    nb = -(-elems // SMALL)
    recs = []
    for i in range(nb):
        b = min(SMALL, elems - i * SMALL)
        mode = draw(st.integers(0, 2))
        if mode == 0:
            recs.append((0, 0, 0, b""))
        elif mode == 2:
            raw = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).integers(0, 256, b * w, dtype=np.uint8)
            recs.append((2, 0, 0, _z(raw.tobytes() if draw(st.booleans()) else bytes(b * w))))
        else:
            k = draw(st.integers(1, min(b, 40)))
            e = draw(st.integers(0, k))
            gaps = draw(st.lists(st.integers(0, 300), min_size=k, max_size=k))
            g8 = bytes(min(g, 255) for g in gaps)
            over = b"".join(struct.pack("<I", draw(st.integers(0, 2 * b))) for _ in range(e))
            vals = draw(st.binary(min_size=k * w, max_size=k * w))
            recs.append((1, k, e, _z(g8 + over + vals)))
    return _stream(n, recs, w=w), n


@settings(max_examples=300, deadline=None)
@given(case=_forged())
def test_fuzz_forged_payloads_raise_only_protocol_errors(case: tuple[bytes, int]) -> None:
    stream, n = case
    base = np.zeros(n, np.uint8)
    out = np.empty_like(base)
    try:
        arc.decode_xor_into(stream, base, out, FMT)
    except ProtocolError as e:
        assert "\n" not in str(e)


@pytest.mark.usefixtures("small_blocks")
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_mangled(), workers=st.sampled_from([1, 3]))
def test_fuzz_apply_diff_names_the_tensor(tmp_path: Path, case: tuple[bytes, int], workers: int) -> None:
    stream, n = case
    base = {"a": np.arange(n, dtype=np.uint64).astype(np.uint8), "b": np.ones(3, np.uint8)}
    fileops.save(tmp_path / "base", base)
    fileops.save_raw(
        tmp_path / "diff",
        {"a": ("U8", (len(stream),), stream), "b": ("U8", (37,), _stream(3, [(0, 0, 0, b"")]))},
        {"a": "1", "b": "1"},
    )
    diff = (tmp_path / "diff").read_bytes()
    with pytest.raises(ProtocolError, match=r"tensor '[ab]'"):
        _apply(tmp_path / "base", diff, workers)


# --- end to end: publisher -> three real bdnd processes ---------------------------------------


@pytest.mark.usefixtures("small_blocks")  # in the publisher: the daemons then decode many blocks per tensor
def test_published_planes_delta_rebuilds_bit_exactly_on_three_daemons(tmp_path: Path) -> None:
    from bdn.bucket import open_bucket
    from bdn.proto.manifest import Manifest
    from bdn.publish import publish_delta, publish_full, publish_startup
    from support.checkpoints import make_state, optimizer_step, write_hf_dir
    from support.swarm import Swarm

    bucket = f"file://{tmp_path}/bucket"
    states = [make_state(0, scale=4)]
    states += [optimizer_step(states[0], 0.02, 1)]
    states += [optimizer_step(states[1], 0.3, 2)]  # dense blocks too
    dirs = [write_hf_dir(tmp_path / f"trainer/ck{i}", s, i) for i, s in enumerate(states)]
    b = open_bucket(bucket)
    try:
        publish_full(b, "step000001", 1, dir=dirs[0], chunk_size=64 << 10)
        m2 = publish_delta(
            b, "step000002", 2, "step000001", dir=dirs[1], base_dir=dirs[0], compression_format=FMT, chunk_size=64 << 10
        )
        m3 = publish_delta(
            b, "step000003", 3, "step000002", dir=dirs[2], base_dir=dirs[1], compression_format=FMT, chunk_size=64 << 10
        )
        publish_startup(b, "step000001")
    finally:
        b.close()
    assert isinstance(m2, Manifest) and m2.compression_format == m3.compression_format == FMT
    with Swarm(tmp_path / "nodes", 3, bucket) as swarm:
        for d in swarm.daemons:
            d.wait_ready("step000001")
        for d in swarm.daemons:
            assert d.prefetch("step000003")[0] == 202
        for d in swarm.daemons:
            assert d.wait_ready("step000003")["policy_version"] == 3
        for d in swarm.daemons:
            got = Path(d.get("/v1/snapshots/step000003")["path"])
            for f in dirs[2].iterdir():
                assert (got / f.name).read_bytes() == f.read_bytes(), (d.node_id, f.name)
