"""The simulated network of bench/fleetsim: links, flows, max-min fair rates, local updates.

A flow moves ``size`` bytes over one or more links (the sender's NIC up, the receiver's NIC
down, the bucket's aggregate link) and has its own cap (the bucket's per-connection rate times
the connections it stands for). Rates are **max-min fair** (progressive filling, Bertsekas &
Gallager, *Data Networks* §6.5.2): no flow can get more without taking from a flow that has
no more than it - the long-run share TCP converges to, and unlike an equal split per link it
hands capacity that a flow cannot use (held back elsewhere) to the others.

Cost. Exact max-min over every flow on every start and end is O(all flows) per event (80,000
flows at N = 10,000). Here an event re-fills only the flows on the links the changed flow
touches (``F``, a few dozen), against what the rest of their links have left
(``cap - rates of flows outside F``); flows outside ``F`` keep their rates. So a change never
over-commits a link, and the result equals global max-min whenever the flows outside ``F``
are bottlenecked elsewhere (tested in tests/test_fleetsim_net.py); otherwise capacity freed
two hops away is picked up at those flows' own next event, so the model errs on the slow side.
A flow's end is one simpy timeout, rescheduled only when its rate changes.

Time is simpy's (seconds), sizes bytes, rates bytes per second. Nothing here knows about
chunks, owners or peers. Own code: the flow-level network libraries for Python (ns-3's
bindings, SimGrid) are far heavier than these ~150 lines and would replace simpy's clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from heapq import heappush
from typing import Any

import simpy
from simpy.events import NORMAL

_EPS = 1e-9


class _Call:
    """A bare simpy event that calls ``fn(*args)`` when it fires: what ``env.timeout(dt)`` plus a
    callback does, scheduled in the same order (same priority, the environment's own event
    ids), without the Timeout's setup (simulator time only: most of a run's events are these)."""

    __slots__ = ("args", "callbacks", "fn")
    _ok = True

    def __init__(self, fn: Callable[..., Any], args: tuple) -> None:
        self.fn = fn
        self.args = args
        self.callbacks = (self._fire,)

    def _fire(self, _ev: Any) -> None:
        self.fn(*self.args)


def call_later(env: simpy.Environment, dt: float, fn: Callable[..., Any], *args: Any) -> None:
    """``fn(*args)`` after ``dt`` simulated seconds (0 if negative), as a timeout's callback would."""
    heappush(env._queue, (env._now + (dt if dt > 0 else 0.0), NORMAL, next(env._eid), _Call(fn, args)))


class Link:
    """A shared capacity in bytes per second (``math.inf``: unlimited)."""

    __slots__ = ("name", "cap", "flows", "alloc")

    def __init__(self, name: str, cap: float) -> None:
        self.name = name
        self.cap = cap
        self.flows: dict[Flow, None] = {}  # insertion-ordered set: runs are reproducible
        self.alloc = 0.0  # sum of the rates of its flows

    def __repr__(self) -> str:
        return f"Link({self.name!r}, {self.cap:g}, flows={len(self.flows)})"


class Flow:
    """``size`` bytes over ``links``; ``on_done(flow, ok)`` runs once: ok True when complete,
    False when aborted (:meth:`Network.abort`)."""

    __slots__ = ("size", "left", "links", "cap", "rate", "t", "version", "on_done", "tag", "ended", "due")

    def __init__(
        self,
        size: float,
        links: tuple[Link, ...],
        cap: float,
        now: float,
        on_done: Callable[[Flow, bool], None] | None,
        tag: object,
    ) -> None:
        self.size = size
        self.left = size
        self.links = links
        self.cap = cap
        self.rate = 0.0
        self.t = now
        self.version = 0
        self.on_done = on_done
        self.tag = tag
        self.ended = False
        self.due: float | None = None  # when its pending end check fires (None: none pending)

    @property
    def moved(self) -> float:
        return self.size - self.left

    def __repr__(self) -> str:
        return f"Flow({self.tag!r}, left={self.left:g}, rate={self.rate:g})"


def max_min(flows: list[Flow], residual: dict[Link, float]) -> dict[Flow, float]:
    """Progressive filling: max-min fair rates of ``flows`` given what each link has left for
    them (``residual``, bytes/s; every link of every flow must be a key) and each flow's cap.

    Returns flow -> rate. Pure (used by :class:`Network` and checked by the tests).
    """
    res = dict(residual)
    count: dict[Link, int] = dict.fromkeys(res, 0)
    for f in flows:
        for ln in f.links:
            count[ln] += 1
    rates: dict[Flow, float] = {}
    open_ = flows
    while open_:
        level = math.inf
        for f in open_:
            if f.cap < level:
                level = f.cap
        for ln, c in count.items():
            if c and res[ln] < level * c:
                level = res[ln] / c
        if level < 0:
            level = 0.0
        if level == math.inf:  # nothing limits them
            for f in open_:
                rates[f] = math.inf
            break
        bound = level * (1 + _EPS) + _EPS
        tight = {ln for ln, c in count.items() if c and res[ln] <= bound * c}
        keep: list[Flow] = []
        for f in open_:
            if f.cap <= bound or not tight.isdisjoint(f.links):
                rates[f] = level
                for ln in f.links:
                    res[ln] -= level
                    count[ln] -= 1
            else:
                keep.append(f)
        open_ = keep
    return rates


class Network:
    """Flows over links in a simpy environment (see the module docstring)."""

    def __init__(self, env: simpy.Environment) -> None:
        self.env = env
        self.active = 0
        self.refills = 0  # local max-min computations (a cost metric)

    def start(
        self,
        size: float,
        links: tuple[Link, ...],
        cap: float = math.inf,
        tag: object = None,
        on_done: Callable[[Flow, bool], None] | None = None,
    ) -> Flow:
        """A new flow of ``size`` bytes; its rate and those of its links' flows are re-filled."""
        f = Flow(size, links, cap, self.env.now, on_done, tag)
        for ln in links:
            ln.flows[f] = None
        self.active += 1
        if size <= 0:
            self._end(f, True)
            return f
        self._refill(links)
        return f

    def abort(self, f: Flow) -> None:
        """Stop ``f`` now (its node died); ``on_done(f, False)``."""
        if not f.ended:
            self._end(f, False)

    def _end(self, f: Flow, ok: bool) -> None:
        self._progress(f, self.env.now)
        f.ended = True
        f.version += 1
        for ln in f.links:
            ln.flows.pop(f, None)
            ln.alloc -= f.rate
        f.rate = 0.0
        self.active -= 1
        self._refill(f.links)
        if f.on_done is not None:
            f.on_done(f, ok)

    @staticmethod
    def _progress(f: Flow, now: float) -> None:
        if f.rate and now > f.t:
            f.left = max(0.0, f.left - f.rate * (now - f.t))
        f.t = now

    def _refill(self, links: tuple[Link, ...]) -> None:
        flows: dict[Flow, None] = {}
        for ln in links:
            flows.update(ln.flows)
        if not flows:
            return
        self.refills += 1
        group = list(flows)
        residual: dict[Link, float] = {}
        for f in group:
            for ln in f.links:
                if ln not in residual:
                    residual[ln] = ln.cap - ln.alloc
                residual[ln] += f.rate
        rates = max_min(group, {ln: max(0.0, r) for ln, r in residual.items()})
        now = self.env.now
        for f in group:
            r = rates[f]
            if f.version and abs(r - f.rate) <= _EPS * max(1.0, f.rate):
                continue
            self._progress(f, now)
            for ln in f.links:
                ln.alloc += r - f.rate
            f.rate = r
            f.version += 1
            if r <= 0:
                continue
            end = now + (f.left / r if not math.isinf(r) else 0.0)
            if f.due is not None and f.due <= end:
                continue  # its pending check fires first and re-schedules at the rate of then
            f.due = end
            call_later(self.env, end - now, self._fire, f, end)

    def _fire(self, f: Flow, due: float) -> None:
        """A flow's end check: it ends if its bytes are through, else (its rate fell since the
        check was scheduled) the check moves to its end at the present rate. One pending check
        per flow, moved only when the end comes *earlier*: a flow whose rate falls at every
        neighbour's start is not re-scheduled each time (simulator time only: at N = 10,000 the
        stale end events were a third of a run's heap work)."""
        if f.ended or f.due != due:
            return  # superseded by an earlier check
        f.due = None
        now = self.env.now
        self._progress(f, now)
        r = f.rate
        if r <= 0:
            return
        if math.isinf(r) or f.left <= 1e-9 * f.size + 1e-6 or now + f.left / r <= now:
            self._end(f, True)
            return
        f.due = now + f.left / r
        call_later(self.env, f.left / r, self._fire, f, f.due)
