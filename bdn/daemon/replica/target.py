"""The fleet's hot-load target and its order: a pure value type.

The fleet has one **target** snapshot: the identity of the latest accepted hot-load. Ordering is
by ``(seq, origin)``, ``seq`` being the accepting daemon's clock in nanoseconds: a hot-load that
arrives with an older order than the target is superseded, so when two race, the later wins
everywhere. A target from the wire whose ``seq`` lies more than ``MAX_FUTURE_NS`` past the
receiver's clock is refused: it would outrank every real hot-load for good. A target carries
the hot-load's engine options (``bdn.daemon.replica.options``), so every replica's engines apply
the same ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bdn.daemon.replica.options import (
    DEFAULT_OPTIONS,
    HotLoadOptions,
    options_from_wire,
)
from bdn.proto.errors import IdentityError
from bdn.proto.identity import validate_identity

MAX_FUTURE_NS = 60 * 10**9  # twice the signature's clock-skew limit


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

    @property
    def order(self) -> tuple[int, str]:
        return (self.seq, self.origin)

    def wire(self) -> dict[str, Any]:
        out = {"identity": self.identity, "seq": self.seq, "origin": self.origin, "request_id": self.request_id,
               "options": self.options.wire()}
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
        return cls(ident, seq, origin[:64], rid[:64], base, options)


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
