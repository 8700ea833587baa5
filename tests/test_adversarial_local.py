"""Attacks on the local API by a buggy engine (bdn/daemon/http/local.py), on two real daemons:
what an engine writes into its daemon must not break what that daemon tells the fleet.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.chains import anchor_swarm
from tests.support.api import HOT_LOAD, http, wait_for
from tests.support.swarm import Swarm

pytestmark = pytest.mark.timeout(300)


@pytest.fixture()
def swarm(tmp_path: Path) -> Iterator[Swarm]:
    with anchor_swarm(tmp_path, 2) as s:
        yield s


def _row(url: str, replica: str) -> dict | None:
    status, body = http("GET", url + HOT_LOAD)
    assert status == 200, body
    return next((r for r in body["replicas"] if r["replica_id"] == replica), None)


def test_an_engine_error_with_a_lone_surrogate_is_400_and_the_fleet_still_hears_the_replica(swarm: Swarm) -> None:
    """JSON's ``"\\udc80"`` escape parses to a string that is not Unicode text. Before the fix the
    ack was taken (200), and every status report of that replica then failed to encode
    (a traceback per round), so the other daemons listed it as still ``queued``."""
    node0, node1 = swarm.daemons
    status, ans = http("POST", node0.url + HOT_LOAD, {"identity": "step000001"})
    assert status == 200, ans
    for bad in (b'{"name": "engine-\\ud800"}', b'{"name": "\\udc80"}'):
        status, ans = http("POST", node0.url + "/v1/engines", bad)
        assert status == 400 and "lone surrogate" in ans["error"], (bad, status, ans)
    status, ans = http("POST", node0.url + "/v1/engines", {"name": "engine-\U0001f600"})  # a valid pair is fine
    assert status == 201, ans
    eid = ans["engine_id"]
    offer = node0.get(f"/v1/engines/{eid}/next?timeout=60")
    assert offer["identity"] == "step000001", offer
    body = b'{"identity": "step000001", "pause_ms": 1, "error": "cuda \\udc80 oom"}'
    status, ans = http("POST", node0.url + f"/v1/engines/{eid}/ack", body)
    assert status == 400 and ans["error"] == "body holds a lone surrogate \\udc80 in a string (not Unicode text)", ans
    status, ans = http(
        "POST", node0.url + f"/v1/engines/{eid}/ack", {"identity": "step000001", "pause_ms": 1, "error": "cuda oom"}
    )
    assert status == 200, ans
    row = wait_for(
        lambda: (r := _row(node1.url, "node0")) is not None and r["loading_state"]["stage"] == "error" and r,
        120,
        "node1 to list node0's engine error",
    )
    assert row["loading_state"]["reason"] == "cuda oom", row
    assert "Traceback" not in node0.log(), node0.log()
    json.dumps(row)  # what node1 lists is plain JSON
