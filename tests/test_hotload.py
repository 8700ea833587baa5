"""The fleet hot-load API against three real daemons (no engines: each daemon is its replica)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bdn.publish import publish_delta, publish_full, publish_startup
from support.api import http, wait_fleet, wait_for
from support.chains import chain_states, publish_chain, write_chain
from support.swarm import Swarm

TOKEN = "trainer-token-0123456789"
CHUNK = 64 << 10


@pytest.fixture
def fleet(tmp_path: Path):
    bucket = f"file://{tmp_path}/bucket"
    d1, d2, d3 = write_chain(tmp_path / "ck", chain_states(2, scale=2, frac=0.02))
    publish_chain(bucket, [d1, d2], chunk_size=CHUNK)  # step000003 is published by the tests that need it
    publish_startup(bucket, "step000001")
    with Swarm(tmp_path / "nodes", 3, bucket, extra_env={"BDN_API_TOKEN": TOKEN}) as swarm:
        yield swarm, bucket, (d1, d2, d3)


def test_one_post_moves_the_fleet(fleet) -> None:
    swarm, bucket, (d1, d2, d3) = fleet
    a = swarm.daemons[0]
    reps = wait_fleet(a.url, "step000001")
    assert len(reps) == 3 and {r["policy_version"] for r in reps} == {1}

    # One POST to one daemon, over the network port with the bearer token.
    status, ans = http(
        "POST",
        a.peer_url + "/hot_load/v1/models/hot_load",
        {
            "identity": "step000002",
            "incremental_snapshot_metadata": {
                "previous_snapshot_identity": "step000001",
                "compression_format": "arc_v2",
                "checksum_format": "alder32",
            },
        },
        token=TOKEN,
    )
    assert status == 200, ans
    assert ans["accepted"] is True and ans["identity"] == "step000002" and ans["policy_version"] == 2
    # before it made the target, the accepting daemon asked members for theirs (HotLoad.catch_up)
    assert a.status()["control_requests"]["sent"].get("hot_load_pull", 0) >= 1
    assert sum(d.status()["control_requests"]["received"].get("hot_load_pull", 0) for d in swarm.daemons[1:]) >= 1
    reps = wait_fleet(swarm.daemons[2].url, "step000002")
    assert {r["policy_version"] for r in reps} == {2}
    for d in swarm.daemons:
        snap = d.get("/v1/snapshots/step000002")
        for f in d2.iterdir():
            assert (Path(snap["path"]) / f.name).read_bytes() == f.read_bytes()

    # A full snapshot published later; two hot-loads race: the later one wins everywhere.
    publish_full(bucket, "step000003", 3, dir=d3, chunk_size=CHUNK)
    s1, _ = http("POST", swarm.daemons[1].url + "/hot_load/v1/models/hot_load", {"identity": "step000001"})
    s2, _ = http("POST", swarm.daemons[2].url + "/hot_load/v1/models/hot_load", {"identity": "step000003"})
    assert s1 == s2 == 200
    reps = wait_fleet(a.url, "step000003")
    assert {r["policy_version"] for r in reps} == {3}
    assert any({"identity": "step000001", "by": "step000003"} in r["superseded"] for r in reps)


def test_hot_load_errors(fleet) -> None:
    swarm, bucket, _ = fleet
    a = swarm.daemons[0]
    wait_fleet(a.url, "step000001")
    url = a.url + "/hot_load/v1/models/hot_load"
    # 401 on the network port without the token, or with a wrong one
    assert http("POST", a.peer_url + "/hot_load/v1/models/hot_load", {"identity": "step000002"})[0] == 401
    assert http("GET", a.peer_url + "/hot_load/v1/models/hot_load", token="wrong")[0] == 401
    # 400 malformed
    st, body = http("POST", url, b"{not json")
    assert st == 400 and "not JSON" in body["error"]
    st, body = http("POST", url, {"identity": "../etc"})
    assert st == 400 and "identity" in body["error"]
    st, body = http("POST", url, {"identity": "step000002", "incremental_snapshot_metadata": "arc_v2"})
    assert st == 400
    # 415 unsupported format, naming the supported ones
    st, body = http(
        "POST", url, {"identity": "step000002", "incremental_snapshot_metadata": {"compression_format": "arc_v3"}}
    )
    assert st == 415 and "arc_v1" in body["error"] and "arc_v2" in body["error"]
    # 404 not in the bucket
    st, body = http("POST", url, {"identity": "step000099"})
    assert st == 404 and "step000099" in body["error"]
    # 409 a previous_snapshot_identity that is not the base, or not the one being served
    st, body = http(
        "POST",
        url,
        {"identity": "step000002", "incremental_snapshot_metadata": {"previous_snapshot_identity": "step000007"}},
    )
    assert st == 409 and "step000001" in body["error"]
    # nothing above moved the fleet
    reps = wait_fleet(a.url, "step000001")
    assert all(r["loading_state"]["identity"] == "step000001" for r in reps)


def test_late_replica_catches_up_from_peers(tmp_path: Path) -> None:
    """A daemon that starts after two hot-loads adopts the fleet's target from its peers and takes
    the rebuilt chunks from them: nothing of the delta chain comes from the bucket."""
    bucket = f"file://{tmp_path}/bucket"
    d1, d2, d3 = write_chain(tmp_path / "ck", chain_states(2, scale=2, frac=0.02))
    publish_chain(bucket, [d1, d2, d3], chunk_size=CHUNK)
    publish_startup(bucket, "step000001")
    swarm = Swarm(tmp_path / "nodes", 3, bucket, extra_env={"BDN_STARTUP_SETTLE_S": "1"})
    early, late = swarm.daemons[:2], swarm.daemons[2]
    try:
        for d in early:
            d.start(swarm.peer_urls)
        for d in early:
            d.wait_healthy()
        wait_fleet(early[0].url, "step000001")
        for ident in ("step000002", "step000003"):
            assert http("POST", early[0].url + "/hot_load/v1/models/hot_load", {"identity": ident})[0] == 200
            wait_fleet(early[1].url, ident)
        late.start(swarm.peer_urls)
        late.wait_healthy()
        snap = late.wait_ready("step000003")
        assert snap["bytes_from_bucket"] == 0 and snap["bytes_from_peers"] > 0
        reps = wait_fleet(late.url, "step000003")
        assert len(reps) == 3 and {r["policy_version"] for r in reps} == {3}
        jobs = {s["identity"]: s for s in late.status()["snapshots"]}
        assert jobs.get("step000002", {}).get("bytes_from_bucket", 0) == 0
        for f in d3.iterdir():
            assert (Path(snap["path"]) / f.name).read_bytes() == f.read_bytes()
    finally:
        swarm.stop()


def test_hot_load_before_the_manifest_is_written(fleet) -> None:
    """Files uploaded, manifest not yet: the POST is accepted, nothing loads until it appears."""
    import os

    swarm, bucket, (d1, d2, d3) = fleet
    a = swarm.daemons[0]
    wait_fleet(a.url, "step000001")
    root = Path(bucket.removeprefix("file://"))
    publish_delta(bucket, "step000003", 3, "step000002", dir=d3, base_dir=d2, chunk_size=CHUNK)
    manifest = root / "step000003" / "bdn.manifest.json"
    held = manifest.with_name("held-back.json")
    os.replace(manifest, held)  # as if the publisher had not written it yet
    st, ans = http("POST", a.url + "/hot_load/v1/models/hot_load", {"identity": "step000003"})
    assert st == 200 and ans["accepted"] and ans["manifest_written"] is False, ans
    # Every daemon has looked for the manifest and is waiting for it (a state, not a pause).
    for d in swarm.daemons:
        wait_for(
            lambda d=d: (
                "waiting for manifest" in (http("GET", d.url + "/v1/snapshots/step000003")[1] or {}).get("reason", "")
            ),
            120,
            f"{d.url} waiting for step000003's manifest",
        )

    # The fleet view is aggregated from the replicas' reports: wait until every one has reported
    # the new target (a state), then check what they report.
    def reported() -> list[dict]:
        rs = http("GET", a.url + "/hot_load/v1/models/hot_load")[1]["replicas"]
        ok = all(r["loading_state"]["identity"] == "step000003" and r["current_snapshot_identity"] for r in rs)
        return rs if ok and len(rs) == len(swarm.daemons) else []

    reps = wait_for(reported, 120, "every replica reporting step000003 as its target")
    for r in reps:
        assert r["loading_state"]["identity"] == "step000003"
        assert r["loading_state"]["stage"] == "queued", r
        assert r["current_snapshot_identity"] == "step000001"  # still serving the old one
    for d in swarm.daemons:
        assert not list(d.shm_dir.glob("*/step000003"))  # nothing half-loaded is visible
    os.replace(held, manifest)
    reps = wait_fleet(a.url, "step000003")
    assert {r["policy_version"] for r in reps} == {3}


def _two_steps(tmp_path: Path) -> str:
    """A ``file://`` bucket with step000001 (the startup snapshot) and its delta step000002."""
    bucket = f"file://{tmp_path}/bucket"
    publish_chain(bucket, write_chain(tmp_path / "ck", chain_states(1, scale=2, frac=0.02)), chunk_size=CHUNK)
    publish_startup(bucket, "step000001")
    return bucket


def test_late_replica_found_by_peers_dns_settles_before_loading(tmp_path: Path) -> None:
    """Issue 12, item 10: a late joiner that finds the fleet only through ``peers_dns`` learns the
    fleet's target before it loads STARTUP_SNAPSHOT, as with static peers: it never loads the
    outdated startup snapshot from the bucket. ``localhost:PORT`` resolves to 127.0.0.1, where
    the early daemon listens; the late one listens on 127.0.0.2 at the same port."""
    from support.swarm import Daemon, free_port

    bucket = _two_steps(tmp_path)
    port = free_port()
    early = Daemon(tmp_path / "nodes", "early", bucket, peer_port=port, extra_env={"BDN_STARTUP_SETTLE_S": "0"})
    late_url = f"http://127.0.0.2:{port}"
    late = Daemon(
        tmp_path / "nodes",
        "late",
        bucket,
        extra_env={
            "BDN_PEER_LISTEN": f"127.0.0.2:{port}",
            "BDN_ADVERTISE_URL": late_url,
            "BDN_PEERS_DNS": f"localhost:{port}",
            "BDN_STARTUP_SETTLE_S": "5",
        },
    )
    try:
        early.start([])
        early.wait_healthy()
        wait_fleet(early.url, "step000001")
        assert http("POST", early.url + "/hot_load/v1/models/hot_load", {"identity": "step000002"})[0] == 200
        wait_fleet(early.url, "step000002")
        late.start([])
        late.wait_healthy()
        snap = late.wait_ready("step000002")
        assert snap["bytes_from_bucket"] == 0 and snap["bytes_from_peers"] > 0, snap
        jobs = {s["identity"]: s for s in late.status()["snapshots"]}
        assert jobs.get("step000001", {}).get("requested_by") != "startup", jobs
        assert "names step000001, but the fleet serves step000002" in late.log()
    finally:
        late.stop()
        early.stop()


def test_a_restarted_lone_daemon_serves_what_it_served(tmp_path: Path) -> None:
    """A daemon hot-loaded to step000002 and restarted with no peer to tell it the fleet's target
    serves step000002 again (its ``current`` link names it and it is ready), not
    STARTUP_SNAPSHOT's step000001: a restart does not undo a hot-load, and nothing is fetched."""
    from support.swarm import Daemon

    bucket = _two_steps(tmp_path)
    d = Daemon(tmp_path / "nodes", "lone", bucket, extra_env={"BDN_STARTUP_SETTLE_S": "0"})
    try:
        d.start([])
        d.wait_healthy()
        wait_fleet(d.url, "step000001")
        assert http("POST", d.url + "/hot_load/v1/models/hot_load", {"identity": "step000002"})[0] == 200
        wait_fleet(d.url, "step000002")
        d.stop()
        d.start([])
        d.wait_healthy()
        reps = wait_fleet(d.url, "step000002")
        assert [r["policy_version"] for r in reps] == [2]
        assert (d.store / "current").resolve() == (d.store / "step000002").resolve()
        assert (
            "current names step000002, ready here: serving it again (STARTUP_SNAPSHOT names step000001: not loaded)"
            in d.log()
        )
        jobs = {s["identity"]: s for s in d.status()["snapshots"]}
        assert all(j.get("requested_by") != "startup" for j in jobs.values()), jobs
        assert d.status()["counters"]["bucket_bytes_owner"] + d.status()["counters"]["bucket_bytes_fallback"] == 0
    finally:
        d.stop()
