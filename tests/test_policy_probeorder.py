"""SWIM's round-robin probe order (bdn/control/probeorder.py, SWIM section 4.3): every member
that is not dead is probed exactly once per round, a dead one never, a joiner within the round."""

from __future__ import annotations

import random

from bdn.control.members import MemberTable, SwimEntry
from bdn.control.probeorder import ProbeOrder
from bdn.control.swimwire import ALIVE, DEAD, SUSPECT


def test_each_round_probes_every_member_not_dead_once_and_a_joiner_in_the_same_round() -> None:
    t = MemberTable()
    for i in range(20):
        t[f"n{i}"] = SwimEntry(DEAD if i == 3 else SUSPECT if i == 5 else ALIVE, 0, f"a{i}", 0.0)
    order = ProbeOrder(random.Random(1))
    rounds = []
    for _ in range(3):
        rounds.append([order.next(t) for _ in range(19)])
    for r in rounds:
        assert sorted(r) == sorted(f"n{i}" for i in range(20) if i != 3)
    assert rounds[0] != rounds[1]  # re-shuffled each round
    # a member joining mid-round is probed before the round ends
    first = [order.next(t) for _ in range(5)]
    t["new"] = SwimEntry(ALIVE, 0, "anew", 0.0)
    order.insert("new")
    rest = [order.next(t) for _ in range(15)]
    assert "new" in rest and sorted(first + rest) == sorted([*rounds[0], "new"])


def test_no_member_to_probe() -> None:
    assert ProbeOrder(random.Random(1)).next(MemberTable()) is None
