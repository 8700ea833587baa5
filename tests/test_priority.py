"""Background threads run at a raised nice value (bdn/priority.py): the daemon's ``background``
pool, and threads a lowered thread starts (a ``fileops.thread_map`` inside a catch-up)."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from bdn.daemon.process.executors import Executors
from bdn.fileops import thread_map
from bdn.priority import lower_this_thread

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice is Linux's")


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def _in_thread(fn):  # type: ignore[no-untyped-def]  # (a test helper: any callable)
    out: list = []
    th = threading.Thread(target=lambda: out.append(fn()))
    th.start()
    th.join()
    return out[0]


def test_lower_this_thread_raises_only_the_calling_thread() -> None:
    before = _nice()
    got = _in_thread(lambda: (lower_this_thread(5), _nice()))
    assert got == (min(19, before + 5), min(19, before + 5))
    assert _nice() == before  # (the caller's own thread untouched)
    assert _in_thread(lambda: lower_this_thread(0)) == before
    assert _in_thread(lambda: lower_this_thread(40)) == 19  # capped


def test_threads_started_by_a_lowered_thread_inherit_it() -> None:
    before = _nice()

    def work() -> list[int]:
        lower_this_thread(7)
        return thread_map(2)(lambda _: _nice(), [0, 1, 2, 3])

    assert _in_thread(work) == [min(19, before + 7)] * 4


def test_the_daemon_background_pool_is_lowered_and_the_others_are_not() -> None:
    before = _nice()
    pools = Executors.create(2, background_nice=10)
    try:
        assert pools.background.submit(_nice).result(timeout=60) == min(19, before + 10)
        for pool in (pools.apply, pools.disk, pools.bucket):
            assert pool.submit(_nice).result(timeout=60) == before
    finally:
        pools.shutdown()
    flat = Executors.create(2, background_nice=0)
    try:
        assert flat.background.submit(_nice).result(timeout=60) == before
    finally:
        flat.shutdown()


def test_the_engine_ping_pong_catch_up_runs_lowered() -> None:
    from bdn.engines.hf_pingpong import Kept, PingPong

    before = _nice()
    pp = PingPong(background_nice=6)
    pp.holds, pp.kept = "step1", Kept("step1", "step2", [], False)
    seen: list[int] = []
    th = pp.catch_up(lambda: seen.append(_nice()) or False)  # (asked on the catch-up thread)
    assert th is not None
    pp.wait()
    assert seen == [min(19, before + 6)]
    assert pp.holds == "step2" and pp.kept is None


def _may_lower_nice() -> bool:
    """CAP_SYS_NICE (root) or an RLIMIT_NICE that allows nice 0 again (setpriority(2))."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    return os.geteuid() == 0 or soft >= 20 - _nice()


@pytest.mark.skipif(not _may_lower_nice(), reason="lowering a nice value needs CAP_SYS_NICE or RLIMIT_NICE")
def test_a_task_waited_for_gets_the_main_threads_priority_back_and_the_next_task_is_lowered_again() -> None:
    """``boost_lowered``: the critical path waiting for background work (``Forward.settle``, the
    engine's ``PingPong._join``) raises the lowered threads back; ``LoweredPool`` lowers its
    thread again for the next task."""
    from bdn.priority import LoweredPool, boost_lowered

    base = os.getpriority(os.PRIO_PROCESS, os.getpid())
    pool = LoweredPool(1, "test-lowered", 8)
    started, go = threading.Event(), threading.Event()

    def task() -> tuple[int, int]:
        before = _nice()
        started.set()
        assert go.wait(60)
        return before, _nice()

    try:
        fut = pool.submit(task)
        assert started.wait(60)
        assert boost_lowered() >= 1
        go.set()
        assert fut.result(timeout=60) == (min(19, base + 8), base)
        assert pool.submit(_nice).result(timeout=60) == min(19, base + 8)  # lowered again
    finally:
        pool.shutdown()
