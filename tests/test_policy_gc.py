"""Garbage collection policy (bdn.daemon.snapshots.retention): what stays in shm."""

from __future__ import annotations

from bdn.daemon.snapshots.retention import Held, Pins, outdated, plan_gc

NOW = 10_000.0
OLD = NOW - 3600


def ready(ident: str, pv: int, created: float = OLD, updated: float = OLD) -> Held:
    return Held(ident, "ready", pv, created, updated)


def test_keeps_the_newest_ready_by_policy_version() -> None:
    held = [ready("s1", 1), ready("s2", 2), ready("s3", 3), ready("s4", 4)]
    assert plan_gc(held, set(), keep_ready=2, grace_s=60, now=NOW) == (["s2", "s1"], ["s3", "s4"])


def test_created_breaks_ties_and_missing_policy_version_is_oldest() -> None:
    held = [ready("a", 1, created=OLD), ready("b", 1, created=OLD + 1), Held("c", "ready", None, OLD + 5, OLD)]
    remove, kept = plan_gc(held, set(), keep_ready=1, grace_s=0, now=NOW)
    assert kept == ["b"] and remove == ["a", "c"]


def test_pinned_in_progress_and_bases_are_kept() -> None:
    held = [
        ready("s1", 1),
        ready("s2", 2),
        ready("s3", 3),
        ready("s4", 4),
        ready("s5", 5),
        Held("s6", "downloading", 6, OLD, OLD, base_identity="s1"),
    ]
    remove, kept = plan_gc(held, pinned={"s2"}, keep_ready=1, grace_s=60, now=NOW)
    assert remove == ["s4", "s3"]
    assert kept == ["s1", "s2", "s5"]


def test_recently_ready_stays_for_the_grace_period() -> None:
    held = [ready("s1", 1, updated=NOW - 30), ready("s2", 2), ready("s3", 3)]
    assert plan_gc(held, set(), keep_ready=1, grace_s=60, now=NOW) == (["s2"], ["s1", "s3"])
    assert plan_gc(held, set(), keep_ready=1, grace_s=60, now=NOW + 31) == (["s2", "s1"], ["s3"])


def test_failed_snapshots_are_not_ready_and_not_removed_here() -> None:
    held = [Held("f", "failed", 9, OLD, OLD), ready("s1", 1)]
    assert plan_gc(held, set(), keep_ready=0, grace_s=0, now=NOW) == (["s1"], [])


def test_no_grace_for_what_the_replica_left() -> None:
    # a burst of hot-loads: s1..s3 became ready seconds ago, the replica served each and left
    # s1 and s2; without the grace for them GC frees s1 (keep_ready 2: s2, s3), and its files
    # become the page pool's spares for the next snapshot
    held = [ready("s1", 1, updated=NOW - 9), ready("s2", 2, updated=NOW - 6), ready("s3", 3, updated=NOW - 3)]
    assert plan_gc(held, {"s3"}, keep_ready=2, grace_s=60, now=NOW) == ([], ["s1", "s2", "s3"])
    assert plan_gc(held, {"s3"}, keep_ready=2, grace_s=60, now=NOW, left={"s1", "s2"}) == (["s1"], ["s2", "s3"])
    # a snapshot nobody targeted (an operator's prefetch, a peer's) keeps its grace
    held.append(ready("p", 0, updated=NOW - 1))
    assert plan_gc(held, {"s3"}, keep_ready=2, grace_s=60, now=NOW, left={"s1", "s2"}) == (["s1"], ["p", "s2", "s3"])


def test_pins_say_what_was_pinned_before_and_is_not_now() -> None:
    now: set[str] = {"s1"}
    pins = Pins(lambda: set(now), limit=2)
    assert pins.now() == ({"s1"}, set())
    now.clear()
    now.update({"s2", "s1"})  # the target moved on, s1 still served
    assert pins.now() == ({"s1", "s2"}, set())
    now.discard("s1")  # the engines serve s2: s1 left
    assert pins.now() == ({"s2"}, {"s1"})
    now.clear()
    now.update({"s3", "s4"})  # only the last 2 seen are remembered: s1 and s2 are forgotten (their grace is back)
    assert pins.now() == ({"s3", "s4"}, set())
    now.clear()
    assert pins.now() == (set(), {"s3", "s4"})


def test_a_snapshot_older_than_the_newest_kept_is_outdated_for_a_peers_hint() -> None:
    """``outdated``: what a peer's hint alone does not load (Catalog.check_budget)."""
    here = [("s5", 5), ("s6", 6)]
    assert outdated(7, here, keep_ready=2) is None  # newer: the owners' single flight
    assert outdated(6, here, keep_ready=2) is None  # (a re-publish at the same version)
    assert outdated(5, here, keep_ready=2) is None  # among the 2 newest
    why = outdated(1, here, keep_ready=2)
    assert why == (
        "policy version 1 is older than the 2 newest ready here (up to s6, policy version 6): "
        "not loaded for a peer's request alone"
    )
    assert outdated(5, here, keep_ready=1) is not None
    assert outdated(1, [], keep_ready=0) is None  # nothing ready here: a fresh node joins any
    assert outdated(1, [("s2", 2)], keep_ready=0) is not None  # (0 keeps at least what one newer says)
    assert outdated(None, [("x", None)], keep_ready=1) is None  # no version: as plan_gc, 0, not older
