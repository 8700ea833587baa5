"""The injected clock every daemon policy takes, so timing is tested with a fake clock, not sleeps.

``monotonic()`` (s, for durations and deadlines), ``time()`` (s since the epoch, for records
and signatures) and ``time_ns()`` (ns since the epoch, the hot-load target order). ``SYSTEM`` is
the real clock; tests pass a :class:`FakeClock` and move it with ``advance``.
"""

from __future__ import annotations

import time as _time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float: ...
    def time(self) -> float: ...
    def time_ns(self) -> int: ...


class SystemClock:
    """The process's clocks (``time.monotonic``, ``time.time``, ``time.time_ns``)."""

    def monotonic(self) -> float:
        return _time.monotonic()

    def time(self) -> float:
        return _time.time()

    def time_ns(self) -> int:
        return _time.time_ns()


class FakeClock:
    """A clock that moves only when told: ``advance(seconds)``; starts at ``start`` (s)."""

    def __init__(self, start: float = 1_000_000.0) -> None:
        self.now = float(start)

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now

    def time_ns(self) -> int:
        return int(self.now * 1e9)


SYSTEM: Clock = SystemClock()
