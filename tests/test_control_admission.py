"""Admission of SWIM members (bdn/control/probation.py, bdn/control/swim.py): what one member that
holds the partition secret can add to a daemon's live set. Pure tests on an injected clock, then
two real bdnd processes flooded with a sync of 25,000 invented members (docs/TRUST.md)."""

from __future__ import annotations

import http.client
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from bdn.control.probation import Probation
from bdn.control.swim import ALIVE, Message, Swim, Update
from bdn.proto.keys import derive_keys, sign_request
from tests.support.api import wait_for
from tests.support.swarm import SECRET, Daemon, Swarm, running

KEYS = derive_keys(SECRET)
FLOOD = 25_000


def test_probation_bounds_per_source_and_in_all_and_drops_the_stale() -> None:
    p = Probation(per_source=2, limit=3, ttl_s=10.0)
    assert p.offer("a", "ua", "evil", 0.0) and p.offer("b", "ub", "evil", 0.0)
    assert not p.offer("c", "uc", "evil", 0.0)  # evil has 2 waiting
    assert p.offer("a", "ua2", "evil", 1.0) and p.get("a").update == "ua2"  # a newer update replaces
    assert p.offer("d", "ud", "honest", 0.0)
    assert not p.offer("e", "ue", "other", 0.0)  # 3 in all
    assert p.refused == 2 and len(p) == 3
    w = p.next_probe(1.0)
    assert w is not None and w.update == "ua2" and w.probed  # oldest first
    assert p.next_probe(1.0).update == "ub"
    assert p.take("a").update == "ua2" and p.confirmed == 1
    assert p.offer("c", "uc", "evil", 2.0)  # evil's slot is free again
    p.drop("b")
    assert p.dropped == 1 and "b" not in p
    assert p.next_probe(11.0).update == "uc"  # d waited 11 s unprobed: dropped first
    assert "d" not in p and p.dropped == 2


def _pair() -> tuple[list[float], Swim, Swim]:
    t = [0.0]
    a = Swim("a", "http://a", lambda: t[0], rng=random.Random(1))
    b = Swim("b", "http://b", lambda: t[0], rng=random.Random(2))
    a.join({"b": "http://b"}, complete=True)
    b.join({"a": "http://a"}, complete=True)
    return t, a, b


def test_a_sync_of_invented_members_adds_none_to_the_live_set() -> None:
    _t, a, _b = _pair()
    epoch = a.epoch
    flood = tuple(Update(f"fake{i}", ALIVE, 0, f"http://10.0.{i // 250}.{i % 250}:7080") for i in range(FLOOD))
    a.receive(Message("sync", "evil", "a", 0, updates=flood))
    assert a.live() == ("a", "b") and a.epoch == epoch
    assert len(a.newcomers) == 16 and a.newcomers.refused == FLOOD - 16
    assert {u.node for u in a._table()} == {"a", "b"}  # nothing of it is relayed in a's tables
    # the same through piggybacked updates: the same bound per source
    a.receive(Message("ping", "evil", "a", 1, updates=tuple(Update(f"more{i}", ALIVE, 0, "x") for i in range(64))))
    assert len(a.newcomers) == 16 and a.live() == ("a", "b")


def test_a_newcomer_heard_of_second_hand_counts_once_it_answers_its_probe() -> None:
    t, a, b = _pair()
    a.receive(Message("ping", "b", "a", 1, updates=(Update("c", ALIVE, 3, "http://c"),)))
    assert "c" not in a.live() and "c" in a.newcomers and a.addr("c") == "http://c"
    pings: list[Message] = []
    while not any(m.dst == "c" for m in pings):  # every other period's ping is a confirmation probe
        assert t[0] < 3.0
        t[0] += 1.0
        pings += [m for m in a.tick() if m.kind == "ping"]
    a.receive(Message("ack", "c", "a", pings[-1].seq))
    assert "c" in a.live() and a.status("c") == "alive" and "c" not in a.newcomers
    assert any(u.node == "c" and u.incarnation == 3 for u in a._piggyback())  # relayed now
    t[0] += 1.0
    assert [m.dst for m in a.tick() if m.kind == "ping"] in (["b"], ["c"])  # the round-robin again


def test_an_unanswered_newcomer_is_dropped_and_never_suspected() -> None:
    t, a, b = _pair()
    a.receive(Message("ping", "b", "a", 1, updates=(Update("ghost", ALIVE, 0, "http://nowhere"),)))
    for _ in range(6):
        t[0] += 1.0
        a.tick()
    assert "ghost" not in a.newcomers and a.newcomers.dropped == 1
    assert a.status("ghost") is None and "ghost" not in a.live()
    assert not any(u.node == "ghost" for u in a._piggyback())


def test_a_member_s_own_message_and_a_seed_s_table_are_admitted_at_once() -> None:
    t, a, b = _pair()
    a.receive(Message("ping", "d", "a", 1, updates=(Update("d", ALIVE, 0, "http://d"),)))
    assert "d" in a.live()  # its own entry, from itself
    j = Swim("j", "http://j", lambda: t[0], rng=random.Random(3))
    (sync,) = j.join({"a": "http://a"})
    (ack,) = a.receive(sync)
    j.receive(ack)
    assert set(j.live()) == {"a", "b", "d", "j"} and j.synced  # the seed's whole table
    # an unsolicited sync_ack is no seed's answer: its newcomers wait
    j.receive(Message("sync_ack", "b", "j", 0, updates=(Update("e", ALIVE, 0, "http://e"),)))
    assert "e" not in j.live() and "e" in j.newcomers


# ---- real daemons -----------------------------------------------------------------------------


@pytest.fixture()
def swarm(tmp_path: Path) -> Iterator[Swarm]:
    with Swarm(tmp_path / "work", 2, f"file://{tmp_path}", extra_env={"BDN_LOAD_STARTUP": "false"}) as s:
        yield s


def members(d: Daemon, message: dict[str, Any]) -> tuple[int, Any]:
    """One signed ``POST members`` to ``d`` from node id "evil" (which holds the secret)."""
    path = f"/bdn/v1/{KEYS.swarm_id}/members"
    conn = http.client.HTTPConnection("127.0.0.1", d.peer_port, timeout=60)
    try:
        conn.request(
            "POST",
            path,
            body=msgpack.packb({"m": message}),
            headers={"Authorization": sign_request(KEYS, "POST", path, "evil", to=d.node_id)},
        )
        r = conn.getresponse()
        body = r.read()
        return r.status, msgpack.unpackb(body) if r.status == 200 else body
    finally:
        conn.close()


@pytest.mark.timeout(300)
def test_a_flood_of_invented_members_stays_out_and_a_real_joiner_gets_in(swarm: Swarm, tmp_path: Path) -> None:
    node0, node1 = swarm.daemons
    flood = [[f"fake{i}", ALIVE, 0, f"http://10.9.{i // 250}.{i % 250}:7080"] for i in range(FLOOD)]
    status, ans = members(node0, {"k": "sync", "s": "evil", "d": "node0", "q": 0, "u": flood})
    assert status == 200, ans
    table = {u[0] for r in ans["m"] if r["k"] == "sync_ack" for u in r.get("u", [])}
    assert not any(n.startswith("fake") for n in table), len(table)
    wait_for(
        lambda: node0.status()["membership"].get("newcomers_refused", 0) >= FLOOD - 16,
        120,
        "node0 to count the refused newcomers",
    )
    st = node0.status()
    assert st["membership"]["newcomers_waiting"] <= 16 and st["membership"]["members"] <= 3, st["membership"]
    assert {p["node_id"] for p in st["peers"]} <= {"node1", "evil", ""}, st["peers"]
    # a real daemon that knows only node0 is learned by node1 second-hand, and counts there
    # once it answered node1's probe (or pinged node1 itself)
    node2 = Daemon(tmp_path / "work", "node2", f"file://{tmp_path}", extra_env={"BDN_LOAD_STARTUP": "false"})
    with running(node2, [node0.peer_url]):

        def sees(d: Daemon, other: str) -> bool:
            return any(p["node_id"] == other and p["alive"] for p in d.status()["peers"])

        wait_for(
            lambda: sees(node1, "node2") and sees(node2, "node1") and sees(node0, "node2"),
            120,
            "node2 to be admitted by node0 and node1",
        )
        assert sees(node0, "node1") and sees(node1, "node0")


def test_a_second_live_member_s_word_admits_a_newcomer_one_member_and_its_aliases_do_not() -> None:
    t, a, b = _pair()
    a.receive(Message("ping", "c", "a", 1, updates=(Update("c", ALIVE, 0, "http://c"),)))  # c: a member
    a.receive(Message("ping", "b", "a", 2, updates=(Update("n", ALIVE, 0, "http://n"),)))
    assert "n" not in a.live()
    a.receive(Message("ping", "b", "a", 3, updates=(Update("n", ALIVE, 0, "http://n"),)))
    assert "n" not in a.live()  # the same member twice
    for alias in ("evil1", "evil2"):  # node ids a holder of the secret signs as: not members here
        a.receive(Message("ping", alias, "a", 4, updates=(Update("n", ALIVE, 0, "http://n"),)))
    assert "n" not in a.live()
    a.receive(Message("ping", "c", "a", 5, updates=(Update("n", ALIVE, 0, "http://n"),)))
    assert "n" in a.live() and "n" not in a.newcomers  # b and c: two members


# ---- designated confirmers (bdn.control.probation.confirms) -------------------------------------


def test_about_confirmers_members_of_a_large_fleet_confirm_a_newcomer_and_all_of_a_small_one() -> None:
    from bdn.control.probation import confirms

    fleet = [f"m{i}" for i in range(10_000)]
    counts = [sum(confirms(m, f"joiner{j}", len(fleet), 16) for m in fleet) for j in range(20)]
    assert 4 <= min(counts) and max(counts) <= 40 and 12 <= sum(counts) / len(counts) <= 20
    assert all(confirms(m, "joiner", 10, 16) for m in fleet[:10])  # a fleet of <= 16: everyone
    assert confirms("m1", "j", 10_000, 16) == confirms("m1", "j", 10_000, 16)  # the same everywhere


def _fleet(n: int, t: list[float]) -> dict[str, Swim]:
    from bdn.control.members import MemberBase

    base = MemberBase({f"m{i}": f"http://m{i}" for i in range(n)}, 0.0)
    out = {}
    for i in range(n):
        s = Swim(f"m{i}", f"http://m{i}", lambda: t[0], rng=random.Random(i))
        s.join_shared(base)
        out[s.self_id] = s
    return out


def test_only_designated_confirmers_probe_a_newcomer_heard_of_second_hand() -> None:
    from bdn.control.probation import confirms

    t = [0.0]
    fleet = _fleet(200, t)
    n = len(fleet)
    probed: dict[str, int] = {}
    for s in fleet.values():  # every member hears of "j" from m0 alone (one word: it waits)
        if s.self_id != "m0":
            s.receive(Message("ping", "m0", s.self_id, 1, updates=(Update("j", ALIVE, 0, "http://j"),)))
    for _ in range(6):
        t[0] += 1.0
        for s in fleet.values():
            for m in s.tick():
                if m.dst == "j":
                    probed[s.self_id] = probed.get(s.self_id, 0) + 1
    want = {m for m in fleet if m != "m0" and confirms(m, "j", n, 16) and not confirms("m0", "j", n, 16)}
    assert set(probed) == want and all(c == 1 for c in probed.values())  # each probes it once
    assert 0 < len(probed) <= 40  # ~16 of 200, not 199


def test_a_joiner_pings_its_confirmers_and_their_word_alone_admits_it_at_a_rate() -> None:
    from bdn.control.probation import confirms

    t = [0.0]
    fleet = _fleet(200, t)
    n = len(fleet) + 1
    j = Swim("j", "http://j", lambda: t[0], rng=random.Random(7))
    (sync,) = j.join({"m0": "http://m0"})
    (ack,) = fleet["m0"].receive(sync)
    pings = j.receive(ack)  # its first whole table: one ping to each of its confirmers
    want = {m for m in fleet if confirms(m, "j", n, 16)}
    assert {p.dst for p in pings} == want and all(p.kind == "ping" for p in pings) and len(pings) <= 64
    c = sorted(want)[0]
    fleet[c].receive(pings[[p.dst for p in pings].index(c)])
    assert "j" in fleet[c].live()  # heard from directly
    others = [s for s in fleet.values() if s.self_id not in want and s.self_id != "m0"]
    # the confirmer's word alone admits j at a member that is no confirmer ...
    others[0].receive(Message("ping", c, others[0].self_id, 5, updates=(Update("j", ALIVE, 0, "http://j"),)))
    assert "j" in others[0].live()
    # ... one newcomer per source per period: a second one from the same confirmer in the same
    # period waits (if c confirms it too), and a non-confirmer's word waits for a second word
    k = next(x for x in (f"k{i}" for i in range(10_000)) if confirms(c, x, n, 16))
    others[0].receive(Message("ping", c, others[0].self_id, 6, updates=(Update(k, ALIVE, 0, "http://k"),)))
    assert k not in others[0].live() and k in others[0].newcomers
    plain = next(s.self_id for s in others[2:] if not confirms(s.self_id, "q", n, 16))
    others[1].receive(Message("ping", plain, others[1].self_id, 7, updates=(Update("q", ALIVE, 0, "http://q"),)))
    assert "q" not in others[1].live() and "q" in others[1].newcomers
