"""``bdn.daemon.apply.seed`` on real safetensors files (DESIGN.md, "Sparse apply", seeds): the copy
is byte-identical, every chunk of it is checked against READY's digest (a chunk that differs is
refused, naming it), each tensor's Adler-32 is the zlib value of its bytes, a rate bound holds
until ``hurry`` lifts it, and ``cancel`` abandons the copy."""

from __future__ import annotations

import mmap
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest

from bdn import fileops
from bdn.daemon.apply.seed import Cancelled, copy_file, verify_copy
from bdn.proto.errors import ProtocolError

pytestmark = pytest.mark.timeout(120)

CHUNK = 64 << 10


def _model(tmp_path: Path) -> Path:
    rng = np.random.default_rng(7)
    tensors = {
        "a.weight": rng.integers(0, 2**16, size=(300, 257), dtype=np.uint16),  # spans chunk edges
        "b.bias": rng.integers(0, 2**16, size=(3,), dtype=np.uint16),
        "c.empty": np.zeros((0,), dtype=np.uint16),
        "d.weight": rng.integers(0, 2**16, size=(128, 1024), dtype=np.uint16),
    }
    p = tmp_path / "model.safetensors"
    fileops.save(p, tensors)
    return p


def _buffer(tmp_path: Path, size: int) -> Path:
    p = tmp_path / f"buffer-{size}"
    p.unlink(missing_ok=True)
    with open(p, "wb") as fh:
        fh.truncate(size)
    return p


def _mapped(p: Path) -> mmap.mmap:
    with open(p, "r+b") as fh:
        return mmap.mmap(fh.fileno(), 0)


def test_the_copy_is_exact_verified_and_gives_every_tensors_adler32(tmp_path: Path) -> None:
    src = _model(tmp_path)
    digests = fileops.chunk_digests(src, CHUNK)
    header = fileops.read_header(src)
    dst = _buffer(tmp_path, src.stat().st_size)
    assert copy_file(src, dst, CHUNK) == src.stat().st_size
    raw = src.read_bytes()
    assert dst.read_bytes() == raw
    adlers = verify_copy(_mapped(dst), CHUNK, digests, header, "model")
    assert adlers == {t.name: zlib.adler32(raw[t.start : t.end]) for t in header.tensors.values()}
    assert adlers["c.empty"] == 1


def test_a_chunk_that_is_not_readys_is_refused_by_name(tmp_path: Path) -> None:
    src = _model(tmp_path)
    digests = fileops.chunk_digests(src, CHUNK)
    digests[2] = "0" * 32  # READY says other bytes than the file holds there
    header = fileops.read_header(src)
    dst = _buffer(tmp_path, src.stat().st_size)
    copy_file(src, dst, CHUNK)
    with pytest.raises(ProtocolError, match="chunk 2 copied does not match"):
        verify_copy(_mapped(dst), CHUNK, digests, header, "model")
    with pytest.raises(ProtocolError, match="chunks, READY lists"):
        verify_copy(_mapped(dst), CHUNK, digests[:-1], header, "model")
    with pytest.raises(ProtocolError, match="the buffer has"):
        copy_file(src, _buffer(tmp_path, src.stat().st_size + 1), CHUNK)
    with pytest.raises(ProtocolError, match="the buffer has"):
        verify_copy(_mapped(_buffer(tmp_path, src.stat().st_size + 1)), CHUNK, digests, header, "model")


def test_the_rate_holds_until_hurry_and_cancel_abandons(tmp_path: Path) -> None:
    src = _model(tmp_path)
    size = src.stat().st_size
    hurry = threading.Event()
    # one byte a second: the copy ends (at full speed) only because hurry is set meanwhile
    timer = threading.Timer(0.2, hurry.set)
    timer.start()
    copy_file(src, _buffer(tmp_path, size), CHUNK, rate=1.0, hurry=hurry)
    assert hurry.is_set()
    timer.join()
    cancel = threading.Event()
    threading.Timer(0.2, cancel.set).start()
    with pytest.raises(Cancelled):  # the same bound, abandoned between two chunks
        copy_file(src, _buffer(tmp_path, size), CHUNK, rate=1.0, hurry=cancel, cancel=cancel)


def test_a_rate_of_a_few_bits_a_day_waits_without_overflowing_the_clock(tmp_path: Path) -> None:
    """``sparse_seed_mbit`` 1e-12 (the config takes any finite rate >= 0): a chunk's wait on the
    bound is ~10^12 s, past what ``threading``'s timeouts hold (OverflowError killed the seed);
    it is waited in slices, and ``hurry`` still ends it at once."""
    src = _model(tmp_path)
    hurry = threading.Event()
    timer = threading.Timer(0.2, hurry.set)
    timer.start()
    rate = 1e-12 * 1e6 / 8  # bytes/s, as Forward.seed turns sparse_seed_mbit into
    assert copy_file(src, _buffer(tmp_path, src.stat().st_size), CHUNK, rate=rate, hurry=hurry) == src.stat().st_size
    timer.join()
