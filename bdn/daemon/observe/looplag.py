"""How late the event loop runs: a probe that sleeps ``interval_s`` over and over and records
how much later than asked it woke up (the rule it watches: no step may block the loop for more
than about 100 ms). ``/metrics`` shows the largest lag of the last window and the count of probes
that were late by more than ``SLOW_S``. Beside the wall lateness, each probe records the
``cpu`` lateness: the wall lateness, at most the CPU time the event loop's own thread spent
between the probe's sleep and its wake-up (``time.thread_time``). That is the part a step on the
loop itself caused; the rest is waiting for a CPU (a loaded machine) or for the GIL (a worker
thread in one long C call: bench/manifest_parse measures those)."""

from __future__ import annotations

import asyncio
import time
from collections import deque

from bdn.daemon.process.clock import SYSTEM, Clock

SLOW_S = 0.1


class LoopLag:
    """``run()`` probes until cancelled; ``max_s`` is the largest lag (s) over the last
    ``window`` probes, ``slow`` counts probes later than ``SLOW_S`` since the start."""

    def __init__(self, clock: Clock = SYSTEM, interval_s: float = 0.05, window: int = 1200) -> None:
        self.clock = clock
        self.interval_s = interval_s
        self._lags: deque[float] = deque(maxlen=window)
        self._cpu_lags: deque[float] = deque(maxlen=window)
        self.slow = 0
        self.slow_cpu = 0

    def record(self, lag_s: float, cpu_lag_s: float = 0.0) -> None:
        """One probe woke ``lag_s`` seconds late (wall), ``cpu_lag_s`` by the CPU estimate."""
        self._lags.append(lag_s)
        self._cpu_lags.append(cpu_lag_s)
        if lag_s > SLOW_S:
            self.slow += 1
        if cpu_lag_s > SLOW_S:
            self.slow_cpu += 1

    @property
    def max_s(self) -> float:
        """The largest wall-clock lag (seconds) over the window, 0.0 before the first probe."""
        return max(self._lags, default=0.0)

    @property
    def cpu_max_s(self) -> float:
        """The largest lag (seconds) the loop's own CPU time accounts for, over the window."""
        return max(self._cpu_lags, default=0.0)

    async def run(self) -> None:
        """Sleep ``interval_s`` and :meth:`record` how late the wake-up was, until cancelled."""
        while True:
            t0, c0 = self.clock.monotonic(), time.thread_time()
            await asyncio.sleep(self.interval_s)
            lag = max(0.0, self.clock.monotonic() - t0 - self.interval_s)
            self.record(lag, min(lag, max(0.0, time.thread_time() - c0)))
