"""A hot-load target's claims checked against what this daemon read from the bucket.

A target's ``policy_version`` and ``published_at`` order it (``replica/target.py``) and come from
whichever member accepted or pushed it: any holder of the partition secret. The manifest this
daemon reads from the bucket itself is the root of trust (DESIGN.md, "Trust model"), so once it
is read here a target that contradicts it is refused (a push answers 400, a piggyback is
ignored), and the target adopted before it was read takes the manifest's values. Snapshots
without a bdn manifest (their table is derived here, not written by the trainer) have nothing
to check against.
"""

from __future__ import annotations

import logging

from bdn.daemon.replica import target as targets
from bdn.daemon.replica.ports import Snapshots
from bdn.daemon.replica.target import Target

log = logging.getLogger("bdn.hotload")


def manifest_says(snapshots: Snapshots, identity: str) -> tuple[int, str] | None:
    """``(policy_version, created_at)`` of ``identity``'s bdn manifest when read here, else None
    (not read yet, or a snapshot without a manifest)."""
    job = snapshots.get(identity)
    m = getattr(job, "manifest", None)
    if m is None or getattr(job, "foreign", None) is not None:
        return None
    return m.policy_version, m.created_at


def contradiction(snapshots: Snapshots, t: Target) -> str | None:
    """Why ``t`` contradicts the manifest read here (one line), or None, also when none is read yet."""
    says = manifest_says(snapshots, t.identity)
    return None if says is None else targets.contradiction(t, *says)


def corrected(snapshots: Snapshots, t: Target | None, changed: str) -> Target | None:
    """The target ``t`` once snapshot ``changed`` changed here: ``t`` with its manifest's policy
    version and publish time when it is that snapshot and contradicts the manifest now read
    (logged once: the correction ends the contradiction), else ``t`` unchanged."""
    if t is None or t.identity != changed or t.seq == 0:  # seq 0: STARTUP_SNAPSHOT's, no claims
        return t
    says = manifest_says(snapshots, t.identity)
    why = None if says is None else targets.contradiction(t, *says)
    if says is None or why is None:
        return t
    log.warning("%s: the target takes the manifest's", why)
    return targets.as_manifest_says(t, *says)
