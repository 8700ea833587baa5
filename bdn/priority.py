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
not lowered back (RLIMIT_NICE), so it is used only on threads that do nothing else: the daemon's
``background`` pool (``Executors``) and the engine's catch-up thread. CFS weighs nice 10 at about
a tenth of nice 0: with nothing else to run, background work still gets every idle core.

Source: Linux ``setpriority(2)`` ("the nice value is a per-thread attribute"), ``sched(7)``.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("bdn.priority")

__all__ = ["BACKGROUND_NICE", "lower_this_thread"]

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


def _current() -> int:
    try:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    except (AttributeError, OSError):
        return 0
