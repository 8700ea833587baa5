"""Readiness that says what is wrong (bdn/daemon/observe/readiness.py, bdn/daemon/observe/problems.py; issue
31, class 9), against real bdnd processes and a real S3 API (moto).

Before the fix: a daemon with another partition secret than its peers, and two daemons sharing
one node id, answered ``/v1/ready`` 200 with no reason; a bucket prefix that holds nothing was
ready; a killed replica stayed ``done`` in the fleet view for ~30 s after membership declared it
dead.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from bdn.bucket import open_bucket
from bdn.publish import publish_full
from support.api import HOT_LOAD, http, wait_fleet, wait_for
from support.chains import anchor_swarm
from support.checkpoints import make_state, write_hf_dir
from support.swarm import Daemon, running

pytestmark = pytest.mark.timeout(600)
OTHER_SECRET = "f" * 64


def _ready(d: Daemon) -> tuple[int, dict[str, Any]]:
    status, body = d.request("GET", "/v1/ready", timeout=30)
    assert status in (200, 503) and body["ready"] == (status == 200), (status, body)
    assert {"ready", "reasons", "warnings", "waiting_for", "node_id"} <= set(body), body
    return status, body


def _metric(d: Daemon, name: str, labels: str = "") -> float:
    text = d.get("/metrics").decode()
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.MULTILINE)
    assert m is not None, (name, labels, text[-2000:])
    return float(m.group(1))


def _misconfigured(d: Daemon, needle: str) -> dict[str, Any] | None:
    """/v1/ready's answer once it is 503 with a ``misconfigured:`` reason holding ``needle``."""
    status, body = _ready(d)
    if status == 503 and any(r.startswith("misconfigured:") and needle in r for r in body["reasons"]):
        return body
    return None


def _warned(d: Daemon, needle: str) -> dict[str, Any] | None:
    """/v1/ready's answer once it carries a ``misconfigured:`` warning holding ``needle``."""
    _, body = _ready(d)
    if any(w.startswith("misconfigured:") and needle in w for w in body["warnings"]):
        return body
    return None


def _published(tmp_path: Path) -> str:
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    publish_full(
        f"file://{bucket}", "step000001", 1, dir=write_hf_dir(tmp_path / "ck", make_state(0), 1), chunk_size=64 << 10
    )
    return f"file://{bucket}"


def test_a_daemon_with_another_partition_secret_says_why_and_is_never_held_by_it(tmp_path: Path) -> None:
    """Another secret: the odd node warns (readiness, status, log, metric). A 401 is not
    authenticated (anything at a seed address can send one), so it is a warning, never a reason
    to be not ready: with its snapshot ready the odd node is ready, the warning still there."""
    url = _published(tmp_path)
    env = {"BDN_STARTUP_SETTLE_S": "0"}
    good = [Daemon(tmp_path / "w", f"node{i}", url, extra_env=env) for i in range(2)]
    odd = Daemon(tmp_path / "w", "node2", url, secret=OTHER_SECRET, extra_env=env)
    seeds = [d.peer_url for d in (*good, odd)]
    with running(good[0], seeds), running(good[1], seeds), running(odd, seeds):
        body = wait_for(lambda: _warned(odd, "401"), 120, "node2 to say its signature is refused")
        assert any("partition secret" in w for w in body["warnings"]), body
        status = odd.get("/v1/status")["readiness"]
        assert any("partition secret" in w for w in status["warnings"]), status
        assert _metric(odd, "bdn_misconfigured", '{problem="partition_secret"}') >= 1
        assert "misconfigured: peer" in odd.log()

        # the refusal never holds readiness: the odd node is ready once its snapshot is
        def ready_and_warned() -> dict[str, Any] | None:
            st, b = _ready(odd)
            return b if st == 200 and any("401" in w for w in b["warnings"]) else None

        body = wait_for(ready_and_warned, 180, "node2 to be ready, still warning")
        assert body["reasons"] == [], body
        assert _metric(odd, "bdn_ready") == 1

        # the two that share a secret talk to each other: ready, node2's refusal a warning
        def warned() -> dict[str, Any] | None:
            st, b = _ready(good[0])
            return b if st == 200 and any(odd.peer_url in w for w in b["warnings"]) else None

        body = wait_for(warned, 120, "node0 to be ready with a warning naming node2")
        assert body["reasons"] == [], body


def test_two_daemons_with_one_node_id_are_warned(tmp_path: Path) -> None:
    url = _published(tmp_path)
    env = {"BDN_LOAD_STARTUP": "false", "BDN_STARTUP_SETTLE_S": "0"}
    a = Daemon(tmp_path / "a", "twin", url, extra_env=env)
    b = Daemon(tmp_path / "b", "twin", url, extra_env=env)
    seeds = [a.peer_url, b.peer_url]
    with running(a, seeds), running(b, seeds):
        for d, other in ((a, b), (b, a)):
            body = wait_for(lambda d=d: _warned(d, "node id"), 120, f"{d.peer_url} to name the twin")
            assert any(other.peer_url in w for w in body["warnings"]), body
            assert not any("node id" in r for r in body["reasons"]), body
            assert _metric(d, "bdn_misconfigured", '{problem="duplicate_node_id"}') == 1


def test_an_empty_bucket_prefix_is_not_ready_until_something_is_published(tmp_path: Path, s3_bucket: Any) -> None:
    url, endpoint = s3_bucket
    typo = url + "-typo"  # the trainer publishes to .../run1, the daemon reads .../run1-typo
    b = open_bucket(url, endpoint_url=endpoint)
    try:
        publish_full(b, "step000001", 1, dir=write_hf_dir(tmp_path / "ck", make_state(0), 1), chunk_size=64 << 10)
    finally:
        b.close()
    d = Daemon(
        tmp_path / "w",
        "node0",
        typo,
        extra_env={"BDN_ENDPOINT_URL": endpoint, "BDN_STARTUP_SETTLE_S": "0", "BDN_LOAD_STARTUP": "false"},
    )
    with running(d):
        body = wait_for(lambda: _misconfigured(d, "holds no object"), 120, "the empty prefix to be named")
        assert any(typo in r for r in body["reasons"]), body
        assert _metric(d, "bdn_misconfigured", '{problem="bucket_empty"}') == 1
        # published under the typo too: ready at the next probe (every 10 s)
        tb = open_bucket(typo, endpoint_url=endpoint)
        try:
            publish_full(tb, "step000001", 1, dir=tmp_path / "ck", chunk_size=64 << 10)
        finally:
            tb.close()
        wait_for(lambda: _ready(d)[0] == 200, 120, "ready once the prefix holds a snapshot")
        assert "no longer misconfigured" in d.log()


def test_a_killed_replica_leaves_the_fleet_view_once_membership_declares_it_dead(tmp_path: Path) -> None:
    with anchor_swarm(tmp_path, 3) as swarm:
        node0, _node1, node2 = swarm.daemons
        status, ans = http("POST", node0.url + HOT_LOAD, {"identity": "step000001"})
        assert status == 200, ans
        wait_fleet(node0.url, "step000001")
        node2.kill()

        def dead_here() -> bool:
            return any(p["node_id"] == "node2" and not p["alive"] for p in node0.status()["peers"])

        wait_for(dead_here, 120, "node0's membership to declare node2 dead", interval=0.1)
        status, page = http("GET", node0.url + HOT_LOAD)
        assert status == 200, page
        assert [r["replica_id"] for r in page["replicas"]] == ["node0", "node1"], page
        assert page["replica_count"] == 2 and page["stages"]["done"] == 2, page
