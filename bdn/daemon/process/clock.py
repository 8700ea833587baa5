"""The injected clock every daemon policy takes, so timing is tested with a fake clock, not sleeps.

``monotonic()`` (s, for durations and deadlines), ``time()`` (s since the epoch, for records
and signatures) and ``time_ns()`` (ns since the epoch, the hot-load target order). ``SYSTEM`` is
the real clock; tests pass a :class:`FakeClock` and move it with ``advance``.
"""

from __future__ import annotations

import time as _time
from typing import Protocol


class Clock(Protocol):
    """What a policy reads the time from: ``SystemClock`` in the daemon, ``FakeClock`` in tests."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (durations, deadlines); arbitrary origin."""

    def time(self) -> float:
        """Seconds since the Unix epoch (records, signature timestamps); may jump."""

    def time_ns(self) -> int:
        """Nanoseconds since the Unix epoch."""


class SystemClock:
    """The process's clocks (``time.monotonic``, ``time.time``, ``time.time_ns``)."""

    def monotonic(self) -> float:
        """``time.monotonic()``, in seconds."""
        return _time.monotonic()

    def time(self) -> float:
        """``time.time()``, in seconds since the epoch."""
        return _time.time()

    def time_ns(self) -> int:
        """``time.time_ns()``, in nanoseconds since the epoch."""
        return _time.time_ns()


class FakeClock:
    """A clock that moves only when told: ``advance(seconds)``; starts at ``start`` (s)."""

    def __init__(self, start: float = 1_000_000.0) -> None:
        self.now = float(start)

    def advance(self, seconds: float) -> None:
        """Move every reading forward by ``seconds`` (negative values move it back)."""
        self.now += seconds

    def monotonic(self) -> float:
        """The fake time, in seconds (the same value as ``time``)."""
        return self.now

    def time(self) -> float:
        """The fake time, in seconds since the epoch."""
        return self.now

    def time_ns(self) -> int:
        """The fake time, in integer nanoseconds."""
        return int(self.now * 1e9)


SYSTEM: Clock = SystemClock()
