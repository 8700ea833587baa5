"""Tests for bdn.proto.chunks: chunk ranges and xxh3-128 digests (DESIGN.md, "Words: chunk")."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from bdn.proto.chunks import (
    DEFAULT_CHUNK_SIZE,
    DIGEST_RE,
    buffer_digests,
    chunk_range,
    digest,
    num_chunks,
)


def test_default_chunk_size_is_16_mib() -> None:
    assert DEFAULT_CHUNK_SIZE == 16 * 1024 * 1024


@pytest.mark.parametrize("data", [b"", b"a", b"hello world", bytes(range(256)) * 1000])
def test_digest_is_xxh3_128_hex(data: bytes) -> None:
    d = digest(data)
    assert d == xxhash.xxh3_128(data).hexdigest()
    assert d == format(xxhash.xxh3_128_intdigest(data), "032x")
    assert DIGEST_RE.match(d)


def test_digest_known_value_of_empty_input() -> None:
    # XXH3-128 of zero bytes with seed 0 (from the xxHash reference implementation's tests).
    assert digest(b"") == "99aa06d3014798d86001c324468d497f"


def test_digest_accepts_bytearray_memoryview_and_mmap(tmp_path: Path) -> None:
    data = os.urandom(10_000)
    want = xxhash.xxh3_128_hexdigest(data)
    assert digest(bytearray(data)) == want
    assert digest(memoryview(data)) == want
    assert digest(memoryview(b"xx" + data)[2:]) == want
    p = tmp_path / "blob"
    p.write_bytes(data)
    with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        assert digest(m) == want


@pytest.mark.parametrize(
    ("size", "chunk_size", "n"),
    [
        (0, 4096, 0),
        (1, 4096, 1),
        (4095, 4096, 1),
        (4096, 4096, 1),
        (4097, 4096, 2),
        (3 * 4096, 4096, 3),
        (3 * 4096 + 1, 4096, 4),
        (DEFAULT_CHUNK_SIZE * 10, DEFAULT_CHUNK_SIZE, 10),
        (1 << 50, 1 << 30, 1 << 20),
    ],
)
def test_num_chunks(size: int, chunk_size: int, n: int) -> None:
    assert num_chunks(size, chunk_size) == n


def test_chunk_range_exact_multiple() -> None:
    assert [chunk_range(12, 4, i) for i in range(3)] == [(0, 4), (4, 4), (8, 4)]
    with pytest.raises(IndexError):
        chunk_range(12, 4, 3)


def test_chunk_range_last_short() -> None:
    assert [chunk_range(10, 4, i) for i in range(3)] == [(0, 4), (4, 4), (8, 2)]
    with pytest.raises(IndexError):
        chunk_range(10, 4, 3)


def test_chunk_range_empty_object_has_no_chunks() -> None:
    with pytest.raises(IndexError):
        chunk_range(0, 4, 0)


def test_chunk_range_negative_index_refused() -> None:
    with pytest.raises(IndexError):
        chunk_range(10, 4, -1)


@given(st.integers(0, 1 << 40), st.integers(1, 1 << 30))
def test_chunk_ranges_tile_the_object(size: int, chunk_size: int) -> None:
    n = num_chunks(size, chunk_size)
    if n > 2000:  # check the ends only; the middle is the same arithmetic
        idx = [0, 1, n - 2, n - 1]
    else:
        idx = list(range(n))
    for i in idx:
        off, length = chunk_range(size, chunk_size, i)
        assert off == i * chunk_size
        assert 0 < length <= chunk_size
        if i < n - 1:
            assert length == chunk_size
        else:
            assert off + length == size
    with pytest.raises(IndexError):
        chunk_range(size, chunk_size, n)


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, 3 * 4096, 3 * 4096 + 17])
def test_buffer_digests_match_direct_slices(size: int) -> None:
    data = os.urandom(size)
    cs = 4096
    got = buffer_digests(data, cs)
    assert len(got) == num_chunks(size, cs)
    for i, d in enumerate(got):
        off, length = chunk_range(size, cs, i)
        assert d == xxhash.xxh3_128_hexdigest(data[off : off + length])


def test_buffer_digests_releases_its_view() -> None:
    buf = bytearray(os.urandom(10_000))
    buffer_digests(buf, 4096)
    buf.extend(b"more")  # would raise BufferError if a memoryview were still held


@given(st.binary(max_size=5000), st.integers(1, 600))
def test_buffer_digests_property(data: bytes, cs: int) -> None:
    got = buffer_digests(data, cs)
    assert got == [xxhash.xxh3_128_hexdigest(data[o : o + cs]) for o in range(0, len(data), cs)]
    assert len(got) == num_chunks(len(data), cs)
