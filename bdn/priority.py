"""Background work runs at a lower CPU priority than the hot-load's critical path.

After a swap, the daemon brings its freed spare forward (``Forward.catch_up``), copies seeds and
scrubs chunks, and the transformers engine brings its ping-pong spare buffers forward: work that
must be done before the next step, not now. On a node whose cores are busy (serving, or two cores
shared by a daemon and an engine as in bench/hotload) it took the CPU from what a trainer waits
for: the engine's ack and the status GET that reports ``done`` (measured: 140 ms between the
daemon receiving the ack and the status GET seeing it, 26 ms when nothing ran in the background).

:func:`lower_this_thread` raises the calling thread's nice value (Linux keeps one per thread,
and a thread started from it inherits it, so the worker threads of a ``fileops.thread_map`` the
background thread starts are lowered too). A nice value can be raised without privileges but
lowered back only with CAP_SYS_NICE or an RLIMIT_NICE that allows it, so it is used only on
threads that do nothing else: the daemon's ``background`` pool (:class:`LoweredPool`, each task
lowered again when it starts) and the engine's catch-up thread. CFS weighs nice 10 at about a
tenth of nice 0: with nothing else to run, background work still gets every idle core.

When the critical path must wait for background work (a delta needs the buffer a catch-up is
bringing forward), a lowered thread would hold it up for as long as the cores are busy (a
priority inversion). :func:`boost_lowered` gives every lowered thread of the process the main
thread's nice value back for the rest of its task (root, CAP_SYS_NICE, or ``LimitNICE=+0`` in a systemd unit;
without either it changes nothing and says so once).

Source: Linux ``setpriority(2)`` ("the nice value is a per-thread attribute"), ``sched(7)``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

log = logging.getLogger("bdn.priority")

__all__ = ["BACKGROUND_NICE", "LoweredPool", "boost_lowered", "lower_this_thread"]

#: The nice increment of background threads (0 = as the rest; 19 = lowest).
BACKGROUND_NICE = 10


def lower_this_thread(increment: int = BACKGROUND_NICE) -> int:
    """Raise the calling thread's nice value by ``increment`` (0..19; capped at 19).

    Returns the thread's nice value after (unchanged where the platform has no per-thread nice
    or refuses: logged once at debug level, never raised; background work then runs at the
    priority it had)."""
    if increment <= 0:
        return _current()
    tid = threading.get_native_id()
    try:
        now = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, now + increment))
        return os.getpriority(os.PRIO_PROCESS, tid)
    except (AttributeError, OSError) as e:  # (no per-thread nice on this platform)
        log.debug("background thread priority not lowered: %s", e)
        return _current()


def _base() -> int:
    """The main thread's nice value (its tid is the process id): what a boost restores."""
    try:
        return os.getpriority(os.PRIO_PROCESS, os.getpid())
    except (AttributeError, OSError):
        return 0


_boost_refused = False


def boost_lowered() -> int:
    """Give every thread of this process whose nice value is above the main thread's that value
    (``/proc/self/task``); returns how many were raised. A :class:`LoweredPool` thread is
    lowered again when its next task starts. Where lowering a nice value is not permitted
    (neither CAP_SYS_NICE nor RLIMIT_NICE) nothing changes: logged once at warning level."""
    global _boost_refused
    base, raised = _base(), 0
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return 0
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) > base:
                os.setpriority(os.PRIO_PROCESS, tid, base)
                raised += 1
        except PermissionError as e:
            if not _boost_refused:
                _boost_refused = True
                log.warning(
                    "background work waited for cannot get its priority back (%s): allow it with"
                    " CAP_SYS_NICE or LimitNICE=+0 (systemd); it runs at its lowered priority",
                    e,
                )
            return raised
        except (AttributeError, OSError):  # (a thread that ended meanwhile; no per-thread nice)
            continue
    return raised


class LoweredPool(ThreadPoolExecutor):
    """A thread pool whose every task starts on a thread at the main thread's nice value plus
    ``increment``: a thread :func:`boost_lowered` raised for one task is lowered again for the
    next. Same interface as ``ThreadPoolExecutor``."""

    def __init__(self, max_workers: int, thread_name_prefix: str, increment: int = BACKGROUND_NICE) -> None:
        super().__init__(max_workers=max_workers, thread_name_prefix=thread_name_prefix)
        self.increment = max(0, increment)

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        """``fn(*args, **kwargs)`` on a pool thread lowered first (``ThreadPoolExecutor.submit``)."""
        return super().submit(self._lowered, fn, args, kwargs)

    def _lowered(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.increment:
            _set_this_thread(min(19, _base() + self.increment))
        return fn(*args, **kwargs)


def _set_this_thread(nice: int) -> None:
    try:
        tid = threading.get_native_id()
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    except (AttributeError, OSError) as e:
        log.debug("background thread priority not lowered: %s", e)


def _current() -> int:
    try:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    except (AttributeError, OSError):
        return 0
