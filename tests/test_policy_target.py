"""Hot-load target ordering (bdn.daemon.replica.target): a later generation wins, then the
trainer's policy version and publish time, never the accepting daemon's clock; the future is refused."""

from __future__ import annotations

from bdn.daemon.process.clock import FakeClock
from bdn.daemon.replica.target import MAX_FUTURE_NS, Target, later, supersedes

NOW = FakeClock().time_ns()


def t(
    ident: str, seq: int, origin: str = "n1", rid: str = "r1", gen: int | None = None, pv: int = -1, at: float = 0.0
) -> Target:
    return Target(ident, seq, origin, rid, gen=seq if gen is None else gen, policy_version=pv, published_at=at)


def test_later_generation_wins_then_the_trainers_values_never_the_clock() -> None:
    assert later(t("s2", 2), t("s1", 1))
    assert not later(t("s1", 1), t("s2", 2))
    assert later(t("s1", 9, gen=3, pv=1), t("s2", 1, gen=2, pv=2))  # a rollback posted after: wins
    # the same generation (accepted concurrently by two daemons): policy version, then publish time
    assert later(t("s2", 1, gen=4, pv=2), t("s1", 10**18, gen=4, pv=1))  # a later clock does not help
    assert later(t("s2", 1, gen=4, pv=2, at=20.0), t("s3", 10**18, gen=4, pv=2, at=10.0))
    assert not later(t("s2", 5, "n2", gen=1), t("s2", 7, "n1", gen=1))  # equal order: not later
    assert later(t("s1", 1), None)


def test_startup_target_seq0_is_beaten_by_any_hot_load() -> None:
    assert later(t("s9", 1), Target("s1", 0, "startup", "startup"))


def test_wire_refuses_a_generation_out_of_range() -> None:
    good = t("s1", NOW, gen=5, pv=3, at=1.5).wire()
    assert Target.from_wire(good, NOW) == t("s1", NOW, gen=5, pv=3, at=1.5)
    for bad in (
        {**good, "gen": -1},
        {**good, "gen": 2**60},
        {**good, "pv": -2},
        {**good, "at": "x"},
        {**good, "gen": True},
    ):
        assert Target.from_wire(bad, NOW) is None


def test_superseded_records() -> None:
    assert supersedes(t("s2", 2, rid="r2"), t("s1", 1)) == ("s1", "s2")
    assert supersedes(t("s1", 1, rid="r1"), t("s2", 2, rid="r2")) == ("s1", "s2")  # an older one loses
    assert supersedes(t("s1", 2, rid="r2"), t("s1", 1)) is None  # same identity
    assert supersedes(t("s1", 1), t("s2", 2, rid="r1")) is None  # the same request seen again
    assert supersedes(t("s1", 1), None) is None


def test_wire_round_trip() -> None:
    x = t("step000002", NOW - 5)
    assert Target.from_wire(x.wire(), NOW) == x


def test_wire_refuses_the_future_and_malformed_maps() -> None:
    assert Target.from_wire(t("s1", NOW + MAX_FUTURE_NS).wire(), NOW) is not None
    assert Target.from_wire(t("s1", NOW + MAX_FUTURE_NS + 1).wire(), NOW) is None
    good = t("s1", NOW).wire()
    for bad in (
        None,
        [],
        {**good, "seq": True},
        {**good, "seq": 0},
        {**good, "seq": "1"},
        {**good, "identity": "../x"},
        {**good, "origin": 5},
        {**good, "request_id": None},
    ):
        assert Target.from_wire(bad, NOW) is None


def test_wire_truncates_long_fields() -> None:
    got = Target.from_wire({**t("s1", NOW).wire(), "origin": "o" * 500, "request_id": "r" * 500}, NOW)
    assert got is not None and len(got.origin) == 64 and len(got.request_id) == 64
