"""The fleet's hot-load target and its order: a pure value type.

The fleet has one **target** snapshot: the identity of the latest accepted hot-load. Ordering is
by ``(gen, policy_version, published_at, identity)`` (DESIGN.md, "Hot-load"), never by a
daemon's clock: ``gen`` is a logical (Lamport) counter, one more than the target the accepting
daemon held, so a hot-load posted after another one reached that daemon wins even when it rolls
back to an older snapshot; two hot-loads accepted concurrently (the same ``gen``) are ordered by
what the trainer wrote, the manifest's ``policy_version`` then its ``created_at``
(``published_at``, seconds), then the identity. ``seq`` (the accepting daemon's clock, ns) and
``origin`` are kept for the records only. A target from the wire whose ``seq`` lies more than
``MAX_FUTURE_NS`` past the receiver's clock, or whose ``gen`` is over ``MAX_GEN``, is refused.
A target's ``policy_version`` and ``published_at`` are claims of the daemon that accepted the
POST; a receiver that knows the snapshot's manifest checks them (:func:`contradiction`, applied
by ``replica/claims.py``): a push that contradicts it is refused, and a target adopted before
its manifest was read is corrected to the manifest's values (:func:`as_manifest_says`) once it
is. A target carries the hot-load's engine options (``bdn.daemon.replica.options``), so every
replica's engines apply the same ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from bdn.daemon.replica.options import (
    DEFAULT_OPTIONS,
    HotLoadOptions,
    options_from_wire,
)
from bdn.proto.errors import IdentityError
from bdn.proto.identity import validate_identity

MAX_FUTURE_NS = 60 * 10**9  # twice the signature's clock-skew limit
MAX_GEN = 2**53  # a hot-load per microsecond for 285 years


@dataclass(frozen=True)
class Target:
    """A fleet hot-load target: ``identity`` ordered by ``(seq, origin)`` (seq = accepting clock, ns);
    ``base``: the delta's base when known (a snapshot without a manifest has it from the request);
    ``options``: the engine options of its request."""

    identity: str
    seq: int
    origin: str
    request_id: str
    base: str | None = None  # the base the request named or the manifest gives (a delta), else None
    options: HotLoadOptions = field(default=DEFAULT_OPTIONS, compare=False)
    gen: int = 0  # logical clock: 1 + the gen of the target the accepting daemon held (0: startup)
    policy_version: int = -1  # the manifest's (-1: not known, e.g. no manifest yet)
    published_at: float = 0.0  # the manifest's created_at, s since the epoch (0: not known)

    @property
    def order(self) -> tuple[int, int, float, str]:
        """The key targets are ordered by: ``(gen, policy version, publish time, identity)``, never a daemon's clock."""
        return (self.gen, self.policy_version, self.published_at, self.identity)

    def wire(self) -> dict[str, Any]:
        """The target as a hot-load gossip message carries it (msgpack-ready dict)."""
        out = {
            "identity": self.identity,
            "seq": self.seq,
            "origin": self.origin,
            "request_id": self.request_id,
            "options": self.options.wire(),
            "gen": self.gen,
            "pv": self.policy_version,
            "at": self.published_at,
        }
        if self.base is not None:
            out["base"] = self.base
        return out

    @classmethod
    def from_wire(cls, obj: Any, now_ns: int) -> Target | None:
        """The target in an untrusted wire map, or None if malformed or from the future
        (``now_ns``: the receiver's clock, unix ns). Absent ``options`` (an older peer) are the
        defaults; malformed ones make the target malformed."""
        if not isinstance(obj, dict):
            return None
        try:
            ident = validate_identity(obj.get("identity"))
        except IdentityError:
            return None
        seq, origin, rid = obj.get("seq"), obj.get("origin"), obj.get("request_id")
        if not isinstance(seq, int) or isinstance(seq, bool) or not isinstance(origin, str) or not isinstance(rid, str):
            return None
        if not 0 < seq <= now_ns + MAX_FUTURE_NS:
            return None
        base = obj.get("base")
        if base is not None:
            try:
                base = validate_identity(base)
            except IdentityError:
                return None
        options = options_from_wire(obj.get("options"))
        if options is None:
            return None
        gen, pv, at = obj.get("gen", 0), obj.get("pv", -1), obj.get("at", 0.0)
        for v, lo, hi in ((gen, 0, MAX_GEN), (pv, -1, 2**63 - 1)):
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                return None
        if not isinstance(at, (int, float)) or isinstance(at, bool) or not 0 <= at < 1e11:
            return None
        return cls(ident, seq, origin[:64], rid[:64], base, options, gen, pv, float(at))


def later(candidate: Target, current: Target | None) -> bool:
    """Whether ``candidate`` replaces ``current`` as the target (strictly later order wins)."""
    return current is None or candidate.order > current.order


def supersedes(candidate: Target, current: Target | None) -> tuple[str, str] | None:
    """The ``(old, new)`` identities a "superseded" record names when ``candidate`` meets
    ``current``, or None (same request, same identity, or nothing to supersede).

    A later candidate supersedes the current identity; an earlier one with another identity
    and request is itself superseded by the current target.
    """
    if current is None:
        return None
    if later(candidate, current):
        return (current.identity, candidate.identity) if current.identity != candidate.identity else None
    if current.request_id != candidate.request_id and candidate.identity != current.identity:
        return (candidate.identity, current.identity)
    return None


def published_at(created_at: str) -> float:
    """A manifest's ``created_at`` (ISO 8601, as the trainer wrote it) in seconds since the
    epoch; 0.0 when it is empty or not ISO 8601 (the policy version still orders)."""
    try:
        dt = datetime.fromisoformat(created_at.replace("Z", "+00:00"))
    except ValueError:
        return 0.0
    ts = dt.timestamp()
    return ts if 0 <= ts < 1e11 else 0.0


def contradiction(t: Target, policy_version: int, created_at: str) -> str | None:
    """Why ``t`` contradicts its snapshot's manifest (``policy_version``, ``created_at`` as the
    trainer wrote them), or None. The accepting daemon copies both from the manifest it read, so
    an honest target carries exactly ``(policy_version, published_at(created_at))``, or
    ``(-1, 0.0)`` when it was accepted before the manifest was written (that orders lowest, so
    it wins nothing)."""
    at = published_at(created_at)
    if (t.policy_version, t.published_at) in ((policy_version, at), (-1, 0.0)):
        return None
    return (
        f"hot-load target {t.identity} claims policy version {t.policy_version} published at "
        f"{t.published_at:.6f}, but its manifest says policy version {policy_version} published at {at:.6f}"
    )


def as_manifest_says(t: Target, policy_version: int, created_at: str) -> Target:
    """``t`` with the order fields its manifest gives (the rest unchanged)."""
    return replace(t, policy_version=policy_version, published_at=published_at(created_at))
