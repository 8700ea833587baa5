"""Attacks on the hot-load gossip (bdn/daemon/replica/hotload.py, replica/target.py) by a member
with a runaway counter, on two real daemons: a target pushed with the largest ``gen`` the wire
accepts (2^53) must not freeze the fleet's target.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bdn.bucket import open_bucket
from bdn.daemon.replica.target import published_at
from bdn.proto.manifest import MANIFEST_NAME, Manifest
from bdn.publish import publish_full
from tests.support import api
from tests.support.api import HOT_LOAD, wait_for
from tests.support.checkpoints import make_state, write_hf_dir
from tests.support.swarm import Daemon, Swarm

pytestmark = pytest.mark.timeout(300)


@pytest.fixture()
def swarm(tmp_path: Path) -> Iterator[Swarm]:
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    for i in (1, 2):
        ck = write_hf_dir(tmp_path / f"ck{i}", make_state(i), i)
        publish_full(f"file://{bucket}", f"step00000{i}", i, dir=ck, chunk_size=64 << 10)
    with Swarm(tmp_path / "work", 2, f"file://{bucket}", extra_env={"BDN_LOAD_STARTUP": "false"}) as s:
        yield s


def _push(d: Daemon, target: dict) -> int:
    return d.peer_post("hot_load", target, "runaway")[0]


def _loading(d: Daemon) -> str | None:
    status, body = api.http("GET", d.url + HOT_LOAD)
    assert status == 200, body
    me = next(r for r in body["replicas"] if r["replica_id"] == d.node_id)
    return me["loading_state"]["identity"]


def test_a_target_at_the_largest_gen_is_still_superseded_by_the_next_hot_load(swarm: Swarm) -> None:
    """Before the fix the next POST got gen 2^53 + 1, which every other daemon refused as
    malformed: the accepting daemon moved on, the rest of the fleet stayed on the old target."""
    node0, node1 = swarm.daemons
    # the snapshot's true policy version and publish time: a push contradicting the manifest is
    # refused once the receiver read it (bdn/daemon/replica/claims.py), which is not this test's subject
    m = Manifest.from_json(open_bucket(node0.env["BDN_BUCKET"]).read(f"step000001/{MANIFEST_NAME}"))
    forged = {
        "identity": "step000001",
        "seq": time.time_ns(),
        "origin": "runaway",
        "request_id": "runaway1",
        "gen": 2**53,
        "pv": m.policy_version,
        "at": published_at(m.created_at),
    }
    assert _push(node0, forged) == 200 and _push(node1, forged) == 200
    for d in (node0, node1):
        wait_for(lambda d=d: _loading(d) == "step000001", 120, f"{d.node_id} to take the pushed target")
    status, ans = api.http("POST", node0.url + HOT_LOAD, {"identity": "step000002"})
    assert status == 200, ans
    wait_for(lambda: _loading(node1) == "step000002", 120, "node1 to take the next hot-load")
    node1.wait_ready("step000002")
    assert "malformed" not in node0.log() and "malformed" not in node1.log()
