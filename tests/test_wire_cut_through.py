"""Cut-through between real daemons (issue 9): while an owner's bucket read of a chunk is stuck
half way (the S3 server's answers held by a relay), the peers parked on that chunk already get
its landed bytes; once the bucket goes on, every daemon ends with the trainer's bytes, no chunk
fails its digest and no stored byte leaves the bucket twice."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from bdn.bucket import open_bucket
from bdn.publish import publish_full
from support.api import wait_for
from support.checkpoints import make_state, write_hf_dir
from support.relay import GateRelay
from support.swarm import Swarm

IDENT = "step000001"
CHUNK = 1 << 20


def _swarm_through_a_held_bucket(tmp_path: Path, s3_bucket, nodes: int, env: dict[str, str], held) -> list[dict]:
    """Publish, start ``nodes`` daemons whose bucket answers all stop after 256 KiB, wait for
    ``held(swarm)`` while they are stuck, let the bucket go on, check every daemon's bytes and
    that no chunk failed its digest and no stored byte left the bucket twice. The counters."""
    bucket, endpoint = s3_bucket
    ck = write_hf_dir(tmp_path / "trainer", make_state(0, scale=8), 1)
    b = open_bucket(bucket, endpoint_url=endpoint)
    try:
        m = publish_full(b, IDENT, 1, dir=ck, chunk_size=CHUNK)
    finally:
        b.close()
    u = urlsplit(endpoint)
    relay = GateRelay((u.hostname, u.port), after=256 << 10)  # every bucket answer stops after 256 KiB
    env = {"BDN_ENDPOINT_URL": relay.url, "BDN_LOAD_STARTUP": "false", "BDN_BUCKET_CONCURRENCY": "2", **env}
    try:
        with Swarm(tmp_path / "nodes", nodes, bucket, extra_env=env) as swarm:
            for d in swarm.daemons:
                assert d.prefetch(IDENT)[0] == 202
            wait_for(lambda: relay.held.is_set(), 120, "a bucket read held half way")
            held(swarm)
            relay.release()
            for d in swarm.daemons:
                d.wait_ready(IDENT, 120)
                got = Path(d.get(f"/v1/snapshots/{IDENT}")["path"])
                for p in ck.iterdir():
                    assert (got / p.name).read_bytes() == p.read_bytes(), (d.node_id, p.name)
            counters = [d.status()["counters"] for d in swarm.daemons]
    finally:
        relay.close()
    assert sum(c["chunk_verify_failures"] for c in counters) == 0, counters
    assert sum(c["bucket_bytes_fallback"] for c in counters) == 0, counters
    assert sum(c["bucket_bytes_owner"] for c in counters) == m.stored_bytes, counters
    return counters


def test_parked_peers_get_an_owners_bytes_while_its_bucket_read_lands(tmp_path: Path, s3_bucket) -> None:
    def held(swarm) -> None:
        # every owner's reads are stuck and every daemon has requests parked at owners
        wait_for(
            lambda: all(d.status()["inflight"]["peer"] > 0 for d in swarm.daemons), 120, "requests parked at the owners"
        )

    counters = _swarm_through_a_held_bucket(tmp_path, s3_bucket, 3, {}, held)
    assert sum(c["peer_chunks_in_cut_through"] for c in counters) > 0, counters
