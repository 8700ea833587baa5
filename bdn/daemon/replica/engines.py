"""The engine table: its entries (``Engine``) and pure rules: liveness (``engine_ttl_s``) and what an ack may report.

**Liveness.** An engine is alive while it polls: every ``GET /v1/engines/{id}/next`` marks it seen
when it starts and again at least every ``poll_step(ttl)`` seconds while the poll is held open on
a live connection; an ack and a ``POST /v1/engines/{id}/heartbeat`` (sent by the engine link every
``engine_ttl_s / 3`` while it prepares and swaps an offer, when it does not poll) mark it seen
too. One that has not been seen for longer than ``engine_ttl_s`` (it crashed, was
killed, or its node's network went away without a ``DELETE``) is dropped: its leases are released
and the replica's stage is recomputed without it. Time comes from an injected clock (monotonic
seconds), so the rule is tested without sleeps.

**Swap reports.** The ack's ``swap`` object (docs/ENGINES.md) is the engine's own description of
what it did; the daemon keeps a bounded copy of it (scalars only, short strings, at most
``MAX_REPORT_KEYS`` keys) to report per replica. Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["MAX_REPORT_KEYS", "Engine", "expired", "poll_step", "sanitize_report"]

MAX_REPORT_KEYS = 64
MAX_REPORT_STR = 200
MAX_POLL_STEP_S = 5.0


class _Seen(Protocol):
    engine_id: str
    last_seen: float


def poll_step(ttl_s: float) -> float:
    """How often (s) a held-open poll marks its engine seen: well inside the TTL, at most 5 s."""
    return max(0.05, min(MAX_POLL_STEP_S, ttl_s / 3.0))


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
    pause_ms: float | None = None
    lease_id: str | None = None  # lease on ``acked`` (or the offered one until then)
    offered_lease: str | None = None
    last_seen: float = 0.0  # monotonic s: the last poll (start, or a live poll's periodic mark)
    registered: float = 0.0  # monotonic s
    prompt_cache_policy: str | None = None  # as the last ack reported them
    inflight_policy: str | None = None
    swap: dict[str, Any] | None = None  # the last ack's swap report, bounded (engines.sanitize_report)

    def describe(self, now: float, ttl_s: float) -> dict[str, Any]:
        """This engine as ``GET /v1/engines`` lists it (ages in seconds)."""
        return {
            "engine_id": self.engine_id, "name": self.name, "serving": self.acked, "offered": self.offered,
            "error": self.error, "pause_ms": self.pause_ms,
            "prompt_cache_policy": self.prompt_cache_policy, "inflight_policy": self.inflight_policy,
            "swap": self.swap, "registered_s_ago": round(now - self.registered, 3),
            "last_seen_s_ago": round(now - self.last_seen, 3),
            "expires_in_s": round(max(0.0, self.last_seen + ttl_s - now), 3) if ttl_s > 0 else None,
        }
