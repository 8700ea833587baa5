"""The engine table: its entries (``Engine``) and pure rules: liveness (``engine_stale_s``,
``engine_ttl_s``), a replica's stage over its engines and what an ack may report.

**Liveness.** An engine is alive while it polls: every ``GET /v1/engines/{id}/next`` marks it seen
when it starts and again at least every ``poll_step(...)`` seconds while the poll is held open on
a live connection; an ack and a ``POST /v1/engines/{id}/heartbeat`` (sent by the engine link every
``keepalive_s(...)`` while it prepares and swaps an offer, when it does not poll) mark it seen
too. One that has not been seen for longer than ``engine_stale_s`` (it crashed, was killed, hangs,
or its node's network went away without a ``DELETE``) is **stale**: the replica no longer waits
for it (its stage and ``engines`` count only live engines; a replica whose every engine is stale
is in ``error`` with the reason), and it is live again as soon as it is seen. One not seen for
longer than ``engine_ttl_s`` is **dropped**: its leases are released and the replica's stage is
recomputed without it. Time comes from an injected clock (monotonic seconds), so the rules are
tested without sleeps.

**Swap reports.** The ack's ``swap`` object (docs/ENGINES.md) is the engine's own description of
what it did; the daemon keeps a bounded copy of it (scalars only, short strings, at most
``MAX_REPORT_KEYS`` keys) to report per replica. Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = [
    "MAX_REPORT_KEYS",
    "Engine",
    "engine_stage",
    "expired",
    "keepalive_s",
    "liveness_window",
    "poll_step",
    "sanitize_report",
    "serving_note",
    "stale_changes",
    "stale_reason",
]

MAX_REPORT_KEYS = 64
MAX_REPORT_STR = 200
MAX_POLL_STEP_S = 5.0


class _Seen(Protocol):
    engine_id: str
    last_seen: float


class _Watched(_Seen, Protocol):
    stale: bool


def liveness_window(stale_s: float, ttl_s: float) -> float:
    """The shortest silence (s) that changes anything: ``engine_stale_s`` or ``engine_ttl_s``,
    whichever is positive and smaller (0 when both are off)."""
    on = [x for x in (stale_s, ttl_s) if x > 0]
    return min(on) if on else 0.0


def poll_step(ttl_s: float, stale_s: float = 0.0) -> float:
    """How often (s) a held-open poll marks its engine seen, and the expiry tick: a third of the
    liveness window (:func:`liveness_window`), at least 0.05 s, at most 5 s."""
    window = liveness_window(stale_s, ttl_s)
    return max(0.05, min(MAX_POLL_STEP_S, window / 3.0)) if window > 0 else MAX_POLL_STEP_S


def keepalive_s(ttl_s: float, stale_s: float = 0.0) -> float | None:
    """How often (s) an engine that is not polling sends a heartbeat: a third of the liveness
    window, at least 0.05 s; None when both are off."""
    window = liveness_window(stale_s, ttl_s)
    return max(0.05, window / 3.0) if window > 0 else None


def stale_changes(engines: Iterable[_Watched], now: float, stale_s: float) -> tuple[list[str], list[str]]:
    """``(became_stale, became_live)``: the ids of the live engines not seen for more than
    ``stale_s`` seconds at monotonic ``now``, and of the stale ones seen since (``stale_s <= 0``:
    staleness off, every stale one becomes live)."""
    went, back = [], []
    for e in engines:
        silent = stale_s > 0 and now - e.last_seen > stale_s
        if silent and not e.stale:
            went.append(e.engine_id)
        elif not silent and e.stale:
            back.append(e.engine_id)
    return went, back


def stale_reason(stale: Iterable[_Watched], now: float, stale_s: float, ttl_s: float) -> str:
    """One line naming the stale engines (at most 3) and how long each has been silent, e.g.
    ``"engine 1f2e (vllm-0) not seen for 12.0 s (stale after 10 s, dropped after 30 s)"``."""
    items = sorted(stale, key=lambda e: e.last_seen)
    names = [f"{e.engine_id} ({getattr(e, 'name', '?')}) not seen for {now - e.last_seen:.1f} s" for e in items[:3]]
    more = f" and {len(items) - 3} more" if len(items) > 3 else ""
    drop = f", dropped after {ttl_s:g} s" if ttl_s > 0 else ""
    return f"engine {'; '.join(names)}{more} (stale after {stale_s:g} s{drop})"


def expired(engines: Iterable[_Seen], now: float, ttl_s: float) -> list[str]:
    """The ids of the engines not seen for more than ``ttl_s`` seconds at monotonic time ``now``
    (``ttl_s <= 0`` disables expiry: none)."""
    if ttl_s <= 0:
        return []
    return [e.engine_id for e in engines if now - e.last_seen > ttl_s]


def _scalar(v: Any) -> Any:
    if v is None or isinstance(v, bool):
        return v
    if isinstance(v, int):
        return v if abs(v) < 2**63 else None
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, str):
        return v.splitlines()[0][:MAX_REPORT_STR] if v else v
    return None


def sanitize_report(obj: Any) -> dict[str, Any] | None:
    """A bounded copy of an ack's ``swap`` report: string keys (<= 64 chars), scalar values
    (None, bool, int, finite float, the first line of a string cut to 200 chars); nested values are
    dropped; at most ``MAX_REPORT_KEYS`` keys. None when ``obj`` is not an object."""
    if not isinstance(obj, dict):
        return None
    out: dict[str, Any] = {}
    for k, v in obj.items():
        if len(out) >= MAX_REPORT_KEYS:
            break
        if not isinstance(k, str) or not k or len(k) > 64 or isinstance(v, dict | list):
            continue
        out[k] = _scalar(v)
    return out


@dataclass
class Engine:
    """An engine registered with this daemon: what it was offered and acknowledged, its leases."""

    engine_id: str
    name: str
    offered: str | None = None  # identity handed out by /next, not yet acknowledged
    acked: str | None = None
    error: str | None = None
    error_ready: int = 0  # the failed snapshot's ``ready_count`` at the error: offered again once it grows
    pause_ms: float | None = None
    lease_id: str | None = None  # lease on ``acked`` (or the offered one until then)
    offered_lease: str | None = None
    last_seen: float = 0.0  # monotonic s: the last poll (start, or a live poll's periodic mark)
    registered: float = 0.0  # monotonic s
    prompt_cache_policy: str | None = None  # as the last ack reported them
    inflight_policy: str | None = None
    swap: dict[str, Any] | None = None  # the last ack's swap report, bounded (engines.sanitize_report)
    stale: bool = False  # not seen for engine_stale_s (set and cleared by the replica's liveness events)

    def describe(self, now: float, ttl_s: float) -> dict[str, Any]:
        """This engine as ``GET /v1/engines`` lists it (ages in seconds)."""
        return {
            "engine_id": self.engine_id,
            "name": self.name,
            "serving": self.acked,
            "offered": self.offered,
            "error": self.error,
            "pause_ms": self.pause_ms,
            "prompt_cache_policy": self.prompt_cache_policy,
            "inflight_policy": self.inflight_policy,
            "swap": self.swap,
            "registered_s_ago": round(now - self.registered, 3),
            "last_seen_s_ago": round(now - self.last_seen, 3),
            "stale": self.stale,
            "expires_in_s": round(max(0.0, self.last_seen + ttl_s - now), 3) if ttl_s > 0 else None,
        }


def offer_again(engine: Engine, identity: str, ready_count: int) -> bool:
    """Whether ``engine``, which failed on ``identity``, is offered it again although it polls
    ``after`` it: once the snapshot became ready anew since the failure (``ready_count`` grew: a
    repair moved its files away under the offer and brought them back checked). A snapshot the
    engine cannot load is not offered twice."""
    return engine.offered == identity and engine.error is not None and ready_count > engine.error_ready


def engine_stage(
    engines: list[Engine], ident: str, current: str | None, now: float, stale_s: float, ttl_s: float
) -> tuple[str, str]:
    """``(stage, reason)`` of a replica whose target ``ident`` is ready on this node, over its
    registered ``engines``: the live ones decide; stale ones are named in the reason (every engine
    stale: ``error``). With no engine, ``done`` once the daemon serves it (``current``): the job
    reads ``ready`` a moment before its change event moves ``current`` (the runner notifies after
    freeing the download's index entries on the disk threads, seconds behind other disk work under
    load), and a row saying ``done`` with the old snapshot still served is not done. ``now``:
    monotonic s; ``stale_s``, ``ttl_s``: the liveness bounds (s)."""
    if not engines:
        return ("done", "") if current == ident else ("ready", "")
    live = [e for e in engines if not e.stale]
    stale = [e for e in engines if e.stale]
    note = stale_reason(stale, now, stale_s, ttl_s) if stale else ""
    if not live:
        return "error", f"every engine stopped polling: {note}"
    errs = [e.error for e in live if e.offered == ident and e.error]
    if errs:
        return "error", errs[0]
    if all(e.acked == ident for e in live):
        return "done", f"not counted: {note}" if note else ""
    if any(e.offered == ident for e in live):
        return "loading", note
    return "ready", note


def serving_note(serving: str | None, acked: str | None) -> str:
    """The tail of an engine's registration log line: what it said it serves and what came of it."""
    if not serving:
        return ""
    if acked == serving:
        return f", serving {serving}"
    return f"; it serves {serving}, which is not ready here: offered the target whole"
