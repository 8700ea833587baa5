"""The simulated network of bench/fleetsim: NIC links, the bucket, flows with shared rates.

A flow moves ``size`` bytes over one or more links (the sender's NIC up, the receiver's NIC
down, the bucket's aggregate link) and has its own cap (the bucket's per-connection rate).
Its rate is ``min(cap, min over its links of link capacity / flows on the link)``: each link is
shared equally by its flows (TCP's long-run fair share). That rule never over-commits a link,
but it leaves capacity unused when a flow is held back elsewhere (true max-min fairness would
give it to the others), so the model errs on the slow side. Rates change only when a flow
starts or ends on a link, and only that link's flows are re-rated: events cost O(flows per
link), not O(all flows).

Time is simpy's (seconds). Nothing here knows about chunks, owners or peers.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import simpy


class Link:
    """A shared capacity in bytes per second (``math.inf``: unlimited)."""

    __slots__ = ("name", "cap", "flows", "bytes")

    def __init__(self, name: str, cap: float) -> None:
        self.name = name
        self.cap = cap
        self.flows: set[Flow] = set()
        self.bytes = 0.0  # bytes carried so far

    def share(self) -> float:
        return self.cap / max(1, len(self.flows))


class Flow:
    """``size`` bytes over ``links``; ``done`` fires with True (complete) or False (aborted)."""

    __slots__ = ("net", "size", "left", "links", "cap", "rate", "t", "version", "done", "tag")

    def __init__(self, net: Network, size: float, links: tuple[Link, ...], cap: float, tag: object) -> None:
        self.net = net
        self.size = size
        self.left = size
        self.links = links
        self.cap = cap
        self.rate = 0.0
        self.t = net.env.now
        self.version = 0
        self.done = net.env.event()
        self.tag = tag

    def _progress(self, now: float) -> None:
        moved = self.rate * (now - self.t)
        self.left = max(0.0, self.left - moved)
        for ln in self.links:
            ln.bytes += moved
        self.t = now


class Network:
    """Flows over links in a simpy environment."""

    def __init__(self, env: simpy.Environment) -> None:
        self.env = env
        self.active = 0

    def start(self, size: float, links: tuple[Link, ...], cap: float = math.inf, tag: object = None) -> Flow:
        f = Flow(self, size, links, cap, tag)
        for ln in links:
            ln.flows.add(f)
        self.active += 1
        self._rerate_links(links)
        return f

    def abort(self, f: Flow) -> None:
        if f.done.triggered:
            return
        f._progress(self.env.now)
        self._detach(f)
        f.done.succeed(False)

    def _detach(self, f: Flow) -> None:
        for ln in f.links:
            ln.flows.discard(f)
        self.active -= 1
        f.version += 1
        self._rerate_links(f.links)

    def _rerate_links(self, links: tuple[Link, ...]) -> None:
        now = self.env.now
        seen: set[Flow] = set()
        for ln in links:
            for g in ln.flows:
                if g not in seen:
                    seen.add(g)
                    self._rerate(g, now)

    def _rerate(self, f: Flow, now: float) -> None:
        rate = f.cap
        for ln in f.links:
            s = ln.share()
            if s < rate:
                rate = s
        if rate == f.rate and f.version:
            return
        f._progress(now)
        f.rate = rate
        f.version += 1
        v = f.version
        dt = f.left / rate if rate > 0 else math.inf
        if math.isinf(dt):
            return
        ev = self.env.timeout(dt)
        ev.callbacks.append(self._finisher(f, v))

    def _finisher(self, f: Flow, v: int) -> Callable[[simpy.Event], None]:
        def fire(_ev: simpy.Event) -> None:
            if f.version != v or f.done.triggered:
                return
            f._progress(self.env.now)
            self._detach(f)
            f.done.succeed(True)
        return fire
