"""The fleet hot-load GET's schema (bdn/proto/fleet_schema.py; issue 31, class 8): every state,
on every daemon of three real ones, answers every documented key; ``bdn.client`` never raises
KeyError on a documented answer.

Before the fix, a GET right after the POST listed the replicas that had not reported yet with
five keys only (``engines`` and the rest missing: a client reading ``r["engines"]`` raised
KeyError), and a daemon with no target answered ``identity`` null with no word why.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bdn.client.fleet import hot_load_status
from bdn.engines.options import HotLoadOptions
from bdn.proto.errors import ProtocolError
from bdn.proto.fleet_schema import (
    REPLICA_ROW,
    complete_page,
    complete_row,
    page_errors,
    replica_row,
    schema_errors,
)
from bdn.proto.states import REPLICA_STAGES
from support.api import HOT_LOAD, http, wait_fleet, wait_for
from support.chains import anchor_swarm
from support.swarm import Swarm

pytestmark = pytest.mark.timeout(600)


# ---- the schema itself (pure) -------------------------------------------------------------------


def test_the_defaults_are_the_hot_load_defaults() -> None:
    row = replica_row("node0")
    assert schema_errors(row) == []
    assert {k: row[k] for k in HotLoadOptions().wire()} == HotLoadOptions().wire()
    with pytest.raises(KeyError):
        replica_row("node0", bogus=1)


@pytest.mark.parametrize(
    "wire",
    [
        {},
        {"replica_id": "node1", "loading_state": {"stage": "done"}},
        {"replica_id": 5, "engines": "many", "readiness": 1, "policy_version": True, "loading_state": []},
        {"replica_id": "n", "loading_state": {"stage": "flying", "progress": "half", "reason": None}},
    ],
)
def test_complete_row_gives_every_key_whatever_the_wire_held(wire: dict[str, Any]) -> None:
    row = complete_row(wire)
    assert schema_errors(row) == [], row
    assert set(REPLICA_ROW) <= set(row)
    for key in ("engines", "last_swap_pause_ms", "superseded", "request_id", "last_swap"):
        row[key]
    with pytest.raises(ProtocolError):
        complete_row(["not", "a", "row"])


def test_complete_page_fills_the_page() -> None:
    page = complete_page({"replicas": [{"replica_id": "a"}]})
    assert page_errors(page) == [] and page["stages"] == dict.fromkeys(REPLICA_STAGES, 0)
    assert page["replica_count"] == 1 and page["next_page_token"] == "" and page["identity"] is None
    with pytest.raises(ProtocolError):
        complete_page({"replicas": "none"})


# ---- every state on real daemons ----------------------------------------------------------------


@pytest.fixture()
def swarm(tmp_path: Path) -> Iterator[Swarm]:
    with anchor_swarm(tmp_path, 3) as s:
        yield s


def _pages(swarm: Swarm) -> list[dict[str, Any]]:
    """The GET's answer from every daemon, each checked against the schema; also what the
    client makes of it (every documented key readable)."""
    out = []
    for d in swarm.daemons:
        status, page = http("GET", d.url + HOT_LOAD)
        assert status == 200, page
        assert page_errors(page) == [], (d.node_id, page)
        for r in hot_load_status(d.url):
            assert schema_errors(r) == [], r
            _ = (r["engines"], r["last_swap"], r["loading_state"]["reason"], r["superseded"])
        out.append(page)
    return out


def _row(page: dict[str, Any], node: str) -> dict[str, Any]:
    return next(r for r in page["replicas"] if r["replica_id"] == node)


def test_every_state_answers_the_whole_schema(swarm: Swarm) -> None:
    node0, node1, _node2 = swarm.daemons
    # before any hot-load: no target anywhere; the rows say so rather than a bare null
    for page in _pages(swarm):
        assert page["identity"] is None and page["replica_count"] == 3, page
        assert all(r["loading_state"]["reason"] for r in page["replicas"]), page

    # right after the POST, on every daemon (the accepting one, and those its push reached or not)
    status, ans = http("POST", node0.url + HOT_LOAD, {"identity": "step000001"})
    assert status == 200, ans
    for page in _pages(swarm):
        assert page["identity"] == "step000001", page
        assert all(r["loading_state"]["identity"] == "step000001" for r in page["replicas"]), page

    # done everywhere
    wait_fleet(node0.url, "step000001")
    # node0's view is done; the others' views follow by gossip: wait for them, then check the pages
    pages = wait_for(
        lambda: _pages(swarm),
        120,
        "every daemon to count 3 replicas done",
        until=lambda ps: all(p["stages"]["done"] == 3 for p in ps),
    )
    for page in pages:
        assert page["stages"]["done"] == 3, page

    # an engine registered on node1: offered (loading), then it reports an error
    status, ans = http("POST", node1.url + "/v1/engines", {"name": "schema-test"})
    assert status == 201, ans
    eid = ans["engine_id"]
    offer = node1.get(f"/v1/engines/{eid}/next?timeout=60")
    assert offer["identity"] == "step000001", offer
    wait_for(
        lambda: all(_row(p, "node1")["loading_state"]["stage"] == "loading" for p in _pages(swarm)),
        120,
        "every daemon to list node1 loading",
    )
    status, ans = http(
        "POST",
        node1.url + f"/v1/engines/{eid}/ack",
        {"identity": "step000001", "pause_ms": 1, "error": "out of memory (test)"},
    )
    assert status == 200, ans

    def all_error() -> list[dict[str, Any]] | None:
        ps = _pages(swarm)
        return ps if all(_row(p, "node1")["loading_state"]["stage"] == "error" for p in ps) else None

    pages = wait_for(all_error, 120, "every daemon to list node1's error")
    for p in pages:
        assert _row(p, "node1")["loading_state"]["reason"] == "out of memory (test)", p
        assert p["stages"]["error"] == 1 and p["stages"]["done"] == 2, p
