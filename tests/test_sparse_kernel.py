"""The sparse apply's compiled kernel (bdn/proto/sparse_kernel.py) against its numpy path.

Promises checked, on real safetensors files and real ``bdn_planes_v1`` diffs: for random diffs
(every word width, first and last word, unchanged, light, heavy and dense blocks, escaped gaps,
runs cut anywhere, serial and on 2 threads, base checksums known or not) both paths write the
same bytes, the target's, and return the same Adler-32s, ranges and counts; hand-built hostile
blocks (a gap of 0, escapes that do not add up, an escaped gap below 255, an index past its
block), light ones and heavy ones (XORed by ``xor_block`` on the fused path), fail with the same
ProtocolError on both paths and never change a byte outside the block; the kernel that XORs
heavy blocks writes the same words as numpy for every width, dense or sparse; without the kernel
the apply runs on numpy.
"""

from __future__ import annotations

import struct
import tempfile
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bdn import fileops
from bdn.proto import arc, diff_file, planes, sparse, sparse_kernel
from bdn.proto.errors import ProtocolError

BLOCK = 4096  # the decoder's smallest block: many blocks from small tensors


def _needs_kernel() -> None:
    if not sparse_kernel.available():
        pytest.skip("numba is not installed: the kernel's numpy path is all there is")


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.setattr(planes, "PLANES_BLOCK", BLOCK)
    return monkeypatch


def _both(
    base_path: Path, diff_path: Path, known: dict[str, int] | None
) -> tuple[tuple[bytes, sparse.SparseResult], tuple[bytes, sparse.SparseResult]]:
    """The apply of ``diff_path`` to a copy of ``base_path``, fused and numpy: (bytes, result) each."""
    header = fileops.read_header(base_path)
    d = np.fromfile(diff_path, dtype=np.uint8)
    _, streams = arc.read_diff_header(d, len(d))
    out = []
    for fused in (True, False):
        buf = np.fromfile(base_path, dtype=np.uint8)
        res = sparse.apply_sparse(buf, header, d, streams, known, map=fileops.thread_map(2), fused=fused)
        out.append((buf.tobytes(), res))
    return out[0], out[1]


DTYPES = {1: np.uint8, 2: ml_dtypes.bfloat16, 4: np.float32, 8: np.int64}


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**32 - 1),
    w=st.sampled_from([1, 2, 4, 8]),
    blocks=st.integers(1, 5),
    tail=st.integers(0, BLOCK - 1),
    density=st.sampled_from([0.0002, 0.003, 0.02, 0.09, 0.5]),
    edges=st.booleans(),
    run=st.integers(1, 4),
    threads=st.booleans(),
    know=st.booleans(),
)
def test_fused_and_numpy_write_the_same_bytes_sums_and_ranges(
    small_blocks: pytest.MonkeyPatch,
    seed: int,
    w: int,
    blocks: int,
    tail: int,
    density: float,
    edges: bool,
    run: int,
    threads: bool,
    know: bool,
) -> None:
    _needs_kernel()
    small_blocks.setattr(sparse, "RUN_BLOCKS", run)
    small_blocks.setattr(sparse, "SERIAL_BYTES", 0 if threads else 1 << 40)
    rng = np.random.default_rng(seed)
    words = blocks * BLOCK + tail
    base = {
        "big": rng.integers(0, 256, words * w, dtype=np.uint8).view(DTYPES[w]),
        "small": rng.integers(0, 256, 300 * w, dtype=np.uint8).view(DTYPES[w]),
        "same": rng.integers(0, 256, 100 * w, dtype=np.uint8).view(DTYPES[w]),
    }
    target = {k: v.copy() for k, v in base.items()}
    for name in ("big", "small"):
        bits = target[name].view(f"<u{w}")
        hit = np.flatnonzero(rng.random(len(bits)) < density)
        if name == "big" and blocks > 1:  # block 1 unchanged, then one lone change 3000 words on (escaped gap)
            hit = hit[(hit < BLOCK) | (hit >= 2 * BLOCK)]
            hit = np.union1d(hit, [BLOCK + 3000])
        if edges:
            hit = np.union1d(hit, [0, len(bits) - 1])
        if len(hit) == 0:
            hit = np.array([len(bits) // 2])
        bits[hit] ^= rng.integers(1, 1 << (8 * w) if w < 8 else 2**63, len(hit), dtype=np.uint64).astype(f"<u{w}")
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        fileops.save(t / "b", base)
        fileops.save(t / "t", target)
        fileops.write_diff_file(t / "b", t / "t", t / "x", "bdn_planes_v1")
        header = fileops.read_header(t / "b")
        b0 = np.fromfile(t / "b", dtype=np.uint8)
        known = {n: zlib.adler32(b0[i.start : i.end].tobytes()) for n, i in header.tensors.items()} if know else None
        (fb, fr), (nb, nr) = _both(t / "b", t / "x", known)
        want = (t / "t").read_bytes()
    assert fb == want and nb == want
    assert fr == nr  # adlers, ranges, written, checksummed: all equal
    tgt = np.frombuffer(want, dtype=np.uint8)
    for name, info in header.tensors.items():
        assert fr.adlers[name] == zlib.adler32(tgt[info.start : info.end].tobytes())
    changed = np.flatnonzero(b0 != tgt)
    covered = np.zeros(len(tgt), dtype=bool)
    for ranges in fr.ranges.values():
        for lo, hi in ranges:
            covered[lo:hi] = True
    assert covered[changed].all() and set(fr.ranges) == {"big", "small"}


def _z(raw: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=3).compress(raw)


def _stream(n: int, recs: list[tuple[int, int, int, bytes]], w: int = 2) -> bytes:
    """A ``bdn_planes_v1`` stream from the layout in bdn/proto/planes.py: header, records, payloads."""
    head = struct.pack("<4sBBHQII", b"BDNP", 1, w, 0, n, BLOCK, len(recs))
    return head + b"".join(struct.pack("<BIII", m, k, e, len(p)) for m, k, e, p in recs) + b"".join(p for *_, p in recs)


def _sparse_payload(gaps: list[int], escapes: list[int], vals: list[int]) -> bytes:
    """A sparse block's payload for w = 2: gap bytes, escaped gaps (u32), two byte planes."""
    planes_ = bytes(v & 0xFF for v in vals) + bytes(v >> 8 for v in vals)
    return _z(bytes(gaps) + b"".join(struct.pack("<I", e) for e in escapes) + planes_)


GOOD = (1, 3, 1, _sparse_payload([5, 255, 1], [2000], [0x0101, 0x0202, 0x0303]))
HOSTILE = {
    "a gap of 0": ((1, 2, 0, _sparse_payload([5, 0], [], [1, 2])), "a gap of 0 between changed elements"),
    "more escapes than recorded": (
        (1, 2, 0, _sparse_payload([5, 255], [], [1, 2])),
        "escaped gaps, the block record says 0",
    ),
    "fewer escapes than recorded": (
        (1, 2, 1, _sparse_payload([5, 6], [300], [1, 2])),
        "escaped gaps, the block record says 1",
    ),
    "an escaped gap below 255": ((1, 1, 1, _sparse_payload([255], [254], [1])), "an escaped gap below 255"),
    "an index past the block": (
        (1, 1, 1, _sparse_payload([255], [BLOCK + 1], [1])),
        "lies past the block's 4096 elements",
    ),
    "the last gap past the block": ((1, 2, 1, _sparse_payload([255, 200], [4000], [1, 2])), "lies past the block"),
}
# Heavy blocks (>= 1/16 of the bytes: 300 of 4096 bf16 words), XORed by sparse_kernel.xor_block
# on the fused path: the bad field sits after 150 good words, which the kernel has XORed by then.
_H = [1] * 150
HOSTILE.update(
    {
        "heavy: a gap of 0": ((1, 300, 0, _sparse_payload(_H + [0] + [1] * 149, [], [1] * 300)), "a gap of 0 between"),
        "heavy: more escapes than recorded": (
            (1, 300, 0, _sparse_payload(_H + [255] + [1] * 149, [], [1] * 300)),
            "escaped gaps, the block record says 0",
        ),
        "heavy: fewer escapes than recorded": (
            (1, 300, 1, _sparse_payload([1] * 300, [300], [1] * 300)),
            "escaped gaps, the block record says 1",
        ),
        "heavy: an escaped gap below 255": (
            (1, 300, 1, _sparse_payload(_H + [255] + [1] * 149, [254], [1] * 300)),
            "an escaped gap below 255",
        ),
        "heavy: an index past the block": (
            (1, 300, 1, _sparse_payload(_H + [255] + [1] * 149, [BLOCK], [1] * 300)),
            "lies past the block's 4096 elements",
        ),
    }
)


@pytest.mark.parametrize("case", sorted(HOSTILE))
@pytest.mark.parametrize("bad_block", [0, 1])
def test_hostile_blocks_fail_alike_on_both_paths_and_write_nothing_outside_them(
    tmp_path: Path, case: str, bad_block: int
) -> None:
    _needs_kernel()
    rec, message = HOSTILE[case]
    n = 3 * BLOCK * 2  # three blocks of 4096 bf16 words
    recs = [GOOD, GOOD, GOOD]
    recs[bad_block] = rec
    rng = np.random.default_rng(7)
    base = {
        "t": rng.integers(0, 256, n, dtype=np.uint8).view(ml_dtypes.bfloat16),
        "u": np.zeros(64, ml_dtypes.bfloat16),
    }
    fileops.save(tmp_path / "b", base)
    fileops.save_raw(
        tmp_path / "x",
        *diff_file.content({"t": _stream(n, recs), "u": _stream(128, [(0, 0, 0, b"")])}, {"t": "1", "u": "1"}),
    )
    header = fileops.read_header(tmp_path / "b")
    d = np.fromfile(tmp_path / "x", dtype=np.uint8)
    _, streams = arc.read_diff_header(d, len(d))
    t = header.tensors["t"]
    lo = t.start + bad_block * BLOCK * 2
    errors = []
    for fused in (True, False):
        buf = np.fromfile(tmp_path / "b", dtype=np.uint8)
        before = buf.copy()
        with pytest.raises(ProtocolError) as err:
            sparse.apply_sparse(buf, header, d, streams, None, fused=fused)
        errors.append(str(err.value))
        # nothing past the bad block changed (its own words up to the bad field may have)
        assert buf[lo + BLOCK * 2 :].tobytes() == before[lo + BLOCK * 2 :].tobytes()
        assert buf[: t.start].tobytes() == before[: t.start].tobytes()
    assert errors[0] == errors[1], errors
    assert f"bdn_planes_v1 block {bad_block}: " in errors[0] and message in errors[0], errors[0]


def test_a_good_hand_built_block_applies_alike(tmp_path: Path) -> None:
    _needs_kernel()
    n = BLOCK * 2
    base = {"t": np.zeros(BLOCK, ml_dtypes.bfloat16)}
    fileops.save(tmp_path / "b", base)
    want = np.zeros(BLOCK, np.uint16)
    want[[4, 2004, 2005]] = [0x0101, 0x0202, 0x0303]
    adler = str(zlib.adler32(want.tobytes()))
    fileops.save_raw(tmp_path / "x", *diff_file.content({"t": _stream(n, [GOOD])}, {"t": adler}))
    (fb, fr), (nb, nr) = _both(tmp_path / "b", tmp_path / "x", None)
    header = fileops.read_header(tmp_path / "b")
    t = header.tensors["t"]
    assert fb == nb and fb[t.start : t.end] == want.tobytes() and fr == nr
    assert fr.ranges == {"t": [(t.start, t.start + 4096)]} and fr.written == 6 and fr.checksummed == n


def test_without_the_kernel_the_apply_runs_on_numpy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sparse_kernel, "_kernel", False)  # as where numba is absent or failed to compile
    assert not sparse_kernel.available() and not sparse_kernel.warm()
    assert (
        sparse_kernel.run(
            np.zeros(8, np.uint16), np.zeros(3, np.uint8), np.zeros((1, 5), np.int64), 16, np.zeros((1, 2), np.int64)
        )
        is None
    )
    assert sparse_kernel.xor_block(np.zeros(8, np.uint16), np.zeros(3, np.uint8), 1, 0) is None
    rng = np.random.default_rng(3)
    base = {"t": rng.integers(0, 256, 20000, dtype=np.uint8).view(ml_dtypes.bfloat16)}
    target = {"t": base["t"].copy()}
    target["t"].view(np.uint16)[::97] ^= 5
    target["t"].view(np.uint16)[:4096:2] ^= 3  # a heavy block too
    fileops.save(tmp_path / "b", base)
    fileops.save(tmp_path / "t", target)
    fileops.write_diff_file(tmp_path / "b", tmp_path / "t", tmp_path / "x", "bdn_planes_v1")
    (fb, fr), (nb, nr) = _both(tmp_path / "b", tmp_path / "x", None)
    assert fb == nb == (tmp_path / "t").read_bytes() and fr == nr


def test_warm_loads_the_kernel_for_every_width() -> None:
    _needs_kernel()
    assert sparse_kernel.warm() is True
    for w in (1, 2, 4, 8):  # the word at index 0 of a 4096-byte tensor: XOR 1, sums from byte 0 alone
        words = np.zeros(4096 // w, dtype=f"<u{w}")
        raw = np.array([1, 1] + [0] * (w - 1), dtype=np.uint8)
        runs = np.empty((1, 2), np.int64)
        got = sparse_kernel.run(words, raw, np.array([[0, 1, 0, 0, len(words)]], np.int64), 4096, runs)
        assert got == (sparse_kernel.OK, 1, 1, 4096, 1) and words[0] == 1 and runs.tolist() == [[0, 1]]


@pytest.mark.parametrize("w", [1, 2, 4, 8])
def test_xor_block_writes_what_numpy_writes_for_every_width_dense_or_sparse(w: int) -> None:
    _needs_kernel()
    rng = np.random.default_rng(w)
    dt = np.dtype(f"<u{w}")
    base = rng.integers(0, 256, 5000 * w, dtype=np.uint8).view(dt)
    # sparse: every third word, then one lone word 1,000 on (an escaped gap), the last word
    idx = np.concatenate((np.arange(0, 3000, 3), [3999, 4999]))
    x = rng.integers(1, 256, (len(idx), w), dtype=np.uint8)  # nonzero low byte: every word changes
    gaps = np.diff(idx, prepend=-1)
    raw = np.concatenate((np.minimum(gaps, 255).astype(np.uint8), gaps[gaps >= 255].astype("<u4").view(np.uint8)))
    raw = np.concatenate((raw, np.ascontiguousarray(x.T).reshape(-1)))
    words = base.copy()
    st = sparse_kernel.xor_block(words, np.frombuffer(raw.tobytes(), np.uint8), len(idx), int((gaps >= 255).sum()))
    want = base.copy()
    want[idx] ^= x.copy().view(dt).reshape(-1)
    assert st == sparse_kernel.OK and words.tobytes() == want.tobytes()
    # dense: w planes of every word's XOR
    xd = rng.integers(0, 256, (len(base), w), dtype=np.uint8)
    words = base.copy()
    assert sparse_kernel.xor_block(words, np.ascontiguousarray(xd.T).reshape(-1), 0, 0) == sparse_kernel.OK
    assert words.tobytes() == (base ^ xd.copy().view(dt).reshape(-1)).tobytes()
    # an index past the block: BAD, the words before it XORed, none at or after it
    words = base.copy()
    bad = np.concatenate((np.ones(10, np.uint8), [255], np.zeros(4, np.uint8), np.ones(11 * w, np.uint8)))
    bad[11:15] = np.frombuffer(struct.pack("<I", 5000), np.uint8)
    assert sparse_kernel.xor_block(words, bad, 11, 1) == sparse_kernel.BAD
    assert (words[:10] != base[:10]).all() and words[10:].tobytes() == base[10:].tobytes()
