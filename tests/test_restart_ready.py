"""Issue 31, class 1: a snapshot READY in shm when bdnd starts is the same record as a freshly
fetched one (identity, kind, base, policy version, creation time, manifest), so a hot-load of it
after a restart completes at once, with nothing fetched."""

from __future__ import annotations

from pathlib import Path

from bdn.publish import publish_startup
from support.api import http, wait_fleet
from support.chains import chain_states, publish_chain, write_chain
from support.swarm import Daemon

CHUNK = 64 << 10
HOT_LOAD = "/hot_load/v1/models/hot_load"
#: What a record says of this run only: who asked, when it last changed, seconds per stage, and
#: the bytes this process moved by source. Every other key of a restored record equals the fresh one's.
THIS_RUN = {"requested_by", "updated_at", "stages", "bytes_from_bucket", "bytes_from_peers", "bytes_local"}


def test_hot_load_of_a_snapshot_ready_before_a_restart(tmp_path: Path) -> None:
    bucket = f"file://{tmp_path}/bucket"
    publish_chain(bucket, write_chain(tmp_path / "ck", chain_states(1, scale=2, frac=0.02)), chunk_size=CHUNK)
    publish_startup(bucket, "step000001")
    d = Daemon(tmp_path / "nodes", "lone", bucket, extra_env={"BDN_STARTUP_SETTLE_S": "0"})
    try:
        d.start([])
        d.wait_healthy()
        wait_fleet(d.url, "step000001")
        assert d.prefetch("step000002")[0] in (200, 202)
        d.wait_ready("step000002")
        fresh = {i: d.get(f"/v1/snapshots/{i}") for i in ("step000001", "step000002")}
        d.stop()

        d.start([])
        d.wait_healthy()
        wait_fleet(d.url, "step000001")
        for ident, before in fresh.items():
            after = d.get(f"/v1/snapshots/{ident}")
            assert after.keys() == before.keys()
            assert {k: v for k, v in after.items() if k not in THIS_RUN} == {
                k: v for k, v in before.items() if k not in THIS_RUN
            }, (before, after)
            assert after["created_at"] == before["created_at"] and after["state"] == "ready", (before, after)
            assert after["requested_by"] == "store"
        status, ans = http(
            "POST",
            d.url + HOT_LOAD,
            {
                "identity": "step000002",
                "incremental_snapshot_metadata": {
                    "previous_snapshot_identity": "step000001",
                    "compression_format": "arc_v2",
                    "checksum_format": "alder32",
                },
            },
        )
        assert status == 200 and ans["policy_version"] == 2, ans
        reps = wait_fleet(d.url, "step000002", timeout=60)
        assert [r["policy_version"] for r in reps] == [2]
        counters = d.status()["counters"]
        assert counters["bucket_bytes_owner"] + counters["bucket_bytes_fallback"] == 0
        # the delta's stored diff files are still served to peers after the restart
        have = d.get("/v1/snapshots/step000002")
        assert have["stored_bytes"] < have["result_bytes"]
    finally:
        d.stop()
