"""Byte-rate limits for a daemon's peer upload, peer download and bucket reads.

A token bucket in virtual time: each ``take(n)`` books ``n / rate`` seconds on the link and sleeps
until its booking starts, allowing a burst of ``burst_s`` seconds' worth of bytes. Written here
rather than taken from a library because it must be asyncio-native, shared by many coroutines,
and cost nothing when the limit is off.
"""

from __future__ import annotations

import asyncio

from bdn.daemon.process.clock import SYSTEM, Clock


class RateLimit:
    """``rate_bytes_s`` bytes per second on average (0 = unlimited)."""

    def __init__(self, rate_bytes_s: float, burst_s: float = 0.25, clock: Clock = SYSTEM) -> None:
        self.clock = clock
        self.rate = float(rate_bytes_s)
        self.burst_s = burst_s
        self._next = 0.0

    @classmethod
    def from_mbit(cls, mbit: float) -> RateLimit:
        """A limit of ``mbit`` megabits (10^6 bits) per second, kept as bytes per second; 0 is unlimited."""
        return cls(mbit * 1e6 / 8)

    @property
    def enabled(self) -> bool:
        """True when a rate is set (a positive limit)."""
        return self.rate > 0

    async def take(self, nbytes: int) -> None:
        """Wait until ``nbytes`` may cross the link."""
        if self.rate <= 0 or nbytes <= 0:
            return
        now = self.clock.monotonic()
        start = max(self._next, now - self.burst_s)
        self._next = start + nbytes / self.rate
        delay = start - now
        if delay > 0:
            await asyncio.sleep(delay)
