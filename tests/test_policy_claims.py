"""The pure rules of a hot-load target's claims (bdn/daemon/replica/target.py, replica/claims.py):
a target's policy version and publish time against the manifest read here, the correction once
it is read, and a target whose snapshot failed before any manifest was read voided."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bdn.daemon.replica.claims import Claims
from bdn.daemon.replica.target import Target, as_manifest_says, contradiction, later, published_at

CREATED = "2026-12-01T10:00:00Z"
AT = published_at(CREATED)


@dataclass
class _Manifest:
    policy_version: int
    created_at: str


@dataclass
class _Job:
    identity: str
    state: str = "downloading"
    reason: str = ""
    manifest: _Manifest | None = None
    foreign: object = None


class _Snapshots:
    def __init__(self) -> None:
        self.jobs: dict[str, _Job] = {}

    def get(self, identity: str) -> _Job | None:
        return self.jobs.get(identity)

    def prefetch(self, identity: str, requested_by: str = "local", wait_publish: bool = True) -> _Job:
        return self.jobs.setdefault(identity, _Job(identity, "queued"))

    def ready_dir(self, identity: str) -> Path:
        return Path("/nonexistent") / identity

    def stored_dir(self, identity: str) -> Path:
        return Path("/nonexistent") / identity

    async def cancel(self, identity: str, reason: str = "cancelled") -> _Job:
        return self.jobs[identity]


def _target(ident: str, pv: int, at: float, gen: int = 5, rid: str = "r1") -> Target:
    return Target(ident, 1, "node0", rid, gen=gen, policy_version=pv, published_at=at)


def test_contradiction_is_any_claim_but_the_manifests_or_none() -> None:
    assert contradiction(_target("s2", 2, AT), 2, CREATED) is None
    assert contradiction(_target("s2", -1, 0.0), 2, CREATED) is None  # accepted before the manifest existed
    why = contradiction(_target("s2", 2**63 - 1, AT), 2, CREATED)
    assert why is not None and "claims policy version 9223372036854775807" in why and "says policy version 2" in why
    assert contradiction(_target("s2", 2, AT + 1), 2, CREATED) is not None
    assert contradiction(_target("s2", 2, 0.0), 2, CREATED) is not None  # half a claim is a claim
    fixed = as_manifest_says(_target("s2", 2**63 - 1, 9.9e10), 2, CREATED)
    assert (fixed.policy_version, fixed.published_at, fixed.request_id) == (2, AT, "r1")


def test_claims_check_only_what_was_read_here_and_correct_the_target() -> None:
    snaps = _Snapshots()
    claims = Claims(snaps)
    lie = _target("s2", 2**63 - 1, 9.9e10)
    assert claims.contradiction(lie) is None  # nothing read yet: nothing to check against
    snaps.jobs["s2"] = _Job("s2", manifest=_Manifest(2, CREATED))
    assert claims.contradiction(lie) is not None
    fixed = claims.corrected(lie, "s2")
    assert fixed is not None and (fixed.policy_version, fixed.published_at) == (2, AT)
    assert claims.corrected(lie, "s3") is lie  # another snapshot changed
    assert claims.corrected(None, "s2") is None
    honest_next = _target("s3", 3, AT + 60)
    assert later(honest_next, fixed) and not later(honest_next, lie)
    # a snapshot without a bdn manifest: its table is derived here, nothing to check
    snaps.jobs["f1"] = _Job("f1", manifest=_Manifest(0, ""), foreign=object())
    assert claims.contradiction(_target("f1", 7, 1.0)) is None


def test_a_claim_whose_snapshot_failed_unread_is_voided_by_request_id() -> None:
    snaps = _Snapshots()
    claims = Claims(snaps)
    lie = _target("invented", 2**63 - 1, 9.9e10, rid="liar1")
    snaps.jobs["invented"] = _Job("invented", "failed", "nothing is published under invented/")
    voided = claims.corrected(lie, "invented")
    assert voided is not None and (voided.policy_version, voided.published_at) == (-1, 0.0)
    assert claims.contradiction(lie) is not None  # the same request pushed again
    assert claims.contradiction(voided) is None
    assert claims.contradiction(_target("invented", 4, AT, rid="trainer2")) is None  # a new request: taken
    # a target without claims, or a failure after the manifest was read, voids nothing
    snaps.jobs["s4"] = _Job("s4", "failed", "cancelled", manifest=_Manifest(4, CREATED))
    t = _target("s4", 4, AT, rid="r4")
    assert claims.corrected(t, "s4") is t
    claimless = _target("invented", -1, 0.0, rid="r5")
    assert claims.corrected(claimless, "invented") is claimless
    for i in range(Claims.MAX_VOIDED + 10):  # bounded
        claims.corrected(_target("invented", 1, AT, rid=f"x{i}"), "invented")
    assert len(claims.voided) == Claims.MAX_VOIDED
