"""Which ready snapshots garbage collection removes: a pure policy (DESIGN.md, "Garbage collection").

Kept: every *pinned* identity (leased by an engine, served now, the hot-load target), every
snapshot in progress and its base, the ``keep_ready`` newest ready ones by ``(policy_version,
created)`` (the next delta's base), and any that became ready (or changed) less than
``grace_s`` seconds ago (someone wanted it: an operator's prefetch, a peer still pulling it).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

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
) -> tuple[list[str], list[str]]:
    """``(remove, kept)``: ready identities to remove (newest first) and the ready ones kept (sorted)."""
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
    keep.update(h.identity for h in ready if now - h.updated < grace_s)
    return [h.identity for h in ready if h.identity not in keep], sorted(
        h.identity for h in ready if h.identity in keep
    )
