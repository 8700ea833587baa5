"""The hosted hot-load contract against a real bdnd: what a second POST during a load does.

A POST for another snapshot supersedes the load in progress: it is cancelled (its bandwidth
freed, reason "cancelled: superseded by ...") unless the new target is a delta built on it, in
which case it goes on and the new target is rebuilt on top of it.
"""

from __future__ import annotations

from pathlib import Path

from bdn.client.errors import DaemonError
from bdn.client.fleet import hot_load
from bdn.publish import publish_delta, publish_full, publish_startup
from support.api import http, wait_fleet, wait_for
from support.chains import file_chain
from support.checkpoints import make_state, optimizer_step, write_hf_dir
from support.swarm import Daemon, running

CHUNK = 64 << 10
HOT = "/hot_load/v1/models/hot_load"
# a slow bucket (8 Mbit/s, one request at a time), so a load is still running when the next POST comes
SLOW = {"BDN_BUCKET_MBIT": "8", "BDN_BUCKET_CONCURRENCY": "1", "BDN_LOAD_STARTUP": "false"}


def _downloading(d: Daemon, identity: str) -> None:
    snap = wait_for(
        lambda: d.get(f"/v1/snapshots/{identity}"),
        120,
        f"{identity}'s first bytes",
        until=lambda snap: snap["bytes_done"] > 0,
        meanwhile=lambda snap: snap["state"] in ("queued", "downloading"),
    )
    assert snap["state"] == "downloading", snap


def test_superseded_load_is_cancelled_unless_the_new_target_needs_it(tmp_path: Path) -> None:
    bucket = f"file://{tmp_path}/bucket"
    s1 = make_state(0, scale=4)
    s2 = optimizer_step(s1, 0.02, 1)
    other = make_state(7, scale=4)
    d1, d2, dx = (write_hf_dir(tmp_path / n, s, i) for n, s, i in (("ck1", s1, 1), ("ck2", s2, 2), ("ckx", other, 9)))
    publish_full(bucket, "step000001", 1, dir=d1, chunk_size=CHUNK)
    publish_delta(bucket, "step000002", 2, "step000001", dir=d2, base_dir=d1, chunk_size=CHUNK)
    publish_full(bucket, "other000009", 9, dir=dx, chunk_size=CHUNK)
    with running(Daemon(tmp_path / "work", "node0", bucket, extra_env=SLOW)) as d:
        # 1. step000001 loading; step000002 (a delta on it) supersedes it: step000001 goes on
        st, first = http("POST", d.url + HOT, {"identity": "step000001"})
        assert st == 200, first
        _downloading(d, "step000001")
        st, second = http("POST", d.url + HOT, {"identity": "step000002"})
        assert st == 200 and second["request_id"] != first["request_id"], second
        assert d.get("/v1/snapshots/step000001")["state"] != "failed"
        wait_fleet(d.url, "step000002", timeout=120)
        assert d.get("/v1/snapshots/step000001")["state"] == "ready"
        # 2. other000009 loading; step000001 again (not built on it): other000009 is cancelled
        st, third = http("POST", d.url + HOT, {"identity": "other000009"})
        assert st == 200, third
        _downloading(d, "other000009")
        st, fourth = http("POST", d.url + HOT, {"identity": "step000001"})
        assert st == 200, fourth
        snap = d.get("/v1/snapshots/other000009")
        assert snap["state"] == "failed" and snap["reason"] == "cancelled: superseded by step000001", snap
        assert not list(d.shm_dir.glob("*/other000009")) and not list(d.shm_dir.glob("*/*/other000009"))
        rep = http("GET", d.url + HOT)[1]["replicas"][0]
        assert rep["loading_state"]["identity"] == "step000001"
        assert {"identity": "other000009", "by": "step000001"} in rep["superseded"]
        # the re-POST of the target being served is idempotent
        st, again = http("POST", d.url + HOT, {"identity": "step000001"})
        assert st == 200 and again["request_id"] == fourth["request_id"], (again, fourth)


def test_hot_load_with_previous_takes_the_manifest_s_compression_format(tmp_path: Path) -> None:
    """``hot_load(previous=...)`` (and ``bdnctl hot-load --previous``) sent ``arc_v2`` unless
    told otherwise, so a ``bdn_planes_v1`` delta was refused 409 "compression_format 'arc_v2' does
    not match"; the format is now left to the manifest. A ``previous`` that is served but is not
    the delta's base says how to load it over its chain."""
    chain = file_chain(tmp_path, 2, chunk_size=CHUNK, frac=0.02, formats={2: "bdn_planes_v1"})
    with running(Daemon(tmp_path / "work", "node0", chain.url, extra_env={"BDN_LOAD_STARTUP": "false"})) as d:
        assert hot_load(d.url, "step000001")["accepted"]
        wait_fleet(d.url, "step000001", timeout=120)
        try:
            hot_load(d.url, "step000003", previous="step000001")
        except DaemonError as e:
            assert e.status == 409 and "leave incremental_snapshot_metadata out" in str(e), e
        else:
            raise AssertionError("a previous that is not the delta's base was accepted")
        ans = hot_load(d.url, "step000002", previous="step000001")
        assert ans["accepted"] and ans["policy_version"] == 2, ans
        wait_fleet(d.url, "step000002", timeout=120)


def test_the_startup_snapshot_replaced_by_a_hot_load_is_not_listed_as_superseded(tmp_path: Path) -> None:
    """The new-user check saw ``superseded: [{"identity": "step000001", "by": ...}]`` for the
    STARTUP_SNAPSHOT the daemon started with: that is no hot-load that lost."""
    bucket = f"file://{tmp_path}/bucket"
    s1 = make_state(0)
    d1, d2 = (write_hf_dir(tmp_path / f"ck{i}", s, i) for i, s in enumerate((s1, optimizer_step(s1, 0.02, 1)), 1))
    publish_full(bucket, "step000001", 1, dir=d1, chunk_size=CHUNK)
    publish_startup(bucket, "step000001")
    publish_full(bucket, "step000002", 2, dir=d2, chunk_size=CHUNK)
    with running(Daemon(tmp_path / "work", "node0", bucket)) as d:
        wait_fleet(d.url, "step000001", timeout=120)
        assert hot_load(d.url, "step000002")["accepted"]
        (rep,) = wait_fleet(d.url, "step000002", timeout=120)
        assert rep["superseded"] == [], rep
