"""bdn/daemon/process/shutdown.py on real threads: idle pool workers do not hold the exit, busy ones are
waited for up to the bound and then named; the default executor's shutdown does not wait."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from bdn.daemon.process.shutdown import NoWaitExecutor, StopClock, busy_workers, join_workers
from support.api import wait_for


def test_idle_pool_workers_are_not_waited_for_and_busy_ones_are_named() -> None:
    idle_pool = ThreadPoolExecutor(1, thread_name_prefix="t-idle")
    busy_pool = ThreadPoolExecutor(1, thread_name_prefix="t-busy")
    release = threading.Event()
    try:
        idle_pool.submit(lambda: None).result()
        started = threading.Event()
        busy_pool.submit(lambda: (started.set(), release.wait(120)))
        started.wait(120)
        wait_for(
            lambda: not any(t.name.startswith("t-idle") for t in busy_workers()),
            120,
            "the idle worker counted busy",
            0.01,
        )
        left = join_workers(0.2)
        assert [t.name for t in left if t.name.startswith("t-")] == ["t-busy_0"]
        release.set()
        assert not [t for t in join_workers(120) if t.name.startswith("t-")]  # it went idle: not waited for
    finally:
        release.set()
        idle_pool.shutdown()
        busy_pool.shutdown()


def test_the_default_executor_shutdown_does_not_wait() -> None:
    ex = NoWaitExecutor(1)
    release = threading.Event()
    started = threading.Event()
    fut = ex.submit(lambda: (started.set(), release.wait(120)))
    queued = ex.submit(lambda: None)
    started.wait(120)
    ex.shutdown(wait=True)  # returns at once although the worker is busy
    assert not fut.done() and queued.cancelled()
    release.set()
    fut.result(120)


def test_stop_clock_counts_down_from_start_only() -> None:
    c = StopClock()  # no watchdog: this is not the bdnd process
    assert c.left() == float("inf")
    c.start(100.0)
    assert 0 < c.left() <= 100.0
    first = c.deadline
    c.start(1.0)  # once only
    assert c.deadline == first


def _marked_work(release: threading.Event, started: threading.Event) -> None:
    started.set()
    release.wait(120)


def test_a_worker_running_work_marked_as_holding_nothing_is_not_waited_for() -> None:
    """A stop during a compiled kernel's load (``holds_nothing``) does not wait for it; the same
    work unmarked is waited for and named."""
    from bdn.daemon.process import shutdown

    pool = ThreadPoolExecutor(2, thread_name_prefix="t-marked")
    release, started = threading.Event(), threading.Event()

    def unmarked(r: threading.Event, s: threading.Event) -> None:  # the same work, another code object
        s.set()
        r.wait(120)

    try:
        pool.submit(_marked_work, release, started)
        started.wait(120)
        assert [t.name for t in busy_workers() if t.name.startswith("t-marked")] == ["t-marked_0"]
        shutdown.holds_nothing(_marked_work)
        assert not [t for t in join_workers(0.2) if t.name.startswith("t-marked")]
        started2 = threading.Event()
        pool.submit(unmarked, release, started2)
        started2.wait(120)
        assert [t.name for t in join_workers(0.2) if t.name.startswith("t-marked")] == ["t-marked_1"]
    finally:
        shutdown._HOLDS_NOTHING.discard(_marked_work.__code__)
        release.set()
        pool.shutdown()
