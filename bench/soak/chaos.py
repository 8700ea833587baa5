"""The chaos loop: a seeded plan of faults, and the thread that injects them into a :class:`Fleet`.

Fault kinds (``KINDS``):

- ``kill``: kill -9 of a random live daemon (never ``spare`` ones, never more than ``max_down``
  down at once), started again ``down_s`` later (same ports, same shm dir: it resumes);
- ``liar``: the lying peer (tests/support/liar.py) starts and joins through a daemon that is
  killed and restarted with the liar among its static peers; the membership exchanges spread it
  to the others; it stops ``liar_s`` later (the restarted daemon keeps it as a dead static peer);
- ``s3_503``: the proxy answers every bucket request (chunk reads, manifest reads, lists) with
  503 SlowDown for ``burst_s`` seconds;
- ``engine_crash``: kill -9 of the engine (it does not unregister); a supervisor starts it again
  ``engine_down_s`` later (it registers anew);
- ``slow``: a random live daemon is restarted with its peer uplink limited to ``slow_mbit``
  (``BDN_PEER_UPLOAD_MBIT``; 0.5 Mbit/s is 64 KB/s, issue 31's slow peer) for ``slow_s``
  seconds, then restarted unlimited; meanwhile it advertises what it holds and answers slowly.

:func:`plan` is pure: the same seed, kinds and times give the same schedule. Faults come in
rounds; each round holds every kind once, in a seeded order (or the order given, ``shuffle=False``),
spaced ``every`` seconds (uniform in the range). Nothing new is injected in the last ``quiet_s``
seconds; the restarts that are due still happen, so the fleet ends whole.
"""

from __future__ import annotations

import random
import threading
import traceback
from dataclasses import dataclass
from typing import Any

from bench.soak.fleet import Fleet

KINDS = ("kill", "liar", "s3_503", "engine_crash", "slow")
RETRY_S = 5.0  # a fault skipped for too many daemons down is tried again this much later


@dataclass(frozen=True)
class ChaosParams:
    kinds: tuple[str, ...] = KINDS
    every: tuple[float, float] = (20.0, 45.0)
    down_s: tuple[float, float] = (5.0, 20.0)
    liar_s: tuple[float, float] = (45.0, 90.0)
    engine_down_s: tuple[float, float] = (3.0, 10.0)
    burst_s: tuple[float, float] = (5.0, 30.0)
    slow_s: tuple[float, float] = (45.0, 90.0)
    slow_mbit: float = 0.5
    max_down: int = 2
    spare: tuple[str, ...] = ("node0",)
    quiet_s: float = 60.0
    shuffle: bool = True


def plan(rng: random.Random, p: ChaosParams, start_s: float, end_s: float) -> list[tuple[float, str]]:
    """``[(t_s, kind), ...]`` in time order, within ``[start_s, end_s - p.quiet_s)``."""
    out: list[tuple[float, str]] = []
    t = start_s
    while p.kinds:
        kinds = list(p.kinds)
        if p.shuffle:
            rng.shuffle(kinds)
        for k in kinds:
            t += rng.uniform(*p.every)
            if t >= end_s - p.quiet_s:
                return out
            out.append((round(t, 2), k))
    return out


class Chaos:
    """Runs a plan against ``fleet``; ``events`` records what was done, when, to whom."""

    def __init__(self, fleet: Fleet, rng: random.Random, clock: Any, params: ChaosParams) -> None:
        self.fleet, self.rng, self.clock, self.p = fleet, rng, clock, params
        self.events: list[dict[str, Any]] = []
        self.due: list[tuple[float, str, Any]] = []  # (t, action, arg): restart / liar_stop / engine_start / retry
        self.retry_until = 0.0  # skipped faults are retried until then (set by run())
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()

    def injected(self) -> int:
        """Faults injected so far (the trainer stamps each hot-load with it)."""
        with self.lock:
            return sum(1 for e in self.events if e.get("fault"))

    def _record(self, **e: Any) -> None:
        with self.lock:
            self.events.append({"t_s": round(self.clock(), 1), **e})

    def _victim(self) -> str | None:
        live = [n.daemon.node_id for n in self.fleet.live() if n.daemon.node_id not in self.p.spare]
        if not live or len(self.fleet.down()) >= self.p.max_down:
            return None
        return self.rng.choice(sorted(live))

    def _restart_later(
        self, node_id: str, after: float, extra_peers: list[str] | None = None, env: dict[str, str] | None = None
    ) -> None:
        self.due.append((self.clock() + after, "restart", (node_id, extra_peers or [], env or {})))

    def _restart(self, node_id: str, extra_peers: list[str], env: dict[str, str]) -> None:
        def go() -> None:
            try:
                took = self.fleet.restart(node_id, extra_peers, env=env)
                self._record(
                    action="restarted",
                    node=node_id,
                    healthy_after_s=round(took, 2),
                    with_liar=bool(extra_peers),
                    **({"env": env} if env else {}),
                )
            except Exception as e:  # a daemon that does not come back is a finding, not a harness crash
                self._record(action="restart_failed", node=node_id, error=str(e).splitlines()[0][:300])

        th = threading.Thread(target=go, name=f"restart-{node_id}", daemon=True)
        th.start()
        self.threads.append(th)

    def inject(self, kind: str) -> None:
        f = self.fleet
        if kind == "kill":
            victim = self._victim()
            if victim is None:
                self._record(action="kill_skipped", reason="too many down")
                self._retry_later(kind)
                return
            pid = f.kill(victim)
            down = self.rng.uniform(*self.p.down_s)
            self._record(fault=kind, node=victim, pid=pid, down_s=round(down, 1))
            self._restart_later(victim, down)
        elif kind == "liar":
            if f.liar is not None:
                self._record(action="liar_skipped", reason="already running")
                return
            victim = self._victim()
            if victim is None:
                self._record(action="liar_skipped", reason="too many down")
                self._retry_later(kind)
                return
            url = f.start_liar()
            pid = f.kill(victim)
            stay = self.rng.uniform(*self.p.liar_s)
            self._record(fault=kind, node=victim, pid=pid, liar_url=url, stay_s=round(stay, 1))
            self._restart_later(victim, 1.0, [url])
            self.due.append((self.clock() + stay, "liar_stop", None))
        elif kind == "s3_503":
            assert f.proxy is not None
            secs = self.rng.uniform(*self.p.burst_s)
            f.proxy.throttle_for(secs)
            self._record(fault=kind, burst_s=round(secs, 1))
        elif kind == "engine_crash":
            pid = f.kill_engine()
            if pid is None:
                self._record(action="engine_crash_skipped", reason="engine not running")
                return
            down = self.rng.uniform(*self.p.engine_down_s)
            self._record(fault=kind, node=f.engine_node, pid=pid, down_s=round(down, 1))
            self.due.append((self.clock() + down, "engine_start", None))
        elif kind == "slow":
            victim = self._victim()
            if victim is None:
                self._record(action="slow_skipped", reason="too many down")
                self._retry_later(kind)
                return
            pid = f.kill(victim)
            stay = self.rng.uniform(*self.p.slow_s)
            self._record(fault=kind, node=victim, pid=pid, slow_s=round(stay, 1), mbit=self.p.slow_mbit)
            self._restart_later(victim, 1.0, env={"BDN_PEER_UPLOAD_MBIT": str(self.p.slow_mbit)})
            self.due.append((self.clock() + stay, "slow_stop", victim))
        else:
            raise ValueError(f"unknown fault kind {kind!r}; known: {', '.join(KINDS)}")

    def _retry_later(self, kind: str) -> None:
        """A fault skipped because too many daemons are down is tried again a few seconds later
        (until the last planned fault's time + 20 s): on a loaded machine a restart can take a
        minute, and a skipped fault was a fault kind the run never exercised."""
        if self.clock() + RETRY_S <= self.retry_until:
            self.due.append((self.clock() + RETRY_S, "retry", kind))

    def _run_due(self, final: bool = False) -> None:
        now = self.clock()
        ready = [x for x in self.due if final or x[0] <= now]
        self.due = [x for x in self.due if x not in ready]
        for _, action, arg in ready:
            if action == "restart":
                self._restart(*arg)
            elif action == "liar_stop":
                self.fleet.stop_liar()
                self._record(action="liar_stopped")
            elif action == "slow_stop":
                # Back to an unlimited uplink: kill -9 and start again (as an operator would fix it).
                if not final and arg in {n.daemon.node_id for n in self.fleet.live()}:
                    pid = self.fleet.kill(arg)
                    self._record(action="slow_stopped", node=arg, pid=pid)
                    self._restart_later(arg, 1.0)
                elif not final:
                    self.due.append((now + RETRY_S, "slow_stop", arg))  # still starting: later
            elif action == "retry":
                if not final:  # no new fault once the run is over
                    self.inject(arg)
            elif action == "engine_start":
                if not self.fleet.closed:
                    pid = self.fleet.start_engine()
                    self._record(action="engine_started", pid=pid)

    def run(self, schedule: list[tuple[float, str]], stop: threading.Event, end_t: float) -> None:
        """Inject ``schedule``; perform due restarts; at the end, perform all that is still due."""
        todo = list(schedule)
        self.retry_until = (max(t for t, _ in schedule) + 20.0) if schedule else 0.0
        try:
            while not stop.is_set() and self.clock() < end_t:
                while todo and todo[0][0] <= self.clock():
                    _, kind = todo.pop(0)
                    try:
                        self.inject(kind)
                    except Exception as e:
                        self._record(
                            action="inject_failed",
                            kind=kind,
                            error=f"{type(e).__name__}: {e}"[:300],
                            tb=traceback.format_exc()[-800:],
                        )
                self._run_due()
                stop.wait(0.2)
        finally:
            if not stop.is_set():
                self._run_due(final=True)
            self.join()

    def join(self, timeout: float = 150.0) -> None:
        for th in self.threads:
            th.join(timeout)
