"""bdnd on the transfer wire (issue 9): real daemons move chunk bytes over bdn.transfer (sendfile
out, recv_into the target mapping), fall back to HTTP for peers that advertise no transfer
server, and write the per-chunk event log."""

from __future__ import annotations

import json
from pathlib import Path

from bdn.bucket import open_bucket
from bdn.proto.manifest import Manifest
from bdn.publish import publish_full
from support.checkpoints import make_state, write_hf_dir
from support.swarm import Swarm

CHUNK = 64 << 10
IDENT = "step000001"


def publish(tmp_path: Path, bucket: str) -> tuple[Manifest, Path]:
    ck = write_hf_dir(tmp_path / "trainer", make_state(0, scale=4), 1)
    b = open_bucket(bucket)
    try:
        return publish_full(b, IDENT, 1, dir=ck, chunk_size=CHUNK), ck
    finally:
        b.close()


def assert_same(d, ck: Path) -> None:  # noqa: ANN001 - a support.swarm.Daemon
    got = Path(d.get(f"/v1/snapshots/{IDENT}")["path"])
    for p in ck.iterdir():
        assert (got / p.name).read_bytes() == p.read_bytes(), (d.node_id, p.name)


def test_chunks_move_over_the_wire_and_the_chunk_log_says_so(tmp_path: Path) -> None:
    bucket = f"file://{tmp_path}/bucket"
    m, ck = publish(tmp_path, bucket)
    swarm = Swarm(tmp_path / "nodes", 3, bucket, extra_env={"BDN_LOAD_STARTUP": "false"})
    logs = {d.node_id: d.dir / "chunks.jsonl" for d in swarm.daemons}
    for d in swarm.daemons:
        d.env["BDN_CHUNK_LOG"] = str(logs[d.node_id])
    with swarm.start():
        for d in swarm.daemons:
            assert d.prefetch(IDENT)[0] == 202
        for d in swarm.daemons:
            d.wait_ready(IDENT, 60)
            assert_same(d, ck)
        counters = [d.status()["counters"] for d in swarm.daemons]
        peer_in = sum(c["peer_bytes_in"] for c in counters)
        assert peer_in > 0
        # every peer advertises a transfer server: every peer byte went over the wire
        assert sum(c["peer_wire_bytes_in"] for c in counters) == peer_in, counters
        assert sum(c["peer_wire_bytes_out"] for c in counters) == sum(c["peer_bytes_out"] for c in counters) > 0
        assert sum(c["chunk_verify_failures"] for c in counters) == 0
        n_chunks = len(list(m.stored_chunks()))
        for d in swarm.daemons:
            lines = [json.loads(x) for x in logs[d.node_id].read_text().splitlines()]
            assert len(lines) == n_chunks, (d.node_id, len(lines), n_chunks)
            assert sorted(x["chunk"] for x in lines) == list(range(n_chunks))
            for x in lines:
                assert x["snapshot"] == IDENT and x["bytes"] > 0 and x["end"] >= x["start"] > 0, x
                assert x["source"] in ("bucket-owner", "bucket-fallback", "local") or x["source"].startswith("peer:"), x
                if x["source"].startswith("peer:"):
                    assert x["transport"] == "wire", x
            c = d.status()["counters"]
            from_peers = sum(x["bytes"] for x in lines if x["source"].startswith("peer:"))
            assert from_peers == c["peer_bytes_in"], (d.node_id, from_peers, c)


def test_a_peer_without_a_transfer_server_is_asked_over_http(tmp_path: Path) -> None:
    bucket = f"file://{tmp_path}/bucket"
    _, ck = publish(tmp_path, bucket)
    swarm = Swarm(tmp_path / "nodes", 3, bucket, extra_env={"BDN_LOAD_STARTUP": "false"})
    plain = swarm.daemons[0]
    plain.env["BDN_TRANSFER_LISTEN"] = ""  # this one speaks HTTP only
    with swarm.start():
        for d in swarm.daemons:
            assert d.prefetch(IDENT)[0] == 202
        for d in swarm.daemons:
            d.wait_ready(IDENT, 60)
            assert_same(d, ck)
        c = {d.node_id: d.status()["counters"] for d in swarm.daemons}
        # the plain daemon fetched everything over HTTP and served over HTTP only
        assert c[plain.node_id]["peer_bytes_in"] > 0 and c[plain.node_id]["peer_wire_bytes_in"] == 0, c
        assert c[plain.node_id]["peer_wire_bytes_out"] == 0, c
        # the others took the plain daemon's chunks over HTTP and each other's over the wire
        for d in swarm.daemons[1:]:
            cc = c[d.node_id]
            assert 0 < cc["peer_wire_bytes_in"] < cc["peer_bytes_in"], (d.node_id, c)
        assert sum(x["chunk_verify_failures"] for x in c.values()) == 0
