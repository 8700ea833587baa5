"""The daemon side of the control plane, without sockets: SWIM messages from the wire
(bdn.daemon.swarm.gossip.parse_message), the aggregators' rows (bdn.control.hotload.ReplicaBoard,
bdn.daemon.replica.fleet_status.check_row), the report interval and the manifest's publish time."""

from __future__ import annotations

import pytest

from bdn.control.hotload import ReplicaBoard, Row, paginate, report_interval, summary
from bdn.control.swim import ALIVE, MAX_UPDATES_PER_MESSAGE, Message, Update
from bdn.daemon.errors import Invalid
from bdn.daemon.replica.fleet_status import check_row
from bdn.daemon.replica.hotload import published_at
from bdn.daemon.swarm.gossip import decode_addr, encode_addr, message_wire, parse_message
from bdn.proto.errors import ProtocolError


def _row(node: str, stage: str = "done") -> dict:
    return {
        "replica_id": node,
        "current_snapshot_identity": "s1",
        "policy_version": 1,
        "readiness": True,
        "loading_state": {"stage": stage, "identity": "s1", "progress": 1.0, "reason": ""},
    }


def test_a_message_round_trips_with_its_piggyback() -> None:
    m = Message("ping", "a", "b", 7, "", (Update("c", ALIVE, 2, encode_addr("http://c:1", "c:2")),))
    got, extra = parse_message(message_wire(m, {"target": None}), "a", "b")
    assert got == m and extra == {"target": None}
    assert decode_addr(got.updates[0].addr) == ("http://c:1", "c:2")
    assert decode_addr("http://c:1/") == ("http://c:1", None)


@pytest.mark.parametrize(
    "bad, why",
    [
        (None, "must be a map"),
        ({"k": "boom", "s": "a", "d": "b"}, "kind"),
        ({"k": "ping", "s": "mallory", "d": "b"}, "not its signer"),
        ({"k": "ping", "s": "a", "d": "c"}, "another daemon"),
        ({"k": "ping", "s": "a", "d": ""}, "only a sync"),
        ({"k": "ping", "s": "a", "d": "b", "q": -1}, "seq"),
        ({"k": "ping", "s": "a", "d": "b", "q": True}, "seq"),
        ({"k": "ping_req", "s": "a", "d": "b", "t": "../x"}, "target"),
        ({"k": "ping", "s": "a", "d": "b", "u": [[1, 2]]}, "update"),
        ({"k": "ping", "s": "a", "d": "b", "u": [["c", 0, 0, ""]] * (MAX_UPDATES_PER_MESSAGE + 1)}, "at most"),
    ],
)
def test_malformed_messages_are_refused_with_one_line(bad: object, why: str) -> None:
    with pytest.raises(ProtocolError, match=why):
        parse_message(bad, "a", "b")


def test_a_sync_to_a_seed_whose_node_id_is_unknown_is_for_the_receiver() -> None:
    got, _ = parse_message({"k": "sync", "s": "a", "d": ""}, "a", "b")
    assert got.dst == "b"


def test_report_rows_are_checked_and_expire() -> None:
    now = [0.0]
    board = ReplicaBoard(lambda: now[0], ttl_s=30.0, max_rows=2)
    board.put(check_row({"identity": "s1", "row": _row("n1")}, "n1"))
    board.put(check_row({"identity": "s1", "row": _row("n2", "loading")}, "n2"))
    with pytest.raises(Exception, match="full"):
        board.put(Row("n3", "s1", _row("n3")))
    assert [r.node for r in board.rows("s1")] == ["n1", "n2"] and board.rows("s2") == []
    now[0] = 31.0
    assert board.rows() == []
    for obj, why in (
        (None, "map"),
        ({"identity": "../x", "row": _row("n1")}, "identity"),
        ({"identity": "s1", "row": _row("n2")}, "not its signer"),
        ({"identity": "s1", "row": _row("n1", "bogus")}, "stage"),
        ({"identity": "s1", "row": {**_row("n1"), "x": "y" * 20000}}, "bytes"),
    ):
        with pytest.raises(Invalid, match=why):
            check_row(obj, "n1")


def test_pages_and_stages_cover_the_whole_fleet() -> None:
    rows = [Row(f"n{i:04d}", "s1", _row(f"n{i:04d}", "done" if i % 4 else "loading")) for i in range(120)]
    page, token = paginate(rows, 50, None)  # type: ignore[arg-type]
    page2, token2 = paginate(rows, 50, bytes.fromhex(token).decode())  # type: ignore[arg-type]
    page3, token3 = paginate(rows, 50, bytes.fromhex(token2).decode())  # type: ignore[arg-type]
    assert len(page) == len(page2) == 50 and len(page3) == 20 and token3 == ""
    assert summary(rows, lambda r: r.data["loading_state"]["stage"]) == {"loading": 30, "done": 90}


def test_refreshes_per_aggregator_stay_bounded_while_the_fleet_grows() -> None:
    assert report_interval(10.0, 16) == 10.0
    for n in (100, 1_000, 10_000):
        assert n / report_interval(10.0, n, 10.0) <= 10.0


def test_published_at_reads_the_manifests_created_at() -> None:
    assert published_at("1970-01-01T00:01:40Z") == 100.0
    assert published_at("") == 0.0 and published_at("yesterday") == 0.0


def test_hot_load_push_fanout_grows_with_the_fleet() -> None:
    from bdn.daemon.replica.hotload import push_fanout

    assert push_fanout(5, 10_000) == 5  # configured wins
    assert push_fanout(0, 1) == 3
    assert push_fanout(0, 16) == 6  # ceil(ln 16) = 3
    assert push_fanout(0, 10_000) == 13  # ceil(9.21) = 10
    assert push_fanout(0, 100) < push_fanout(0, 10_000)
