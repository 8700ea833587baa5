"""The vertical slice end to end: publish -> three real bdnd processes -> client arrays.

Real processes, real sockets, real safetensors files; the S3 variant runs against a real S3 API
server (moto) behind a recording proxy, which is how "no stored byte is fetched twice across the
swarm" is checked from the bucket's side rather than from the daemons' own counters.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from bdn.bucket import open_bucket
from bdn.client import DaemonClient
from bdn.proto.manifest import MANIFEST_NAME, Manifest
from bdn.publish import publish_delta, publish_full, publish_startup
from support.checkpoints import make_state, optimizer_step, write_hf_dir
from support.swarm import Swarm

CHUNK = 64 << 10
IDS = ("step000001", "step000002", "step000003")


def publish_chain(tmp_path: Path, bucket: str, endpoint: str | None = None):
    """Anchor step000001 plus deltas step000002/3 (about 2% of bf16 values change per step)."""
    states = [make_state(0, scale=4)]
    states.append(optimizer_step(states[0], 0.02, 1))
    states.append(optimizer_step(states[1], 0.02, 2))
    dirs = [write_hf_dir(tmp_path / f"trainer/ck{i + 1}", s, i + 1) for i, s in enumerate(states)]
    b = open_bucket(bucket, endpoint_url=endpoint)
    try:
        manifests = [publish_full(b, IDS[0], 1, dir=dirs[0], chunk_size=CHUNK)]
        manifests.append(publish_delta(b, IDS[1], 2, IDS[0], dir=dirs[1], base_dir=dirs[0], chunk_size=CHUNK))
        manifests.append(publish_delta(b, IDS[2], 3, IDS[1], dir=dirs[2], base_dir=dirs[1], chunk_size=CHUNK))
        publish_startup(b, IDS[0])
    finally:
        b.close()
    return states, dirs, manifests


def assert_identical(swarm: Swarm, identity: str, trainer_dir: Path) -> None:
    for d in swarm.daemons:
        snap = d.get(f"/v1/snapshots/{identity}")
        assert snap["state"] == "ready", (d.node_id, snap)
        got = Path(snap["path"])
        want_files = sorted(p.name for p in trainer_dir.iterdir())
        assert sorted(p.name for p in got.iterdir() if p.name != "READY") == want_files
        for name in want_files:
            assert (got / name).read_bytes() == (trainer_dir / name).read_bytes(), (d.node_id, name)


def test_file_bucket_three_daemons(tmp_path: Path) -> None:
    bucket = f"file://{tmp_path}/bucket"
    states, dirs, manifests = publish_chain(tmp_path, bucket)
    with Swarm(tmp_path / "nodes", 3, bucket) as swarm:
        # STARTUP_SNAPSHOT names step000001: every daemon loads it by itself at start.
        for d in swarm.daemons:
            assert d.wait_ready(IDS[0])["policy_version"] == 1
        for d in swarm.daemons:
            assert d.prefetch(IDS[2])[0] == 202
        for d in swarm.daemons:
            assert d.wait_ready(IDS[2])["policy_version"] == 3
        assert_identical(swarm, IDS[0], dirs[0])
        assert_identical(swarm, IDS[2], dirs[2])

        # Fetch once for the whole fleet: the bucket served each stored chunk once, all by owners.
        counters = [d.status()["counters"] for d in swarm.daemons]
        from_bucket = sum(c["bucket_bytes_owner"] + c["bucket_bytes_fallback"] for c in counters)
        assert sum(c["bucket_bytes_fallback"] for c in counters) == 0
        assert from_bucket <= sum(m.stored_bytes for m in manifests)
        assert sum(c["peer_bytes_in"] for c in counters) > 0
        assert sum(c["chunk_verify_failures"] for c in counters) == 0
        # With no download left running, each daemon gave its C heap's free pages back (memtrim).
        assert all(c["heap_trims"] >= 1 for c in counters), counters

        # The serving process sees exactly the trainer's arrays, zero-copy, bit for bit.
        for d in swarm.daemons:
            with DaemonClient(d.url) as client, client.open(IDS[2], timeout=120) as snap:
                assert snap.policy_version == 3
                for name, want in states[2].items():
                    got = snap.tensor(name)
                    assert got.shape == want.shape and got.dtype == want.dtype, name
                    assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), name
                snap.verify()
            # and by HTTP pull from the local API
            with DaemonClient(d.url) as client:
                t = client.read_tensor(IDS[2], "layers.1.mlp.up.weight")
                assert t.tobytes() == states[2]["layers.1.mlp.up.weight"].tobytes()


def _range(r) -> tuple[int, int]:
    m = re.fullmatch(r"bytes=(\d+)-(\d+)", r.range or "")
    assert m, f"chunk GET without a byte range: {r.key} {r.range}"
    return int(m.group(1)), int(m.group(2)) + 1


def test_s3_bucket_no_stored_byte_fetched_twice(tmp_path: Path, s3_bucket) -> None:
    from support.s3server import S3Proxy

    bucket, endpoint = s3_bucket
    states, dirs, manifests = publish_chain(tmp_path, bucket, endpoint)  # straight to moto
    proxy = S3Proxy(endpoint).start()
    try:
        env = {"BDN_ENDPOINT_URL": proxy.url}
        with Swarm(tmp_path / "nodes", 3, bucket, extra_env=env) as swarm:
            for d in swarm.daemons:
                d.wait_ready(IDS[0])
            for d in swarm.daemons:
                d.prefetch(IDS[2])
            for d in swarm.daemons:
                d.wait_ready(IDS[2])
            assert_identical(swarm, IDS[2], dirs[2])
        gets = [r for r in proxy.requests("GET") if r.key and r.status in (200, 206)]
    finally:
        proxy.stop()
    seen: dict[str, list[tuple[int, int]]] = {}
    manifest_reads: dict[str, int] = {}
    for r in gets:
        key = r.key.removeprefix("run1/")
        if key.endswith(MANIFEST_NAME) or key == "STARTUP_SNAPSHOT":
            manifest_reads[key] = manifest_reads.get(key, 0) + 1
            continue
        seen.setdefault(key, []).append(_range(r))
    # Every stored byte crossed the bucket's egress at most once, across the whole swarm.
    total = 0
    for key, ranges in seen.items():
        ranges.sort()
        for (_, a1), (b0, b1) in zip(ranges, ranges[1:]):
            assert a1 <= b0, f"{key}: bytes {b0}-{min(a1, b1)} fetched twice"
        total += sum(b - a for a, b in ranges)
    assert total <= sum(m.stored_bytes for m in manifests)
    # Each daemon reads each manifest itself (the bucket is the root of trust), once.
    for ident in IDS:
        assert manifest_reads.get(f"{ident}/{MANIFEST_NAME}", 0) <= 3
    m3 = Manifest.from_json(open_bucket(bucket, endpoint_url=endpoint).read(f"{IDS[2]}/{MANIFEST_NAME}"))
    assert m3.is_delta and m3.base_identity == IDS[1]
