"""Attacks on delta folding (bdn/daemon/apply/fold.py) by a confused publisher, on a real bdnd: chains
whose manifests do not form a chain. The manifest is the root of trust, so a bad one must fail
the snapshot with a reason; it must never leave it waiting forever or half built."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from support.chains import daemon_on_anchor, file_chain

pytestmark = pytest.mark.timeout(300)
CHUNK = 64 << 10


LOOP_REASONS = {
    "true": "the delta chain of step000003 loops: step000002 names step000003, a snapshot built on it, as its base",
    "false": (
        "base snapshot step000002 failed: the delta chain of step000002 loops: step000002 -> step000003 -> step000002"
    ),
}


@pytest.mark.parametrize("fold", ["true", "false"])
def test_a_delta_chain_that_loops_fails_the_target_instead_of_waiting_on_itself(tmp_path: Path, fold: str) -> None:
    """step000002's manifest names step000003 (a delta on it) as its base. Before the fix the fold
    took the target's own job as the ancestor ("folding 2 deltas on step000003") and waited for it
    to be ready: the prefetch never ended. Without folding (``fold_deltas = false``), step000003
    waited for step000002, which waited for step000003: the one that closes the loop fails."""
    chain = file_chain(tmp_path, 2, chunk_size=CHUNK)
    chain.edit_manifest("step000002", lambda m: m.update(base_identity="step000003"))  # the loop
    with daemon_on_anchor(tmp_path, chain.url, {"BDN_FOLD_DELTAS": fold}) as d:
        assert d.prefetch("step000003")[0] == 202
        rec = d.wait_settled("step000003")
        assert rec["state"] == "failed", rec
        assert rec["reason"] == LOOP_REASONS[fold], rec
        assert not (d.store / "step000003").exists()  # nothing under the identity: no half snapshot
        assert d.get("/v1/health")["status"] == "ok"
        assert d.wait_ready("step000001")["state"] == "ready"  # the ancestor is untouched


def test_a_fold_killed_midway_leaves_no_half_snapshot_and_restarts_clean(tmp_path: Path) -> None:
    """SIGKILL once the fold started (in its apply or verify when the poll catches it, else while
    it fetches the diffs): nothing under the target's identity, no intermediate snapshot; after a
    restart the target loads again and is byte-identical to the trainer's."""
    chain = file_chain(tmp_path, 3, chunk_size=CHUNK, scale=8)
    with daemon_on_anchor(tmp_path, chain.url) as d:
        root = d.store
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
        for f in chain.dirs[-1].iterdir():
            assert (got / f.name).read_bytes() == f.read_bytes(), f.name
        assert d.request("GET", "/v1/snapshots/step000002")[0] == 404
        assert not [p for p in root.rglob("*") if ".fold-" in p.name]


def test_a_chain_whose_manifests_lie_about_a_rebuilt_size_fails_the_target_and_leaves_nothing(tmp_path: Path) -> None:
    """Both deltas' manifests say a diff file rebuilds 2 bytes less than it does (consistently,
    so plan_fold accepts the chain): the fold fails naming the file and the step; nothing is
    left under the target's identity, and the ancestor still serves."""
    chain = file_chain(tmp_path, 2, chunk_size=CHUNK)

    def shrink_a_result(m: dict[str, Any]) -> None:
        f = next(f for f in m["files"] if f.get("result"))
        f["result"]["size"] -= 2

    for ident in ("step000002", "step000003"):
        chain.edit_manifest(ident, shrink_a_result)
    with daemon_on_anchor(tmp_path, chain.url) as d:
        assert d.prefetch("step000003")[0] == 202
        rec = d.wait_settled("step000003")
        assert rec["state"] == "failed", rec
        assert "\n" not in rec["reason"] and rec["reason"], rec
        root = d.store
        assert not (root / "step000003").exists() and not (root / "step000002").exists()
        assert d.wait_ready("step000001")["state"] == "ready"
        assert "Traceback" not in d.log(), d.log()
