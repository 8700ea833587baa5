"""Tests for bdn.fileops: chunk digests and verification on real files, verified writes and copies,
delta apply of real diff files (DESIGN.md, "Words: chunk" and "Delta formats")."""

from __future__ import annotations

import os
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from bdn import fileops
from bdn.proto.chunks import buffer_digests, digest
from bdn.proto.errors import ChecksumError, ProtocolError

CS = 4096


@pytest.mark.parametrize("size", [0, 1, 4096, 5 * 4096, 5 * 4096 + 123, 1 << 20])
def test_chunk_digests_equal_buffer_digests(tmp_path: Path, size: int) -> None:
    data = os.urandom(size)
    p = tmp_path / "model.safetensors"
    p.write_bytes(data)
    assert fileops.chunk_digests(p, CS) == buffer_digests(data, CS)
    assert fileops.chunk_digests(str(p), 64 << 10) == buffer_digests(data, 64 << 10)


def test_chunk_digests_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        fileops.chunk_digests(tmp_path / "nope", CS)


def test_verify_chunks_reports_the_matching_indices(tmp_path: Path) -> None:
    data = bytearray(os.urandom(3 * CS + 100))
    want = buffer_digests(bytes(data), CS)
    p = tmp_path / "f"
    data[CS + 5] ^= 1  # chunk 1 corrupted
    p.write_bytes(data)
    assert fileops.verify_chunks(p, CS, want) == [0, 2, 3]
    assert fileops.verify_chunks(p, CS, want, which=[3, 1]) == [3]
    with pytest.raises(IndexError):
        fileops.verify_chunks(p, CS, want, which=[4])


def test_verify_chunks_of_a_short_or_missing_file(tmp_path: Path) -> None:
    data = os.urandom(3 * CS + 100)
    want = buffer_digests(data, CS)
    p = tmp_path / "f"
    p.write_bytes(data[: 2 * CS + 10])  # a half-written file: chunks 0 and 1 are whole
    assert fileops.verify_chunks(p, CS, want, size=len(data)) == [0, 1]
    assert fileops.verify_chunks(tmp_path / "missing", CS, want) == []
    # Preallocated to the full size (zeros after the written part): the same answer.
    with open(p, "r+b") as f:
        f.truncate(len(data))
    assert fileops.verify_chunks(p, CS, want, size=len(data)) == [0, 1]


def test_first_mismatch(tmp_path: Path) -> None:
    data = bytearray(os.urandom(2 * CS + 7))
    want = buffer_digests(bytes(data), CS)
    p = tmp_path / "f"
    p.write_bytes(data)
    assert fileops.first_mismatch(p, CS, want) is None
    data[2 * CS] ^= 0xFF
    p.write_bytes(data)
    assert fileops.first_mismatch(p, CS, want) == (2, digest(bytes(data[2 * CS :])))
    p.write_bytes(data[:CS])
    assert fileops.first_mismatch(p, CS, want) == (1, "")
    p.write_bytes(b"")
    assert fileops.first_mismatch(p, CS, []) is None
    p.write_bytes(b"x")
    assert fileops.first_mismatch(p, CS, []) == (0, digest(b"x"))


def test_write_verified_writes_only_matching_bytes(tmp_path: Path) -> None:
    p = tmp_path / "f"
    p.write_bytes(bytes(2 * CS))
    good = os.urandom(CS)
    assert not fileops.write_verified(good, digest(b"other"), p, CS)
    assert p.read_bytes() == bytes(2 * CS)
    assert fileops.write_verified(memoryview(good), digest(good), p, CS)
    assert p.read_bytes() == bytes(CS) + good


@pytest.mark.parametrize("dst_dir", ["same", "shm"])
def test_copy_verified(tmp_path: Path, dst_dir: str) -> None:
    src = tmp_path / "src"
    data = os.urandom(3 * CS)
    src.write_bytes(data)
    base = tmp_path if dst_dir == "same" or not Path("/dev/shm").is_dir() else Path("/dev/shm")
    dst = base / f"bdn-test-copy-{os.getpid()}-{dst_dir}"
    try:
        dst.write_bytes(bytes(2 * CS))
        chunk = data[CS : 2 * CS]
        assert fileops.copy_verified(src, CS, dst, CS, CS, digest(chunk))
        assert dst.read_bytes() == bytes(CS) + chunk
        assert not fileops.copy_verified(src, 0, dst, 0, CS, digest(chunk))  # wrong bytes at that offset
        assert not fileops.copy_verified(src, 2 * CS + 10, dst, 0, CS, digest(chunk))  # source too short
    finally:
        dst.unlink(missing_ok=True)


def _pair(tmp_path: Path) -> tuple[Path, Path, dict[str, np.ndarray]]:
    rng = np.random.default_rng(7)
    base = {
        "w": rng.standard_normal((64, 33)).astype(ml_dtypes.bfloat16),
        "b": rng.standard_normal(17).astype(np.float32),
        "e": np.zeros(0, np.float32),
    }
    target = {k: v.copy() for k, v in base.items()}
    target["w"][3, :5] += 1
    target["b"][0] = 42
    bp, tp = tmp_path / "base.safetensors", tmp_path / "target.safetensors"
    fileops.save(bp, base, {"format": "pt"})
    fileops.save(tp, target, {"format": "pt"})
    return bp, tp, target


@pytest.mark.parametrize("fmt", ["arc_v1", "arc_v2", "bdn_planes_v1"])
@pytest.mark.parametrize("workers", [1, 3])
def test_apply_delta_file_rebuilds_the_target(tmp_path: Path, fmt: str, workers: int) -> None:
    bp, tp, _ = _pair(tmp_path)
    diff = tmp_path / "diff"
    fileops.write_diff_file(bp, tp, diff, fmt, workers=workers)
    out = tmp_path / "sub" / "out"
    out.parent.mkdir()
    fileops.apply_delta_file(bp, diff, out, fmt, tp.stat().st_size, workers=workers)
    assert out.read_bytes() == tp.read_bytes()
    # Into an existing, preallocated file (the daemon's staging file).
    out.write_bytes(bytes(tp.stat().st_size))
    fileops.apply_delta_file(bp, diff, out, fmt, tp.stat().st_size, workers=workers)
    assert out.read_bytes() == tp.read_bytes()


def test_apply_delta_file_errors_name_the_file_and_tensor(tmp_path: Path) -> None:
    bp, tp, target = _pair(tmp_path)
    diff = tmp_path / "diff"
    fileops.write_diff_file(bp, tp, diff, "arc_v2")
    size = tp.stat().st_size
    with pytest.raises(
        ProtocolError, match=r"^model\.safetensors: the delta rebuilds \d+ bytes but the manifest says 5$"
    ):
        fileops.apply_delta_file(bp, diff, tmp_path / "o1", "arc_v2", 5, name="model.safetensors")
    assert not (tmp_path / "o1").exists()  # refused before anything was written
    # A base that is not the diff's base: the Adler-32 of a rebuilt tensor fails, naming it.
    other = {k: v + 1 if v.size else v for k, v in target.items()}
    fileops.save(tmp_path / "other", other, {"format": "pt"})
    with pytest.raises(ChecksumError, match=r"^m\.st: adler32 mismatch for tensor '[wb]'"):
        fileops.apply_delta_file(tmp_path / "other", diff, tmp_path / "o2", "arc_v2", size, workers=2, name="m.st")


def test_save_and_read_header_round_trip(tmp_path: Path) -> None:
    _, tp, target = _pair(tmp_path)
    h = fileops.read_header(tp)
    assert set(h.tensors) == set(target)
    assert h.metadata == {"format": "pt"}
    assert h.file_size == tp.stat().st_size


def test_thread_map_keeps_order_and_reraises() -> None:
    run = fileops.thread_map(4)
    assert run(lambda x: x * 2, list(range(50))) == [x * 2 for x in range(50)]

    def boom(x: int) -> int:
        if x == 7:
            raise ValueError("seven")
        return x

    with pytest.raises(ValueError, match="seven"):
        run(boom, list(range(20)))
