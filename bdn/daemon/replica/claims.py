"""A hot-load target's claims checked against what this daemon read from the bucket.

A target's ``policy_version`` and ``published_at`` order it (``replica/target.py``) and come from
whichever member accepted or pushed it: any holder of the partition secret. The manifest this
daemon reads from the bucket itself is the root of trust (DESIGN.md, "Trust model"), so once it
is read here a target that contradicts it is refused (a push answers 400, a piggyback is
ignored), and the target adopted before it was read takes the manifest's values. A target
whose snapshot fails here before any manifest of it is read (an identity nobody published: an
accepted hot-load always names published files, so this is a member's invention, and it fails
at once) has its claims voided. Snapshots without a bdn manifest (their table is derived here,
not written by the trainer) have nothing to check against.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from bdn.daemon.replica import target as targets
from bdn.daemon.replica.ports import Snapshots
from bdn.daemon.replica.target import Target

log = logging.getLogger("bdn.hotload")


def manifest_says(snapshots: Snapshots, identity: str) -> tuple[int, str] | None:
    """``(policy_version, created_at)`` of ``identity``'s bdn manifest when read here, else None
    (not read yet, or a snapshot without a manifest)."""
    job = snapshots.get(identity)
    m = getattr(job, "manifest", None)
    if m is None or getattr(job, "foreign", None) is not None or getattr(job, "derived", False):
        return None
    return m.policy_version, m.created_at


class Claims:
    """The checks of one daemon, over its ``Snapshots``. ``voided`` remembers (bounded) the
    request ids of targets whose snapshot failed here before any manifest of it was read
    (nothing published, a manifest that never came): their claims vouch for nothing, so the
    target orders as ``(-1, 0)`` and the same request piggybacked again with its claim is ignored
    (a member's invented identity at policy version 2^63 - 1 would otherwise outrank every later
    hot-load). A new request for the same identity (the trainer published it since) is a new
    request id, taken as any other."""

    MAX_VOIDED = 256

    def __init__(self, snapshots: Snapshots) -> None:
        self.snapshots = snapshots
        self.voided: dict[str, None] = {}  # request ids, oldest first

    def contradiction(self, t: Target) -> str | None:
        """Why ``t`` is refuted here (one line), or None: its claims contradict the manifest read
        here, or its request's snapshot failed here without a manifest and it still claims one."""
        if t.request_id in self.voided and (t.policy_version, t.published_at) != (-1, 0.0):
            return (
                f"hot-load target {t.identity} ({t.request_id}) claims policy version {t.policy_version}, "
                "but no manifest of it could be read here"
            )
        says = manifest_says(self.snapshots, t.identity)
        return None if says is None else targets.contradiction(t, *says)

    def corrected(self, t: Target | None, changed: str) -> Target | None:
        """The target ``t`` once snapshot ``changed`` changed here: with its manifest's policy
        version and publish time when it is that snapshot and contradicts the manifest now read,
        or voided (``(-1, 0)``) when that snapshot failed before any manifest was read; else
        ``t`` unchanged. Each correction is logged once (it ends the contradiction)."""
        if t is None or t.identity != changed or t.seq == 0:  # seq 0: STARTUP_SNAPSHOT's, no claims
            return t
        job = self.snapshots.get(t.identity)
        says = manifest_says(self.snapshots, t.identity)
        if says is None:
            unread = job is not None and job.state == "failed" and getattr(job, "manifest", None) is None
            claimless = (t.policy_version, t.published_at) == (-1, 0.0)
            if not unread or claimless or getattr(job, "foreign", None) is not None:
                return t
            assert job is not None  # unread: it failed here
            self.voided[t.request_id] = None
            while len(self.voided) > self.MAX_VOIDED:
                del self.voided[next(iter(self.voided))]
            log.warning(
                "hot-load target %s claims policy version %d, but it failed here before any manifest "
                "of it was read (%s): it orders as unknown",
                t.identity,
                t.policy_version,
                job.reason,
            )
            return replace(t, policy_version=-1, published_at=0.0)
        why = targets.contradiction(t, *says)
        if why is None:
            return t
        log.warning("%s: the target takes the manifest's", why)
        return targets.as_manifest_says(t, *says)
