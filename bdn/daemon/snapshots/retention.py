"""Which ready snapshots garbage collection removes: a pure policy (DESIGN.md, "Garbage collection").

Kept: every *pinned* identity (leased by an engine, served now, the hot-load target), every
snapshot in progress and its base, the ``keep_ready`` newest ready ones by ``(policy_version,
created)`` (the next delta's base), and any that became ready (or changed) less than
``grace_s`` seconds ago (someone wanted it: an operator's prefetch, a peer still pulling it)
unless it was *left*: pinned at an earlier look and not any more (:class:`Pins`): a hot-load
target or served snapshot that a later one replaced, a released lease. Whoever wanted it has had
it; the grace would keep every snapshot of a burst of hot-loads (one every few seconds) in shm, and
GC would hand the page pool nothing to build the next one from (BENCHMARKS.md, the hot-load table).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from bdn.daemon.snapshots.recent import RecentSet
from bdn.proto.states import TERMINAL


@dataclass(frozen=True)
class Held:
    """One snapshot on the node as the policy sees it (``created``/``updated`` in unix s)."""

    identity: str
    state: str
    policy_version: int | None
    created: float
    updated: float
    base_identity: str | None = None


def plan_gc(
    held: Iterable[Held],
    pinned: Iterable[str],
    keep_ready: int,
    grace_s: float,
    now: float,
    left: Iterable[str] = (),
) -> tuple[list[str], list[str]]:
    """``(remove, kept)``: ready identities to remove (newest first) and the ready ones kept (sorted).
    ``left``: identities the replica has left (module doc): no grace for them."""
    left = set(left)
    held = list(held)
    keep = set(pinned)
    for h in held:
        if h.state not in TERMINAL:
            keep.add(h.identity)
            if h.base_identity:
                keep.add(h.base_identity)
    ready = sorted(
        (h for h in held if h.state == "ready"), key=lambda h: (h.policy_version or 0, h.created), reverse=True
    )
    keep.update(h.identity for h in ready[:keep_ready])
    keep.update(h.identity for h in ready if now - h.updated < grace_s and h.identity not in left)
    return [h.identity for h in ready if h.identity not in keep], sorted(
        h.identity for h in ready if h.identity in keep
    )


def outdated(policy_version: int | None, ready: Iterable[tuple[str, int | None]], keep_ready: int) -> str | None:
    """Why a snapshot of ``policy_version`` is older than what GC keeps by age (None: it is not):
    at least ``keep_ready`` (and at least one) of the ``ready`` snapshots (identity, policy
    version) are newer, so it would be among the first collected (``None`` counts as 0, as in
    :func:`plan_gc`). A peer's hint alone does not load such a snapshot (``Collector.check_budget``)."""
    newer = sorted((pv or 0, ident) for ident, pv in ready if (pv or 0) > (policy_version or 0))
    if len(newer) < max(1, keep_ready):
        return None
    return (
        f"policy version {policy_version} is older than the {max(1, keep_ready)} newest ready here (up to "
        f"{newer[-1][1]}, policy version {newer[-1][0]}): not loaded for a peer's request alone"
    )


class Pins:
    """The identities GC must keep by name, ``pinned()`` (leases, current, target), and those it
    saw pinned at an earlier look that are not pinned now (*left*), the last ``limit`` seen."""

    def __init__(self, pinned: Callable[[], set[str]], limit: int = 64) -> None:
        self.pinned = pinned
        self._seen = RecentSet(limit)

    def now(self) -> tuple[set[str], set[str]]:
        """``(pinned, left)`` now; what is pinned now is remembered for later looks."""
        pinned = self.pinned()
        for ident in pinned:
            self._seen.add(ident)
        return pinned, {ident for ident in self._seen if ident not in pinned}
