"""Pause points for crash tests, off unless the environment names them.

A test that must kill bdnd at one step of a background task (say, while a catch-up holds a claimed
spare) cannot aim a ``kill -9`` at a window of a few milliseconds; it names the step instead:
``BDN_FAILPOINTS="catch_up.claimed=step000003"`` makes the thread that reaches
``hold("catch_up.claimed", "step000003")`` log one warning (``failpoint catch_up.claimed
reached (step000003)``) and block until the process ends. Several points are separated by
commas; a point without ``=detail`` holds at any detail. With the variable unset (the default,
and what operators run) :func:`hold` returns at once.

Points in the code (``bdn/daemon/apply/forward.py``): ``catch_up.claimed`` (a spare claimed by a
background catch-up to the identity given, before it is written); ``catch_up.first_claimed`` (the
same, at the catch-up's first file only, held until a snapshot waits for the catch-up: a lowered
thread that made no progress while the node was busy, ``until`` below).
"""

from __future__ import annotations

import logging
import os
import threading

__all__ = ["ENV", "hold"]

#: The environment variable naming the points (``name`` or ``name=detail``, comma-separated).
ENV = "BDN_FAILPOINTS"

log = logging.getLogger("bdn.failpoints")


def _named(name: str, detail: str) -> bool:
    for item in os.environ.get(ENV, "").split(","):
        point, _, want = item.strip().partition("=")
        if point == name and (not want or want == detail):
            return True
    return False


def hold(name: str, detail: str = "", until: threading.Event | None = None) -> None:
    """Block the calling thread if ``BDN_FAILPOINTS`` names point ``name`` (at ``detail`` or at
    any), after one warning: for good, or until ``until`` is set; return at once otherwise. Call
    it only from a worker thread (never the event loop) at a step a crash test needs to kill the
    daemon in (or, with ``until``, a step a test needs some event to happen during)."""
    if not _named(name, detail):
        return
    if until is None:
        log.warning("failpoint %s reached (%s); this thread holds until the process ends", name, detail)
        threading.Event().wait()
        return
    log.warning("failpoint %s reached (%s); this thread holds until its event", name, detail)
    until.wait()
