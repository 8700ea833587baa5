"""A peer whose advertised transfer address is wrong while its HTTP side is alive (issue 27: the
wire is the one chunk path between daemons): real bdnd processes, a file:// bucket.

Each case: node2 advertises, as its wire address, a port where nothing listens, its own HTTP
peer port (a non-bdn TCP server that answers the wire's hello with HTTP), or the transfer port of
a daemon of another partition (the right protocol, the wrong secret), or another member's
(the right partition, the wrong node). Promised: every node is
READY with the trainer's bytes within a bounded time (node2's chunks come from elsewhere, the
bucket last), no chunk from the bad address is ever written, the daemons keep answering.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bdn.bucket import open_bucket
from bdn.publish import publish_full
from support.checkpoints import make_state, write_hf_dir
from support.swarm import Daemon, Swarm, free_port

CHUNK = 64 << 10
IDENT = "step000001"

pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize("kind", ["closed", "http", "other-partition", "another-member"])
def test_a_peer_advertising_a_wrong_wire_address_costs_no_snapshot(tmp_path: Path, kind: str) -> None:
    bucket = f"file://{tmp_path}/bucket"
    ck = write_hf_dir(tmp_path / "trainer", make_state(0, scale=4), 1)
    b = open_bucket(bucket)
    try:
        m = publish_full(b, IDENT, 1, dir=ck, chunk_size=CHUNK)
    finally:
        b.close()
    env = {"BDN_LOAD_STARTUP": "false"}
    swarm = Swarm(tmp_path / "nodes", 3, bucket, extra_env=env)
    liar = swarm.daemons[2]
    foreign = None
    if kind == "closed":
        target = free_port()
    elif kind == "http":
        target = liar.peer_port
    elif kind == "another-member":  # the wire of node0, a member of the same partition
        target = swarm.daemons[0].transfer_port
    else:
        foreign = Daemon(
            tmp_path / "other", "nodeX", bucket, secret="another partition's secret 0123456789", extra_env=env
        )
        target = foreign.transfer_port
    liar.env["BDN_TRANSFER_ADVERTISE"] = f"127.0.0.1:{target}"
    logs = {d.node_id: d.dir / "chunks.jsonl" for d in swarm.daemons}
    for d in swarm.daemons:
        d.env["BDN_CHUNK_LOG"] = str(logs[d.node_id])
    if foreign is not None:
        foreign.start([])
    try:
        with swarm:
            if foreign is not None:
                foreign.wait_healthy()
                assert foreign.prefetch(IDENT)[0] == 202  # it holds the same bytes, in its partition
                foreign.wait_ready(IDENT, 120)
            for d in swarm.daemons:
                assert d.prefetch(IDENT)[0] == 202
            for d in swarm.daemons:
                d.wait_ready(IDENT, 240)
                got = Path(d.get(f"/v1/snapshots/{IDENT}")["path"])
                for p in ck.iterdir():
                    assert (got / p.name).read_bytes() == p.read_bytes(), (kind, d.node_id, p.name)
            n_chunks = len(list(m.stored_chunks()))
            for d in swarm.daemons[:2]:
                lines = [json.loads(x) for x in logs[d.node_id].read_text().splitlines()]
                assert len(lines) == n_chunks, (d.node_id, len(lines))
                assert not [x for x in lines if x["source"] == f"peer:{liar.node_id}"], lines
                assert d.status()["counters"]["chunk_verify_failures"] == 0
            if foreign is not None:
                assert foreign.status()["counters"]["peer_bytes_out"] == 0
    finally:
        if foreign is not None:
            foreign.stop()
