"""The event-loop lateness probe's bookkeeping (bdn.daemon.observe.looplag): the largest lag of the last
window, wall and CPU, and the counts of probes late by more than 100 ms."""

from __future__ import annotations

from bdn.daemon.observe.looplag import SLOW_S, LoopLag


def test_max_is_over_the_last_window_and_slow_counts_since_the_start() -> None:
    lag = LoopLag(window=3)
    assert (lag.max_s, lag.cpu_max_s, lag.slow, lag.slow_cpu) == (0.0, 0.0, 0, 0)
    lag.record(0.5, 0.01)  # late on the wall clock, little of it the process's own CPU time
    lag.record(0.02, 0.02)
    assert (lag.max_s, lag.cpu_max_s, lag.slow, lag.slow_cpu) == (0.5, 0.02, 1, 0)
    lag.record(SLOW_S + 0.1, SLOW_S + 0.05)
    lag.record(0.0, 0.0)  # the 0.5 s probe leaves the window of 3
    assert lag.max_s == SLOW_S + 0.1 and lag.cpu_max_s == SLOW_S + 0.05
    assert (lag.slow, lag.slow_cpu) == (2, 1)
    for _ in range(3):
        lag.record(0.0)
    assert (lag.max_s, lag.cpu_max_s, lag.slow, lag.slow_cpu) == (0.0, 0.0, 2, 1)
