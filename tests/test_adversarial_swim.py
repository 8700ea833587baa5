"""Attacks on SWIM membership (bdn/control/swim.py, bdn/daemon/swarm/gossip.py) by a member that holds
the partition secret but lies, or is buggy: forged incarnations about another member.

The pure test drives two ``Swim`` objects; the daemon test runs two real bdnd processes and
signs ``POST members`` as a third node id ("evil"), as any holder of the secret can.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from bdn.control.swim import ALIVE, DEAD, Message, Swim, Update
from support.chains import anchor_swarm
from tests.support.api import wait_for
from tests.support.swarm import Daemon, Swarm

pytestmark = pytest.mark.timeout(300)
TOP = 2**63 - 1  # the largest incarnation the wire carries (bdn.control.swim.MAX_INCARNATION)


def test_a_death_forged_at_the_largest_incarnation_is_refuted_with_one_the_wire_carries() -> None:
    t = [0.0]
    a = Swim("a", "http://a", lambda: t[0])
    b = Swim("b", "http://b", lambda: t[0])
    a.join({"b": "http://b"}, complete=True)
    b.join({"a": "http://a"}, complete=True)
    # a liar tells both that a is dead, at the largest incarnation the wire carries
    forged = Update("a", DEAD, 2**63 - 1, "http://a")
    a.receive(Message("ping", "evil", "a", 1, updates=(forged,)))
    b.receive(Message("ping", "evil", "b", 1, updates=(forged,)))
    assert b.status("a") == "dead"
    assert a.incarnation == TOP  # refuted, and still an incarnation the wire accepts
    refutation = [u for u in a.tick() for u in u.updates if u.node == "a"]
    assert refutation and all(u.status == ALIVE for u in refutation)
    for u in refutation:
        assert Update.from_wire(u.wire()) == u  # what b's transport parses
    b.receive(Message("ping", "a", "b", 2, updates=tuple(refutation)))
    assert b.status("a") == "alive"
    # the liar cannot kill it again: no death outranks alive at the largest incarnation
    b.receive(Message("ping", "evil", "b", 3, updates=(forged,)))
    assert b.status("a") == "alive"


@pytest.fixture()
def swarm(tmp_path: Path) -> Iterator[Swarm]:
    with anchor_swarm(tmp_path, 2) as s:
        yield s


def members(d: Daemon, message: dict[str, Any]) -> tuple[int, Any]:
    """One signed ``POST members`` to ``d`` from node id "evil" (which holds the secret)."""
    status, body = d.peer_post("members", {"m": message}, "evil")
    return status, msgpack.unpackb(body) if status == 200 else body


def table_entry(d: Daemon, node: str) -> list[Any] | None:
    """``[node, status, incarnation, addr]`` of ``node`` in ``d``'s SWIM table (from a sync)."""
    status, ans = members(d, {"k": "sync", "s": "evil", "d": d.node_id, "q": 0})
    assert status == 200, ans
    rows = [u for r in ans["m"] if r["k"] == "sync_ack" for u in r.get("u", [])]
    return next((u for u in rows if u[0] == node), None)


def test_a_forged_death_at_the_largest_incarnation_does_not_exile_an_honest_daemon(swarm: Swarm) -> None:
    """Before the fix node0 refuted with incarnation 2^63, which node1 refused as malformed
    (with every message node0 sent from then on): node0 stayed dead to the swarm for good."""
    node0, node1 = swarm.daemons
    status, ans = members(
        node0, {"k": "ping", "s": "evil", "d": "node0", "q": 1, "u": [["node0", DEAD, 2**63 - 1, ""]]}
    )
    assert status == 200, ans
    wait_for(
        lambda: (e := table_entry(node1, "node0")) is not None and e[1] == ALIVE and e[2] == TOP,
        120,
        "node1 to hear node0's refutation",
    )
    assert any(p["node_id"] == "node0" and p["alive"] for p in node1.status()["peers"]), node1.status()["peers"]
    assert "bad membership answer" not in node1.log(), node1.log()
    # the same lie again changes nothing any more
    assert (
        members(node1, {"k": "ping", "s": "evil", "d": "node1", "q": 2, "u": [["node0", DEAD, 2**63 - 1, ""]]})[0]
        == 200
    )
    entry = table_entry(node1, "node0")
    assert entry is not None and entry[1] == ALIVE, entry
