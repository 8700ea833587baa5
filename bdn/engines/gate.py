"""The policy gate: requests generate token by token under it; a swap drains them by policy.

A request is admitted (``admit()``), then runs each forward step inside ``step()``. A swap
(``swap(apply, options)``) follows the hot-load's in-flight policy (bdn.engines.options):

- ``wait``: stop admitting; let admitted requests finish for at most ``inflight_wait_s``; abort
  those still running; then apply the new weights with no step running; resume admitting.
- ``keep``: admitted requests continue; ``apply`` runs between two of their steps (a
  writer-preferring lock), so their later tokens come from the new policy.
- ``abort``: every admitted request ends at its next step (``Aborted``); then apply.

Each request's ``Ticket`` records the policy versions its steps ran under, so an answer can say
exactly which policy produced it. The clock is injected (``clock``) for the timings it reports.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from bdn.engines.options import HotLoadOptions

__all__ = ["Aborted", "PolicyGate", "SwapOutcome", "Ticket"]


class Aborted(Exception):
    """The request was aborted by a hot-load's in-flight policy (``finish_reason: "abort"``)."""


@dataclass
class Ticket:
    """One admitted request: the policy versions its steps saw, in order, without repeats."""

    versions: list[int | None] = field(default_factory=list)
    aborted: bool = False

    def saw(self, version: int | None) -> None:
        """Record policy ``version`` as seen by the request (appended when it differs from the last seen)."""
        if not self.versions or self.versions[-1] != version:
            self.versions.append(version)


@dataclass(frozen=True)
class SwapOutcome:
    """What a swap did. Durations in milliseconds.

    ``pause_ms``: no step could run (the weights were being replaced). ``drain_ms``: new requests
    waited for in-flight ones before that (``wait``/``abort``). ``aborted``: requests ended by the
    policy (for ``wait``, the ones still running at the bound). ``kept``: requests that continued
    across the swap (``keep``).
    """

    pause_ms: float
    drain_ms: float
    aborted: int
    kept: int


class PolicyGate:
    """Admission and per-step exclusion between generating requests and the weight swap.

    Args:
        version: the policy version served now (None before the first load).
        clock: monotonic seconds (injected in tests).
    """

    def __init__(self, version: int | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._cond = threading.Condition()
        self._clock = clock
        self._admitting = True
        self._active: set[int] = set()
        self._tickets: dict[int, Ticket] = {}
        self._stepping = 0
        self._writer = False  # a swap wants, or holds, the weights
        self.version = version

    @property
    def in_flight(self) -> int:
        """Requests admitted and not yet finished."""
        with self._cond:
            return len(self._active)

    @contextlib.contextmanager
    def admit(self) -> Iterator[Ticket]:
        """Admit one request (blocks while a ``wait``/``abort`` swap drains)."""
        ticket = Ticket()
        with self._cond:
            self._cond.wait_for(lambda: self._admitting)
            key = id(ticket)
            self._active.add(key)
            self._tickets[key] = ticket
        try:
            yield ticket
        finally:
            with self._cond:
                self._active.discard(key)
                self._tickets.pop(key, None)
                self._cond.notify_all()

    @contextlib.contextmanager
    def step(self, ticket: Ticket) -> Iterator[int | None]:
        """One forward step under the current weights; yields the policy version it runs under.

        Raises Aborted (before the step) when a swap's policy aborted this request.
        """
        with self._cond:
            self._cond.wait_for(lambda: not self._writer or ticket.aborted)
            if ticket.aborted:
                raise Aborted("aborted by a hot-load (inflight_policy)")
            self._stepping += 1
            version = self.version
        ticket.saw(version)
        try:
            yield version
        finally:
            with self._cond:
                self._stepping -= 1
                self._cond.notify_all()

    def swap(self, apply: Callable[[], None], options: HotLoadOptions, version: int | None) -> SwapOutcome:
        """Run ``apply()`` (replace the weights) as ``options.inflight_policy`` says.

        ``version`` becomes the served policy version if ``apply`` returns; if it raises, the old
        version stays and the exception propagates (admission resumes either way).
        """
        policy = options.inflight_policy
        t0 = self._clock()
        aborted = kept = 0
        with self._cond:
            if policy in ("wait", "abort"):
                self._admitting = False
            try:
                if policy == "wait":
                    deadline = t0 + options.inflight_wait_s
                    while self._active:
                        left = deadline - self._clock()
                        if left <= 0:
                            break
                        self._cond.wait(min(left, 0.5))
                if policy in ("wait", "abort"):
                    for t in self._tickets.values():
                        if not t.aborted:
                            t.aborted = True
                            aborted += 1
                    self._cond.notify_all()
                    self._cond.wait_for(lambda: not self._active)
                kept = len(self._active)
                self._writer = True
                self._cond.wait_for(lambda: self._stepping == 0)
            except BaseException:
                self._writer, self._admitting = False, True
                self._cond.notify_all()
                raise
        t1 = self._clock()
        try:
            apply()
            with self._cond:
                self.version = version
        finally:
            t2 = self._clock()
            with self._cond:
                self._writer, self._admitting = False, True
                self._cond.notify_all()
        return SwapOutcome(pause_ms=(t2 - t1) * 1000.0, drain_ms=(t1 - t0) * 1000.0, aborted=aborted, kept=kept)
