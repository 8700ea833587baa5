"""The fetcher's chunk buffer pool stays bounded whatever sizes pass through it.

The soak (bench/soak) found the daemon's heap growing by about 1 MB per hot-load: the pool kept
up to ``keep`` buffers for every distinct size, and the last chunk of every published file has a
size of its own. These tests pin the bound.
"""

from __future__ import annotations

from bdn.daemon.fetch.sources import BufferPool


def test_many_distinct_sizes_keep_at_most_keep_buffers() -> None:
    pool = BufferPool(keep=4)
    for size in range(1000, 1500):  # 500 different last-chunk sizes, one at a time
        pool.put(pool.get(size))
    assert pool.free_bytes <= 4 * 1499


def test_buffers_are_reused_for_the_common_size() -> None:
    pool = BufferPool(keep=3)
    a, b = pool.get(1 << 16), pool.get(1 << 16)
    pool.put(a)
    pool.put(b)
    assert {id(pool.get(1 << 16)), id(pool.get(1 << 16))} == {id(a), id(b)}


def test_least_recently_used_size_is_dropped_first() -> None:
    pool = BufferPool(keep=2)
    big = pool.get(100)
    pool.put(big)
    pool.put(pool.get(7))
    pool.put(pool.get(8))  # a third buffer: the oldest size (100) goes
    assert pool.get(100) is not big
    assert pool.free_bytes == 7 + 8


def test_keep_zero_pools_nothing() -> None:
    pool = BufferPool(keep=0)
    pool.put(pool.get(10))
    assert pool.free_bytes == 0


def test_free_bytes_stay_under_max_bytes_whatever_keep_allows() -> None:
    """keep = 24 buffers of 16 MiB would hold 384 MiB; the byte bound keeps 4 of them."""
    pool = BufferPool(keep=24, max_bytes=4 * 1000)
    bufs = [pool.get(1000) for _ in range(24)]
    for b in bufs:
        pool.put(b)
    assert pool.free_bytes == 4 * 1000
    pool.put(pool.get(5000))  # one buffer over the bound alone is not kept
    assert pool.free_bytes == 4 * 1000
    assert len({id(pool.get(1000)) for _ in range(4)}) == 4  # the kept ones are reused
    assert pool.free_bytes == 0


def test_buffers_are_anonymous_mappings_outside_the_heap() -> None:
    """A chunk buffer is an anonymous mapping (glibc never carves it from its heap, and returns
    it to the system when dropped), usable wherever a bytearray was: memoryview writes, slice
    assignment into a target mapping, len."""
    import mmap

    pool = BufferPool(keep=2)
    buf = pool.get(3 << 20)
    assert isinstance(buf, mmap.mmap) and len(buf) == 3 << 20
    import ctypes

    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    with open("/proc/self/maps") as f:  # private: MAP_SHARED anonymous memory is shmem, not RssAnon
        perms = [
            line.split()[1]
            for line in f
            if int(line.split()[0].split("-")[0], 16) <= addr < int(line.split()[0].split("-")[1], 16)
        ]
    assert perms == ["rw-p"]
    assert buf[:4] == b"\0\0\0\0"  # zeroed like bytearray(n)
    memoryview(buf)[10:13] = b"abc"
    target = mmap.mmap(-1, 4 << 20)
    target[100 : 100 + len(buf)] = buf
    assert target[110:113] == b"abc"
    assert len(pool.get(0)) == 0  # a mapping cannot be empty: an empty bytearray
    pool.put(pool.get(0))
    assert pool.free_bytes == 0


def test_clear_drops_every_free_buffer() -> None:
    """What one download's races needed is not held until the next (Fetcher.fetch_layer clears
    the pool when no download runs)."""
    pool = BufferPool(keep=8)
    bufs = [pool.get(1 << 20) for _ in range(3)]
    for b in bufs:
        pool.put(b)
    assert pool.free_bytes == 3 << 20
    pool.clear()
    assert pool.free_bytes == 0
    assert all(pool.get(1 << 20) is not b for b in bufs)
    pool.put(pool.get(5))  # usable after a clear, its counts start again from zero
    assert pool.free_bytes == 5
