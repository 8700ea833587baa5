"""Hot-load target ordering (bdn.daemon.replica.target): later wins, the future is refused."""

from __future__ import annotations

from bdn.daemon.clock import FakeClock
from bdn.daemon.replica.target import MAX_FUTURE_NS, Target, later, supersedes

NOW = FakeClock().time_ns()


def t(ident: str, seq: int, origin: str = "n1", rid: str = "r1") -> Target:
    return Target(ident, seq, origin, rid)


def test_later_seq_wins_and_origin_breaks_ties() -> None:
    assert later(t("s2", 2), t("s1", 1))
    assert not later(t("s1", 1), t("s2", 2))
    assert later(t("s2", 5, "n2"), t("s1", 5, "n1"))
    assert not later(t("s2", 5, "n1"), t("s1", 5, "n1"))  # equal order: not later
    assert later(t("s1", 1), None)


def test_startup_target_seq0_is_beaten_by_any_hot_load() -> None:
    assert later(t("s9", 1), Target("s1", 0, "startup", "startup"))


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
    for bad in (None, [], {**good, "seq": True}, {**good, "seq": 0}, {**good, "seq": "1"},
                {**good, "identity": "../x"}, {**good, "origin": 5}, {**good, "request_id": None}):
        assert Target.from_wire(bad, NOW) is None


def test_wire_truncates_long_fields() -> None:
    got = Target.from_wire({**t("s1", NOW).wire(), "origin": "o" * 500, "request_id": "r" * 500}, NOW)
    assert got is not None and len(got.origin) == 64 and len(got.request_id) == 64
