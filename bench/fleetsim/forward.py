"""How a node forwards a simulated chunk it is still receiving (bench/fleetsim).

A simulated chunk stands for ``g`` real 16 MiB chunks (:class:`~bench.fleetsim.scenario.Scenario`).
bdnd forwards each *real* chunk once it verified it (store and forward of 16 MiB), so a
simulated chunk moving A -> B -> C is pipelined: B starts sending to C once its first real
chunk arrived, not once all ``g`` did. bdnd's cut-through (docs/DESIGN.md, "The transfer wire",
*Cut-through*) goes further at owners: a bucket read is streamed to askers as its parts land.

``Scenario.forward`` picks the model:

- ``"store"``: a node serves a simulated chunk only once it holds it whole (the simulator
  before this module: a hop costs the whole simulated chunk, ``g`` x what bdnd pays).
- ``"real"``: bdnd today. A node announces (HAVE) and serves a chunk it is receiving once the
  first real chunk of it arrived (``min(16 MiB, chunk)`` at the incoming flow's rate); the copy
  it sends ends no earlier than its own copy plus one real chunk at the outgoing copy's rate
  (the last real chunk is forwarded only once verified).
- ``"cut"``: as ``"real"``, and a bucket read is announced and forwarded after its first
  1 MiB piece, its copies ending one piece after the read (cut-through at owners).

At ``g = 1`` ``"real"`` is ``"store"``. Flows stay max-min fair flows of :mod:`bench.fleetsim.net`:
an outgoing copy runs at its own fair rate and, if it catches up with its source, waits at its
end for the source's copy (its upload slot stays taken); the bytes each flow moves are the
same as in the real pipeline, only spread differently in time. If the source's own copy fails,
every copy made from it fails too (the asker asks again elsewhere).

Own code: this is the simulator's model of bdnd's forwarding, no library models it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from bench.fleetsim.net import Flow

REAL_CHUNK = 16 << 20
PIECE = 1 << 20  # a cut-through forward's granule: one 1 MiB piece hashed in place (bdn/transfer)

Finish = Callable[[bool], None]


class Forwarding:
    """Dependencies between a node's incoming copy of a chunk and the copies it sends on."""

    def __init__(self, mode: str, chunk_bytes: float, env: Any, abort: Callable[[Flow], None]) -> None:
        if mode not in ("store", "real", "cut"):
            raise ValueError(f"forward mode {mode!r}: store, real or cut")
        self.mode = mode
        self.chunk = chunk_bytes
        self.env = env
        self.abort = abort  # Network.abort: stop a copy still on the wire
        self.children: dict[Flow, list[Flow]] = {}  # incoming copy -> copies made from it
        self.dep: dict[Flow, Flow] = {}  # copy -> the incoming copy it is made from
        self.waiting: dict[Flow, tuple[Finish, float]] = {}  # copies done on the wire, waiting for
        # their source: (finish, the copy's average rate on the wire)
        self.not_before: dict[Flow, float] = {}  # copies whose source is done: earliest end
        self.started: dict[Flow, float] = {}
        self.from_bucket: set[Flow] = set()

    @property
    def pipelined(self) -> bool:
        return self.mode != "store"

    def announce_after(self, f: Flow, bucket: bool) -> float | None:
        """Seconds after ``f`` (an incoming copy) starts until its node announces and serves the
        chunk; None: only once whole (store, or the first granule is the whole chunk)."""
        if not self.pipelined or f.rate <= 0:
            return None
        first = PIECE if bucket and self.mode == "cut" else REAL_CHUNK
        if first >= self.chunk:
            return None
        return first / f.rate

    def incoming(self, f: Flow, bucket: bool) -> None:
        """``f`` brings a chunk to a node (a bucket read or a peer's copy)."""
        if self.pipelined:
            self.started[f] = self.env.now
            if bucket:
                self.from_bucket.add(f)

    def copy(self, f: Flow, source: Flow | None) -> None:
        """``f`` sends on a chunk its sender still receives through ``source`` (None: held whole)."""
        if source is not None:
            self.dep[f] = source
            self.children.setdefault(source, []).append(f)
        if self.pipelined:
            self.started[f] = self.env.now

    def ended(self, f: Flow, ok: bool, finish: Finish) -> None:
        """``f`` ended on the wire: ``finish(ok)`` now, or once its source's copy is complete."""
        src = self.dep.pop(f, None)
        if not ok:
            self.not_before.pop(f, None)
            finish(False)
            return
        if src is not None and src in self.children:  # the source still receives it
            dt = self.env.now - self.started.get(f, self.env.now)
            self.waiting[f] = (finish, f.size / dt if dt > 0 else 0.0)
            return
        t = self.not_before.pop(f, None)
        if t is not None and t > self.env.now:
            self.env.timeout(t - self.env.now).callbacks.append(lambda _e: finish(True))
        else:
            finish(True)

    def source_done(self, f: Flow, ok: bool) -> None:
        """The incoming copy ``f`` is complete (verified) or failed: release or fail its copies."""
        self.started.pop(f, None)
        bucket = f in self.from_bucket
        self.from_bucket.discard(f)
        kids = self.children.pop(f, None)
        if not kids:
            return
        now = self.env.now
        # after its source is complete a copy still moves its last granule (a real chunk, or a
        # piece behind a bucket read with cut-through) at its own rate
        granule = min(PIECE if bucket and self.mode == "cut" else REAL_CHUNK, self.chunk)
        for c in kids:
            w = self.waiting.pop(c, None)
            if not ok:
                if w is not None:
                    w[0](False)
                elif not c.ended:
                    self.abort(c)
                continue
            if w is not None:
                fin, rate = w
                tail = granule / rate if rate > 0 else 0.0
                self.env.timeout(tail).callbacks.append(lambda _e, fin=fin: fin(True))
            elif not c.ended and c.rate > 0:
                self.not_before[c] = now + granule / c.rate

    def fail_waiting(self, flows: Iterable[Flow]) -> None:
        """A node died: its copies waiting for their source fail now (they left the network)."""
        for f in list(flows):
            w = self.waiting.pop(f, None)
            if w is not None:
                w[0](False)
