"""Attacks on delta folding (bdn/daemon/fold.py) by a confused publisher, on a real bdnd: chains
whose manifests do not form a chain. The manifest is the root of trust, so a bad one must fail
the snapshot with a reason; it must never leave it waiting forever or half built."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from bdn.proto.keys import derive_keys
from bdn.publish import publish_delta, publish_full
from tests.support.checkpoints import make_state, optimizer_step, write_hf_dir
from tests.support.swarm import SECRET, Daemon

pytestmark = pytest.mark.timeout(300)
CHUNK = 64 << 10


def _wait_failed(d: Daemon, identity: str, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        status, rec = d.request("GET", f"/v1/snapshots/{identity}")
        if status == 200 and rec["state"] in ("failed", "ready"):
            return rec
        assert time.monotonic() < deadline, f"{identity} neither failed nor ready in {timeout} s: {rec}\n{d.log()}"
        time.sleep(0.1)


LOOP_REASONS = {
    "true": "the delta chain of step000003 loops: step000002 names step000003, a snapshot built on it, as its base",
    "false": ("base snapshot step000002 failed: the delta chain of step000002 loops: "
              "step000002 -> step000003 -> step000002"),
}


@pytest.mark.parametrize("fold", ["true", "false"])
def test_a_delta_chain_that_loops_fails_the_target_instead_of_waiting_on_itself(tmp_path: Path, fold: str) -> None:
    """step000002's manifest names step000003 (a delta on it) as its base. Before the fix the fold
    took the target's own job as the ancestor ("folding 2 deltas on step000003") and waited for it
    to be ready: the prefetch never ended. Without folding (``fold_deltas = false``), step000003
    waited for step000002, which waited for step000003: the one that closes the loop fails."""
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    url = f"file://{bucket}"
    s1 = make_state(0)
    s2 = optimizer_step(s1, 0.05, 1)
    s3 = optimizer_step(s2, 0.05, 2)
    d1, d2, d3 = (write_hf_dir(tmp_path / f"src{i}", s, i) for i, s in enumerate((s1, s2, s3), 1))
    publish_full(url, "step000001", 1, dir=d1, chunk_size=CHUNK)
    publish_delta(url, "step000002", 2, "step000001", dir=d2, base_dir=d1, chunk_size=CHUNK)
    publish_delta(url, "step000003", 3, "step000002", dir=d3, base_dir=d2, chunk_size=CHUNK)
    mp = bucket / "step000002" / "bdn.manifest.json"
    m = json.loads(mp.read_text())
    m["base_identity"] = "step000003"  # the loop
    mp.write_text(json.dumps(m))
    d = Daemon(tmp_path / "work", "node0", url, extra_env={"BDN_LOAD_STARTUP": "false", "BDN_FOLD_DELTAS": fold})
    d.start([])
    try:
        d.wait_healthy()
        assert d.prefetch("step000001")[0] == 202
        d.wait_ready("step000001")
        assert d.prefetch("step000003")[0] == 202
        rec = _wait_failed(d, "step000003")
        assert rec["state"] == "failed", rec
        assert rec["reason"] == LOOP_REASONS[fold], rec
        root = d.shm_dir / derive_keys(SECRET).swarm_id
        assert not (root / "step000003").exists()  # nothing under the identity: no half snapshot
        assert d.get("/v1/health")["status"] == "ok"
        assert d.wait_ready("step000001")["state"] == "ready"  # the ancestor is untouched
    finally:
        d.stop()


def test_a_fold_killed_midway_leaves_no_half_snapshot_and_restarts_clean(tmp_path: Path) -> None:
    """SIGKILL once the fold started (in its apply or verify when the poll catches it, else while
    it fetches the diffs): nothing under the target's identity, no intermediate snapshot; after a
    restart the target loads again and is byte-identical to the trainer's."""
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    url = f"file://{bucket}"
    states = [make_state(0, scale=8)]
    for i in range(1, 4):
        states.append(optimizer_step(states[-1], 0.05, i))
    dirs = [write_hf_dir(tmp_path / f"src/step{i:06d}", s, i) for i, s in enumerate(states, 1)]
    publish_full(url, "step000001", 1, dir=dirs[0], chunk_size=CHUNK)
    for i in range(2, 5):
        publish_delta(url, f"step{i:06d}", i, f"step{i - 1:06d}", dir=dirs[i - 1], base_dir=dirs[i - 2], chunk_size=CHUNK)
    d = Daemon(tmp_path / "work", "node0", url, extra_env={"BDN_LOAD_STARTUP": "false"})
    root = d.shm_dir / derive_keys(SECRET).swarm_id
    d.start([])
    try:
        d.wait_healthy()
        assert d.prefetch("step000001")[0] == 202
        d.wait_ready("step000001")
        assert d.prefetch("step000004")[0] == 202
        deadline = time.monotonic() + 120
        while True:
            rec = d.request("GET", "/v1/snapshots/step000004")[1]
            if rec["state"] in ("applying", "verifying", "ready", "failed") or "folding" in rec["reason"]:
                if rec["state"] in ("applying", "verifying", "ready", "failed") or time.monotonic() > deadline:
                    break
            assert time.monotonic() < deadline, rec
            time.sleep(0.01)
        d.kill()
        target = root / "step000004"
        assert not target.exists() or (target / "READY").is_file(), list(target.iterdir())
        assert not (root / "step000002").exists() and not (root / "step000003").exists()
        d.start([])
        d.wait_healthy()
        for p in root.iterdir():  # whatever is under an identity is a complete snapshot
            if not p.name.startswith(".") and p.is_dir() and p.name.startswith("step"):
                assert (p / "READY").is_file(), p
        assert d.prefetch("step000004")[0] == 202
        got = Path(d.wait_ready("step000004")["path"])
        for f in dirs[-1].iterdir():
            assert (got / f.name).read_bytes() == f.read_bytes(), f.name
        assert d.request("GET", "/v1/snapshots/step000002")[0] == 404
        assert not [p for p in root.rglob("*") if ".fold-" in p.name]
    finally:
        d.stop()


def test_a_chain_whose_manifests_lie_about_a_rebuilt_size_fails_the_target_and_leaves_nothing(tmp_path: Path) -> None:
    """Both deltas' manifests say a diff file rebuilds 2 bytes less than it does (consistently,
    so plan_fold accepts the chain): the fold fails naming the file and the step; nothing is
    left under the target's identity, and the ancestor still serves."""
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    url = f"file://{bucket}"
    s1 = make_state(0)
    s2 = optimizer_step(s1, 0.05, 1)
    s3 = optimizer_step(s2, 0.05, 2)
    d1, d2, d3 = (write_hf_dir(tmp_path / f"src{i}", s, i) for i, s in enumerate((s1, s2, s3), 1))
    publish_full(url, "step000001", 1, dir=d1, chunk_size=CHUNK)
    publish_delta(url, "step000002", 2, "step000001", dir=d2, base_dir=d1, chunk_size=CHUNK)
    publish_delta(url, "step000003", 3, "step000002", dir=d3, base_dir=d2, chunk_size=CHUNK)
    for ident in ("step000002", "step000003"):
        mp = bucket / ident / "bdn.manifest.json"
        m = json.loads(mp.read_text())
        f = next(f for f in m["files"] if f.get("result"))
        f["result"]["size"] -= 2
        mp.write_text(json.dumps(m))
    d = Daemon(tmp_path / "work", "node0", url, extra_env={"BDN_LOAD_STARTUP": "false"})
    d.start([])
    try:
        d.wait_healthy()
        assert d.prefetch("step000001")[0] == 202
        d.wait_ready("step000001")
        assert d.prefetch("step000003")[0] == 202
        rec = _wait_failed(d, "step000003")
        assert rec["state"] == "failed", rec
        assert "\n" not in rec["reason"] and rec["reason"], rec
        root = d.shm_dir / derive_keys(SECRET).swarm_id
        assert not (root / "step000003").exists() and not (root / "step000002").exists()
        assert d.wait_ready("step000001")["state"] == "ready"
        assert "Traceback" not in d.log(), d.log()
    finally:
        d.stop()
