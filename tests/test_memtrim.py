"""bdn.daemon.observe.memtrim: the C heap's free pages go back to the system when the daemon is idle."""

from __future__ import annotations

import pytest

from bdn.daemon.observe import memtrim
from bdn.daemon.process.clock import FakeClock
from support.procmem import rss_anon_kib as _rss_anon_kb


def test_idle_trim_keeps_its_interval() -> None:
    clock = FakeClock()
    t = memtrim.IdleTrim(clock, min_interval_s=30.0)
    assert t.due() and t.maybe() and t.count == 1
    clock.advance(29.0)
    assert not t.due() and not t.maybe() and t.count == 1
    clock.advance(1.0)
    assert t.maybe() and t.count == 2
    assert t.last_seconds >= 0.0


@pytest.mark.skipif(not memtrim.available(), reason="the C library has no malloc_trim (not glibc)")
def test_trim_returns_free_pages_in_the_middle_of_the_heap() -> None:
    # 4,000-byte objects are glibc heap blocks (above pymalloc's 512 bytes, below the mmap
    # threshold). Free all but the last: their pages lie below a live block, so free() keeps
    # them resident; malloc_trim(0) gives them back.
    size = 4000
    blocks = [bytes([i % 251]) * size for i in range(20_000)]  # ~80 MB, written, so resident
    pin = b"y" * size  # above them in the heap
    before_free = _rss_anon_kb()
    del blocks
    after_free = _rss_anon_kb()
    assert memtrim.trim() is True
    after_trim = _rss_anon_kb()
    assert before_free - after_trim > 40_000, (before_free, after_free, after_trim)
    assert after_free - after_trim > 20_000, (before_free, after_free, after_trim)
    del pin
