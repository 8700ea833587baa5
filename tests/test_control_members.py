"""SWIM over a shared fleet list (bdn/control/members.py): the same protocol, O(changes) per view."""

from __future__ import annotations

import random

from bdn.control.members import MemberBase, MemberTable
from bdn.control.swim import ALIVE, DEAD, Swim
from tests.test_control_swim import FakeClock


class SharedCluster:
    """N Swim instances started from one MemberBase (a fleet every node agrees on)."""

    def __init__(self, n: int, seed: int = 1) -> None:
        self.clock = FakeClock()
        rng = random.Random(seed)
        ids = [f"n{i:05d}" for i in range(n)]
        self.base = MemberBase({i: f"http://{i}" for i in ids})
        self.nodes = {i: Swim(i, f"http://{i}", self.clock, rng=random.Random(rng.random())) for i in ids}
        for s in self.nodes.values():
            s.join_shared(self.base)
        self.down: set[str] = set()

    def send(self, msgs: list) -> None:
        queue = list(msgs)
        while queue:
            m = queue.pop()
            if m.dst in self.down or m.src in self.down or m.dst not in self.nodes:
                continue
            queue.extend(self.nodes[m.dst].receive(m))

    def run(self, seconds: float, step: float = 0.05) -> None:
        end = self.clock.t + seconds
        while self.clock.t < end:
            self.clock.t = round(self.clock.t + step, 6)
            for nid, s in self.nodes.items():
                if nid not in self.down and s.next_deadline() <= self.clock.t:
                    self.send(s.tick())


def test_table_reads_through_the_base_and_stores_only_changes() -> None:
    base = MemberBase({"a": "ua", "b": "ub", "c": "uc"})
    t = MemberTable(base, "a")
    assert len(t) == 2 and "a" not in t and t["b"].addr == "ub" and t.pristine()
    m = t.get("b")
    m.status = DEAD
    assert t.status_of("b") == ALIVE  # a copy until written back
    t["b"] = m
    assert t.status_of("b") == DEAD and len(t) == 2 and not t.pristine()
    t["d"] = m
    assert len(t) == 3 and sorted(t) == ["b", "c", "d"]
    assert t.pop("c") is not None and "c" not in t and len(t) == 2 and t.pop("c") is None
    order = base.ids and t.base_order(0.3, 0.7)
    assert sorted(order) == sorted(base.ids)  # a permutation: each base member once per round


def test_shared_views_share_the_live_tuple_and_detect_a_death_like_full_tables() -> None:
    c = SharedCluster(60)
    lives = {id(s.live()) for s in c.nodes.values()}
    assert len(lives) == 1 and len(next(iter(c.nodes.values())).live()) == 60  # one tuple for all
    c.run(5)
    assert all(len(s._members.own) <= 20 for s in c.nodes.values())  # probes stored no table
    victim = "n00007"
    c.down.add(victim)
    c.run(40)
    for nid, s in c.nodes.items():
        if nid != victim:
            assert s.status(victim) == "dead" and len(s.live()) == 59 and victim not in s.live()
            assert len(s._members.own) < 60  # changes only (the victim, the suspicions), not N
    probed = {s._probe.target for s in c.nodes.values() if s._probe is not None}
    assert victim not in probed


def test_joiner_is_learned_and_probed_over_a_shared_base() -> None:
    c = SharedCluster(30)
    j = Swim("joiner", "http://j", c.clock, rng=random.Random(7))
    c.nodes["joiner"] = j
    c.send(j.join({"n00001": "http://n00001"}))
    c.run(40)
    assert j.synced and len(j.live()) == 31
    assert all(s.is_live("joiner") for s in c.nodes.values())


def test_a_shared_view_syncs_the_same_table_as_a_full_one() -> None:
    c = SharedCluster(20)
    s = c.nodes["n00003"]
    c.down.add("n00005")
    c.run(30)
    assert s.status("n00005") == "dead"
    table = {u.node: (u.status, u.incarnation, u.addr) for u in s._table()}
    assert len(table) == 20 and table["n00005"][0] == DEAD and table["n00003"][0] == ALIVE
    assert {n: (m.status, m.incarnation, m.addr) for n, m in s._members.items()} == {
        n: v for n, v in table.items() if n != "n00003"
    }
