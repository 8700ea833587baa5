"""Gives the C heap's free pages back to the system when the daemon is idle, so that its RSS
does not creep up over many hot-loads (docs/decisions/0025-flat-rss.md).

glibc returns a heap's free memory to the system by itself only from the top of each heap
(``M_TRIM_THRESHOLD``); free pages in the middle of a heap stay resident for as long as one block
above them lives. A daemon has a dozen threads, each with its own arena, whose small blocks come
and go with downloads, so the arenas' resident size creeps up with each hot-load (+2-3 MB over
15 arenas in an hour of hot-loads). ``malloc_trim(0)``
(malloc_trim(3), glibc >= 2.8) walks every arena and ``madvise(MADV_DONTNEED)``s each free page.

The fetcher runs :meth:`IdleTrim.maybe` on a disk thread when no download runs, at most once
per ``MIN_INTERVAL_S``. It costs a walk of the free lists under each arena's lock: 6 ms after
80 MB of small blocks were freed, 3 µs when nothing is free (tests/test_memtrim.py's pattern);
each call's duration is kept in ``IdleTrim.last_seconds``. Where the C library is not glibc (musl, macOS), :func:`trim` does nothing
and answers ``False``. ctypes is used rather than a package: nothing on PyPI wraps this one call.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from typing import Any

from bdn.daemon.process.clock import SYSTEM, Clock

#: Seconds between two trims at least (a burst of small downloads ending one after the other
#: does not walk the heaps each time).
MIN_INTERVAL_S = 30.0


def _load() -> Any:
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        libc = ctypes.CDLL(name)
        fn = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


_MALLOC_TRIM = _load()


def available() -> bool:
    """True when the C library has ``malloc_trim`` (glibc)."""
    return _MALLOC_TRIM is not None


def trim() -> bool:
    """``malloc_trim(0)``: every arena's free pages back to the system. Returns True when some
    memory was released, False when none was or the C library has no such call."""
    if _MALLOC_TRIM is None:
        return False
    return bool(_MALLOC_TRIM(0))


class IdleTrim:
    """``maybe()``: :func:`trim` unless one ran less than ``min_interval_s`` ago (injected clock).
    ``count`` trims done, ``last_seconds`` the last one's duration (wall, seconds)."""

    def __init__(self, clock: Clock = SYSTEM, min_interval_s: float = MIN_INTERVAL_S) -> None:
        self.clock = clock
        self.min_interval_s = min_interval_s
        self._last: float | None = None
        self.count = 0
        self.last_seconds = 0.0

    def due(self) -> bool:
        """True when a trim now would keep the interval."""
        return self._last is None or self.clock.monotonic() - self._last >= self.min_interval_s

    def maybe(self) -> bool:
        """Trim if due; True when a trim ran."""
        if not self.due():
            return False
        self._last = self.clock.monotonic()
        t0 = time.perf_counter()
        trim()
        self.last_seconds = time.perf_counter() - t0
        self.count += 1
        return True
