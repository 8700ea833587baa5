"""How ``bdnd`` stops within ``shutdown_timeout_s`` of SIGTERM/SIGINT (docs/OPERATIONS.md, "Stopping").

What would hold a stopping daemon (docs/decisions/0029-bounded-shutdown.md): aiohttp waits up to
60 s per listener for requests in flight, and long-polls (a peer's ``?wait=`` chunk request, ``/v1/snapshots/{id}/wait``, an engine's ``/next``) stay in flight that
long while the download they wait for goes on; and after the event loop has stopped, the
interpreter joins every worker thread (``concurrent.futures`` does so at exit, and
``asyncio.Runner`` joins the default executor), one of which may sit in a bucket read or a long
disk write. The pieces here bound each of them:

- :data:`HTTP_GRACE_S`: what a request still in flight gets once the jobs are cancelled;
- :class:`NoWaitExecutor`: the loop's default executor (``asyncio.to_thread``), whose shutdown
  does not wait for its threads (``asyncio.Runner.close`` would, without a bound);
- :class:`StopClock`: started at "stopping"; arms a watchdog (stdlib ``faulthandler``: it runs on
  its own C thread, so it fires even when the event loop or interpreter finalisation is stuck)
  that writes every thread's stack to stderr and exits 1 at ``shutdown_timeout_s +
  WATCHDOG_MARGIN_S``;
- :func:`join_workers`: after the loop is closed, waits for the worker threads that are busy
  (idle pool workers hold nothing) until ``shutdown_timeout_s``; what is still busy then is
  logged (name and stack) and abandoned: the caller ends the process with ``os._exit(0)``. Abandoning is safe: every job saved its progress
  when it was cancelled, a chunk a worker was still writing is not in that progress (the next
  start re-verifies every chunk it takes back), and a snapshot becomes READY only by a rename
  of its complete, verified directory.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import CodeType, FrameType
from typing import Any

log = logging.getLogger("bdn.bdnd")

#: Seconds a request still in flight gets after the jobs are cancelled (aiohttp's
#: ``shutdown_timeout``, 60 s by default); then its handler is cancelled and the connection closed.
HTTP_GRACE_S = 1.0
#: The watchdog fires this long after ``shutdown_timeout_s``, so :func:`join_workers` (exit 0)
#: goes first when only worker threads are left.
WATCHDOG_MARGIN_S = 5.0


class NoWaitExecutor(ThreadPoolExecutor):
    """A ``ThreadPoolExecutor`` whose ``shutdown`` never waits and cancels what is queued: the
    event loop's default executor, which ``asyncio.Runner.close`` shuts down with ``wait=True``."""

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Cancel queued work and return at once, whatever ``wait`` says (busy threads are
        waited for, up to the stop's bound, by ``join_workers``)."""
        super().shutdown(wait=False, cancel_futures=True)


class StopClock:
    """The stop's deadline: ``start(timeout_s)`` at "stopping" (monotonic seconds); ``left()``.
    ``watchdog``: arm the exit-1 watchdog (the ``bdnd`` process only: it ends the whole process)."""

    def __init__(self, watchdog: bool = False) -> None:
        self.deadline: float | None = None
        self.watchdog = watchdog

    def start(self, timeout_s: float) -> None:
        """Start the clock and arm the watchdog (every thread's stack on stderr, then exit 1)
        at ``timeout_s + WATCHDOG_MARGIN_S``; once only."""
        if self.deadline is not None:
            return
        self.deadline = time.monotonic() + timeout_s
        if not self.watchdog:
            return
        try:
            faulthandler.dump_traceback_later(timeout_s + WATCHDOG_MARGIN_S, exit=True, file=sys.stderr)
        except (ValueError, OSError, RuntimeError):  # no usable stderr (closed): no watchdog
            log.warning("no shutdown watchdog: stderr is not a file")

    def disarm(self) -> None:
        """Cancel the watchdog (everything stopped in time)."""
        if self.watchdog:
            faulthandler.cancel_dump_traceback_later()

    def left(self) -> float:
        """Seconds until the deadline (0 when past; ``inf`` when the stop has not started)."""
        if self.deadline is None:
            return float("inf")
        return max(0.0, self.deadline - time.monotonic())


#: Code of work a stop need not wait for (:func:`holds_nothing`).
_HOLDS_NOTHING: set[CodeType] = set()


def holds_nothing(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``fn`` (a plain Python function) as work that holds no state a stop must wait for,
    such as loading a compiled kernel into its on-disk cache: a pool thread running it is not
    counted by :func:`busy_workers`, so the stop does not wait ``shutdown_timeout_s`` for it.
    Returns ``fn``."""
    _HOLDS_NOTHING.add(fn.__code__)
    return fn


def _waitless(frame: FrameType | None) -> bool:
    """Whether ``frame`` (a thread's innermost) is a ``ThreadPoolExecutor`` worker a stop need not
    wait for: waiting for work (``_worker`` on its stack and no ``_WorkItem.run``: a pool nobody
    shut down, such as a module's own, keeps such threads; they hold nothing and would hold the
    exit forever), or running a function marked :func:`holds_nothing`."""
    in_pool = False
    while frame is not None:  # innermost first: a marked function's frame comes before ``run``
        if not isinstance(frame, FrameType):
            # (seen once at shutdown on CPython 3.11: a frame of a thread being torn down came
            # back as another object; such a thread is not counted as idle, the join bounds it)
            return False
        code = frame.f_code
        if code in _HOLDS_NOTHING:
            return True
        if code.co_filename.endswith(_POOL_FILE):
            if code.co_name == "run":
                return False  # running a work item: busy
            if code.co_name == "_worker":
                in_pool = True
        frame = frame.f_back
    return in_pool


_POOL_FILE = os.path.join("concurrent", "futures", "thread.py")


def busy_workers() -> list[threading.Thread]:
    """The threads that would hold the interpreter's exit and are doing something: alive, not
    daemon, not this one, not an idle pool worker."""
    me = threading.current_thread()
    frames = sys._current_frames()
    return [
        t
        for t in threading.enumerate()
        if t is not me
        and not t.daemon
        and t.is_alive()
        and not (t.ident is not None and _waitless(frames.get(t.ident)))
    ]


def join_workers(timeout_s: float) -> list[threading.Thread]:
    """Wait up to ``timeout_s`` seconds in all for :func:`busy_workers` to end; return those
    still alive, each logged once with its stack (WARNING)."""
    deadline = time.monotonic() + timeout_s
    left = busy_workers()
    while left and time.monotonic() < deadline:  # a worker may finish one item and go idle
        left[0].join(min(0.05, max(0.0, deadline - time.monotonic())))
        left = busy_workers()
    if left:
        frames = sys._current_frames()
        for t in left:
            frame = frames.get(t.ident) if t.ident is not None else None
            stack = "".join(traceback.format_stack(frame)).rstrip() if frame is not None else "(no frame)"
            log.warning(
                "stopping: worker thread %s still busy after the shutdown timeout, abandoned:\n%s", t.name, stack
            )
    return left
