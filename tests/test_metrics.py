"""Every metric the operator guide names, read from a live daemon's /metrics."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from bdn.publish import publish_full, publish_startup
from support.checkpoints import make_state, write_hf_dir
from support.swarm import Swarm

ROOT = Path(__file__).resolve().parents[1]


def test_guide_metrics_are_exported(tmp_path: Path) -> None:
    bucket = f"file://{tmp_path}/bucket"
    d = write_hf_dir(tmp_path / "ck1", make_state(0), 1)
    publish_full(bucket, "step000001", 1, dir=d, chunk_size=64 << 10)
    publish_startup(bucket, "step000001")
    with Swarm(tmp_path / "nodes", 2, bucket) as swarm:
        for n in swarm.daemons:
            n.wait_ready("step000001")
        text = swarm.daemons[0].get("/metrics").decode()
    samples = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            samples.setdefault(smp.name, []).append(smp)
    guide = (ROOT / "docs" / "OPERATIONS.md").read_text() + (ROOT / "README.md").read_text()
    named = set(re.findall(r"\b(bdn_[a-z_]+[a-z])\b", guide)) - {"bdn_partition"}
    missing = sorted(n for n in named if n not in samples)
    assert not missing, f"metrics named in the docs but not exported: {missing}"
    # the numbers are live, not placeholders
    fetched = sum(s.value for s in samples["bdn_bucket_bytes_total"]) + sum(
        s.value for s in samples["bdn_peer_bytes_total"] if s.labels["direction"] == "in"
    )
    assert fetched > 0
    assert any(s.labels == {"state": "ready"} and s.value == 1 for s in samples["bdn_snapshots"])
    assert samples["bdn_current_policy_version"][0].value == 1
    assert samples["bdn_shm_bytes"][0].value > 0
