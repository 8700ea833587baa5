"""Membership transitions (bdn.daemon.swarm.membership) with a fake clock: learn, alive, failed,
forgotten, penalised."""

from __future__ import annotations

from bdn.daemon.process.clock import FakeClock
from bdn.daemon.serve.transfer_address import learn, peer_of, wired
from bdn.daemon.swarm.membership import Membership

SELF_URL = "http://n0:7080"


class _Request:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


def _table(static: list[str] | None = None) -> tuple[Membership, FakeClock]:
    clock = FakeClock()
    return Membership("n0", SELF_URL, static or [], clock), clock


def test_static_members_start_not_alive_and_self_is_excluded() -> None:
    m, _ = _table(["http://n1:7080/", SELF_URL])
    assert list(m.members) == ["http://n1:7080"]
    assert m.live() == [] and m.hrw_nodes() == ["n0"]


def test_learn_ignores_self_and_non_http_urls() -> None:
    m, _ = _table()
    assert m.learn(SELF_URL) is None
    assert m.learn("http://x:1", "n0") is None
    assert m.learn("ftp://x:1") is None
    assert m.learn("http://n2:7080", "n2") is not None
    assert m.live() == []  # learned, not yet answered


def test_mark_ok_makes_a_member_live_and_part_of_hrw() -> None:
    m, _ = _table(["http://n1:7080"])
    m.mark_ok("http://n1:7080", "n1")
    assert [x.node_id for x in m.live()] == ["n1"]
    assert m.hrw_nodes() == ["n0", "n1"] and set(m.by_node()) == {"n1"}


def test_two_failures_leave_hrw_and_cancel_parked_requests() -> None:
    m, _ = _table(["http://n1:7080"])
    m.mark_ok("http://n1:7080", "n1")
    req = _Request()
    m.members["http://n1:7080"].requests.add(req)
    m.mark_failed("http://n1:7080")
    assert len(m.live()) == 1 and not req.cancelled
    m.mark_failed("http://n1:7080")
    assert m.live() == [] and req.cancelled
    m.mark_ok("http://n1:7080", "n1")
    assert len(m.live()) == 1


def test_learned_members_are_forgotten_after_many_failures_static_ones_never() -> None:
    m, _ = _table(["http://s:7080"])
    m.learn("http://l:7080", "l")
    for _ in range(Membership.FORGET_AFTER):
        m.mark_failed("http://l:7080")
        m.mark_failed("http://s:7080")
    assert "http://l:7080" not in m.members and "http://s:7080" in m.members


def test_penalty_expires_on_the_clock() -> None:
    m, clock = _table(["http://n1:7080"])
    m.mark_ok("http://n1:7080", "n1")
    m.penalise("http://n1:7080", 30.0)
    assert m.live() == [] and m.describe()[0]["penalised"]
    clock.advance(29.9)
    assert m.live() == []
    clock.advance(0.2)
    assert len(m.live()) == 1 and not m.describe()[0]["penalised"]


def test_member_table_is_bounded() -> None:
    m, _ = _table()
    for i in range(Membership.MAX_MEMBERS + 10):
        m.learn(f"http://h{i}:1")
    assert len(m.members) == Membership.MAX_MEMBERS


def test_one_daemon_under_two_urls_is_one_live_member() -> None:
    """A static peer URL (an IP) and the URL that daemon advertises (its host name) name one node:
    it counts once in the live set and in HRW (the new-user check saw it listed and counted twice)."""
    m, clock = _table(["http://127.0.0.1:7081"])
    m.mark_ok("http://127.0.0.1:7081", "n1")
    clock.advance(1.0)
    m.learn("http://vm:7081", "n1")
    m.mark_ok("http://vm:7081", "n1")
    live = m.live()
    assert [x.node_id for x in live] == ["n1"] and live[0].url == "http://127.0.0.1:7081"  # the static one
    assert m.hrw_nodes() == ["n0", "n1"]
    rows = m.describe()  # one row for the operator too, the other URL under "also"
    assert [(r["node_id"], r["url"], r["also"]) for r in rows] == [("n1", "http://127.0.0.1:7081", ["http://vm:7081"])]


def test_owners_are_computed_once_per_epoch() -> None:
    from bdn.proto import hrw

    m, clock = _table(["http://n1:7080", "http://n2:7080"])
    m.mark_ok("http://n1:7080", "n1")
    m.mark_ok("http://n2:7080", "n2")
    e = m.epoch if m.live() else -1
    om = m.owner_map("s1")
    assert m.owner_map("s1") is om and m.epoch == e  # same epoch, same map
    assert om.owner("ab" * 16) == hrw.owner(["n0", "n1", "n2"], "ab" * 16)
    m.mark_dead("http://n2:7080")
    om2 = m.owner_map("s1")
    assert m.epoch == e + 1 and om2 is not om and set(om2.live) == {"n0", "n1"}
    clock.advance(1.0)
    m.mark_ok("http://n1:7080", "n1")  # no change of the live set: no new epoch
    assert m.owner_map("s1") is om2


def test_only_members_with_a_valid_transfer_address_are_chunk_peers() -> None:
    """Chunks move only over the transfer wire: a member whose membership payload advertises no
    transfer address, or a malformed one, is never planned as a chunk peer (``wired``)."""
    m, _ = _table(["http://n1:7080", "http://n2:7080", "http://n3:7080", "http://n4:7080"])
    for url, node, transfer in (
        ("http://n1:7080", "n1", "10.0.0.1:7082"),
        ("http://n2:7080", "n2", None),
        ("http://n3:7080", "n3", "10.0.0.3:99999"),  # no such port
        ("http://n4:7080", "", "10.0.0.4:7082"),  # node id not learned yet: the handshake needs it
    ):
        member = m.members[url]
        member.node_id = node
        learn(member, {"transfer": transfer})
    assert [x.url for x in wired(list(m.members.values()))] == ["http://n1:7080"]
    p = peer_of(m.members["http://n1:7080"])
    assert p is not None and (p.node_id, p.host, p.port) == ("n1", "10.0.0.1", 7082)
