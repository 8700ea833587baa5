"""SWIM membership (bdn/control/swim.py) on a fake clock and an in-memory message queue."""

from __future__ import annotations

import math
import random

import pytest

from bdn.control.swim import ALIVE, DEAD, SUSPECT, Message, Swim, SwimError, Update


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Cluster:
    """N Swim instances, messages delivered instantly unless the receiver is down."""

    def __init__(self, n: int, seed: int = 1, probation: bool = True) -> None:
        self.clock = FakeClock()
        rng = random.Random(seed)
        self.nodes = {
            f"n{i:05d}": Swim(
                f"n{i:05d}", f"http://n{i}", self.clock, rng=random.Random(rng.random()), probation=probation
            )
            for i in range(n)
        }
        self.down: set[str] = set()
        self.delivered = 0
        ids = sorted(self.nodes)
        for i, nid in enumerate(ids):  # everyone knows two seeds: the join path fills in the rest
            seeds = {ids[(i + 1) % n]: "x", ids[(i + 2) % n]: "x"}
            self.send(self.nodes[nid].join(seeds))

    def send(self, msgs: list[Message]) -> None:
        queue = list(msgs)
        while queue:
            m = queue.pop()
            if m.dst in self.down or m.src in self.down or m.dst not in self.nodes:
                continue
            self.delivered += 1
            queue.extend(self.nodes[m.dst].receive(m))

    def run(self, seconds: float, step: float = 0.05) -> None:
        end = self.clock.t + seconds
        while self.clock.t < end:
            self.clock.t = round(self.clock.t + step, 6)
            for nid, s in self.nodes.items():
                if nid not in self.down and s.next_deadline() <= self.clock.t:
                    self.send(s.tick())


def test_everyone_learns_everyone_through_two_seeds() -> None:
    c = Cluster(40)
    # a simultaneous start: joins spread 8 per message, then the 30 s full sync; members heard
    # of second-hand wait for a confirmation probe (bdn.control.probation): 40 s here, 35 without
    c.run(45)
    for s in c.nodes.values():
        assert len(s.live()) == 40


def test_a_dead_member_is_suspected_then_removed_everywhere_in_log_n_periods() -> None:
    c = Cluster(64, probation=False)  # detection, not admission: the whole table within 35 s
    c.run(35)
    assert all(len(s.live()) == 64 for s in c.nodes.values())
    victim = "n00007"
    c.down.add(victim)
    before = {n: s.epoch for n, s in c.nodes.items()}
    # detection: expected e/(e-1) periods to be probed; suspicion 4 * log10(65) periods; spread O(log N)
    c.run(30)
    for n, s in c.nodes.items():
        if n != victim:
            assert victim not in s.live(), n
            assert s.status(victim) == "dead"
            assert s.epoch > before[n]


def test_indirect_probe_saves_a_member_whose_direct_path_fails() -> None:
    clock = FakeClock()
    a = Swim("a", "A", clock, rng=random.Random(1))
    b = Swim("b", "B", clock, rng=random.Random(2))
    h = Swim("h", "H", clock, rng=random.Random(3))
    nodes = {"a": a, "b": b, "h": h}
    for s in nodes.values():
        s.join({x: x.upper() for x in nodes if x != s.self_id})

    def deliver(msgs: list[Message]) -> None:
        q = list(msgs)
        while q:
            m = q.pop()
            if {m.src, m.dst} == {"a", "b"}:
                continue  # the direct a<->b path is broken
            q.extend(nodes[m.dst].receive(m))

    for _ in range(200):
        clock.t = round(clock.t + 0.05, 6)
        for s in nodes.values():
            if s.next_deadline() <= clock.t:
                deliver(s.tick())
    assert a.status("b") == "alive" and b.status("a") == "alive"


def test_suspected_member_refutes_with_a_higher_incarnation() -> None:
    clock = FakeClock()
    a = Swim("a", "A", clock)
    a.receive(Message("ping", "b", "a", 1, updates=(Update("a", SUSPECT, 0, "A"),)))
    assert a.incarnation == 1
    out = a.receive(Message("ping", "b", "a", 2))
    assert any(u.node == "a" and u.status == ALIVE and u.incarnation == 1 for u in out[0].updates)


def test_precedence_rules() -> None:
    clock = FakeClock()
    a = Swim("a", "A", clock)
    a.join({"b": "B"})
    a.receive(Message("ping", "c", "a", 1, updates=(Update("b", SUSPECT, 0, ""),)))
    assert a.status("b") == "suspect"
    a.receive(Message("ping", "c", "a", 2, updates=(Update("b", ALIVE, 0, ""),)))
    assert a.status("b") == "suspect"  # same incarnation: alive does not override suspect
    a.receive(Message("ping", "c", "a", 3, updates=(Update("b", ALIVE, 1, ""),)))
    assert a.status("b") == "alive"
    a.receive(Message("ping", "c", "a", 4, updates=(Update("b", DEAD, 1, ""),)))
    assert a.status("b") == "dead" and "b" not in a.live()
    a.receive(Message("ping", "c", "a", 5, updates=(Update("b", ALIVE, 2, "B2"),)))
    assert a.status("b") == "alive" and a.addr("b") == "B2"  # restarted and refuted


def test_messages_per_member_per_period_do_not_grow_with_n() -> None:
    rates = {}
    for n in (16, 128):
        c = Cluster(n, seed=3)
        c.run(3)
        start = sum(s.sent for s in c.nodes.values())
        c.run(20)
        rates[n] = (sum(s.sent for s in c.nodes.values()) - start) / n / 20
    assert rates[128] <= 1.2 * rates[16]
    assert rates[128] < 3.0  # ping + ack (+ a sync every 30 s)


def test_piggyback_is_bounded_and_retransmits_log_n_times() -> None:
    clock = FakeClock()
    a = Swim("a", "A", clock, max_piggyback=4, probation=False)  # news relayed at once
    a.join({f"m{i}": "x" for i in range(100)})
    for i in range(20):
        a.receive(Message("ping", "m0", "a", i, updates=(Update(f"new{i}", ALIVE, 0, "y"),)))
    sizes, sent_new0 = [], 0
    for _ in range(400):
        clock.t += 1.0
        for m in a.tick():
            if m.kind != "sync":
                sizes.append(len(m.updates))
            sent_new0 += sum(1 for u in m.updates if u == Update("new0", ALIVE, 0, "y"))
    assert max(sizes) <= 4
    limit = a.retransmit_mult * math.ceil(math.log2(a.table_size() + 2))
    assert 1 <= sent_new0 <= limit


def test_update_from_wire_rejects_bad_input() -> None:
    assert Update.from_wire(["n1", 0, 3, "http://x"]) == Update("n1", 0, 3, "http://x")
    for bad in (
        None,
        [],
        ["", 0, 0, ""],
        ["n", 3, 0, ""],
        ["n", 0, -1, ""],
        ["n", True, 0, ""],
        ["n", 0, 0, "x" * 600],
        ["n" * 200, 0, 0, ""],
    ):
        with pytest.raises(SwimError):
            Update.from_wire(bad)


def test_a_joiner_is_synced_only_after_a_full_table() -> None:
    clock = FakeClock()
    seed = Swim("s", "S", clock, rng=random.Random(1))
    seed.join({f"m{i}": "x" for i in range(10)}, complete=True)
    assert seed.synced and seed.is_live("m3") and not seed.is_live("nobody")
    j = Swim("j", "J", clock, rng=random.Random(2))
    out = j.join({"s": "S"})
    assert not j.synced and [m.kind for m in out] == ["sync"]
    (ack,) = seed.receive(out[0])
    assert ack.kind == "sync_ack"
    j.receive(ack)
    assert j.synced and len(j.live()) == 12 and seed.is_live("j")


def test_a_new_address_of_a_live_member_is_a_change_everyone_applies() -> None:
    """A member readvertises (its transfer server bound after its first messages): every other
    member reports it in ``changes`` with the new address, so the daemon re-reads it (a change
    that did not flip liveness was silently dropped: peers kept asking it over HTTP)."""
    c = Cluster(6)
    c.run(35)
    target = "n00002"
    for s in c.nodes.values():
        s.changes.clear()
    c.nodes[target].readvertise("http://n2 10.0.0.2:7082")
    c.run(20)
    for nid, s in c.nodes.items():
        if nid == target:
            continue
        assert s.addr(target) == "http://n2 10.0.0.2:7082", nid
        assert target in s.changes, nid


def test_live_patched_after_changes_equals_a_rebuild() -> None:
    """live() patches its sorted tuple with the members changed since the last call; it must
    equal the tuple rebuilt from the whole table whatever the changes (deaths, revivals, new
    members, a shared base), read after each change or after many."""
    from bdn.control.members import MemberBase

    rng = random.Random(7)
    clock = FakeClock()
    base = MemberBase({f"n{i:03d}": f"http://n{i}" for i in range(60)})
    s = Swim("n000", "http://n0", clock, rng=random.Random(1), probation=False)
    s.join_shared(base)

    def rebuilt() -> tuple[str, ...]:
        return tuple(sorted([n for n, m in s._members.items() if m.status != DEAD] + [s.self_id]))

    for step in range(400):
        clock.t += 0.01
        node = f"n{rng.randrange(80):03d}"
        status = rng.choice((ALIVE, SUSPECT, DEAD))
        s._apply(Update(node, status, step + 1, f"http://{node}"), clock.t, src=node)
        if rng.random() < 0.3:
            assert s.live() == rebuilt()
    assert s.live() == rebuilt()
