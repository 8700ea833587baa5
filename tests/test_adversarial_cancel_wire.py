"""A download cancelled while a peer's chunk body is frozen mid-way (issue 27's one chunk path,
the receive buffer pool of ``bdn.transfer.receive.Rings``): real bdnd processes, a file://
bucket, a TCP relay in front of the sender's transfer server that passes the first bytes of
every connection and then holds the rest (the connection stays open: a peer whose HTTP side is
alive and whose wire falls silent mid-chunk).

Promised: ``DELETE /v1/snapshots/{id}`` answers at once (the fetch threads stuck in the frozen
bodies are ended, not waited out for the peer time-out), the record says ``failed`` with one
line, no receive buffer stays mapped once nothing downloads (``GET /v1/status`` ``buffers``),
and the snapshot loads again, whole, once the peer speaks again.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from bdn.bucket import open_bucket
from bdn.publish import publish_full
from support.api import wait_for
from support.checkpoints import make_state, write_hf_dir
from support.relay import GateRelay
from support.swarm import Daemon, free_port

IDENT = "step000001"

pytestmark = pytest.mark.timeout(600)


def test_delete_during_a_frozen_wire_body_answers_at_once_and_frees_the_receive_buffers(tmp_path: Path) -> None:
    bucket = f"file://{tmp_path}/bucket"
    ck = write_hf_dir(tmp_path / "trainer", make_state(0, scale=8), 1)
    b = open_bucket(bucket)
    try:
        publish_full(b, IDENT, 1, dir=ck, chunk_size=1 << 20)
    finally:
        b.close()
    env = {"BDN_LOAD_STARTUP": "false"}
    sender = Daemon(tmp_path / "nodes", "node0", bucket, extra_env=env)
    tport = free_port()
    gate = GateRelay(("127.0.0.1", tport), after=None)
    sender.env.update(BDN_TRANSFER_LISTEN=f"127.0.0.1:{tport}", BDN_TRANSFER_ADVERTISE=f"127.0.0.1:{gate.port}")
    # the peer time-out far past the test's bounds: only the cancellation can end a frozen body
    receiver = Daemon(tmp_path / "nodes", "node1", bucket, extra_env=dict(env, BDN_PEER_TIMEOUT_S="900"))
    sender.start([])
    try:
        sender.wait_healthy()
        assert sender.prefetch(IDENT)[0] == 202
        sender.wait_ready(IDENT, 120)
        # each connection to the sender's wire passes 256 KiB (the handshake, a quarter of a
        # chunk), then holds: every chunk the receiver asks of the sender freezes mid-body
        gate.after = 256 << 10
        gate.open.clear()
        receiver.start([sender.peer_url])
        receiver.wait_healthy()
        wait_for(
            lambda: {p["node_id"] for p in receiver.status()["peers"] if p["alive"]},
            120,
            "the receiver to see the sender alive",
            until=lambda alive: alive == {sender.node_id},
        )
        assert receiver.prefetch(IDENT)[0] == 202
        wait_for(gate.held.is_set, 120, "a chunk body frozen mid-way at the relay")
        wait_for(
            lambda: receiver.status()["buffers"]["receive_buffers"] > 0,
            60,
            "the receiver receiving into a buffer",
        )
        t0 = time.monotonic()
        status, rec = receiver.request("DELETE", f"/v1/snapshots/{IDENT}", timeout=300)
        took = time.monotonic() - t0
        assert status == 200, (status, rec)
        assert took < 30, f"DELETE took {took:.1f} s: it waited for the frozen bodies"
        assert rec["state"] == "failed" and "\n" not in rec["reason"], rec
        wait_for(
            lambda: receiver.status()["buffers"],
            60,
            "the receive buffers unmapped once nothing downloads",
            until=lambda b: b["receive_buffers"] == 0,
        )
        gate.release()
        assert receiver.prefetch(IDENT)[0] == 202
        receiver.wait_ready(IDENT, 300)
        got = Path(receiver.get(f"/v1/snapshots/{IDENT}")["path"])
        for p in ck.iterdir():
            assert (got / p.name).read_bytes() == p.read_bytes(), p.name
    finally:
        receiver.stop()
        sender.stop()
        gate.close()


def test_a_repair_fetched_over_the_wire_leaves_no_receive_buffer_mapped(tmp_path: Path) -> None:
    """A chunk of a ready snapshot corrupted on disk, repaired (``POST .../repair``) from the peer
    over the wire: once the snapshot is ready again and nothing downloads, no receive buffer stays
    mapped (the buffers were given back only at the end of a whole download, which a repair is
    not: they stayed until the next download ended)."""
    bucket = f"file://{tmp_path}/bucket"
    ck = write_hf_dir(tmp_path / "trainer", make_state(0, scale=8), 1)
    b = open_bucket(bucket)
    try:
        publish_full(b, IDENT, 1, dir=ck, chunk_size=1 << 20)
    finally:
        b.close()
    env = {"BDN_LOAD_STARTUP": "false"}
    holder = Daemon(tmp_path / "nodes", "node0", bucket, extra_env=env)
    victim = Daemon(tmp_path / "nodes", "node1", bucket, extra_env=env)
    holder.start([victim.peer_url])
    victim.start([holder.peer_url])
    try:
        for d in (holder, victim):
            d.wait_healthy()
        wait_for(
            lambda: {p["node_id"] for p in victim.status()["peers"] if p["alive"]},
            120,
            "the victim to see the holder alive",
            until=lambda alive: alive == {holder.node_id},
        )
        for d in (holder, victim):
            assert d.prefetch(IDENT)[0] == 202
        for d in (holder, victim):
            d.wait_ready(IDENT, 120)
        wait_for(
            lambda: victim.status()["buffers"],
            60,
            "the receive buffers unmapped after the download",
            until=lambda b: b["receive_buffers"] == 0,
        )
        shard = Path(victim.get(f"/v1/snapshots/{IDENT}")["path"]) / "model-00001-of-00002.safetensors"
        shard.chmod(0o644)
        with open(shard, "r+b") as fh:  # every chunk of the shard: a byte each
            for off in range(1 << 19, shard.stat().st_size, 1 << 20):
                fh.seek(off)
                c = fh.read(1)
                fh.seek(off)
                fh.write(bytes([c[0] ^ 0xFF]))
        status, rep = victim.request("POST", f"/v1/snapshots/{IDENT}/repair")
        assert status == 200 and rep["corrupted"], (status, rep)
        victim.wait_ready(IDENT, 300)
        assert shard.read_bytes() == (ck / shard.name).read_bytes()
        assert victim.status()["counters"]["peer_wire_bytes_in"] > 0
        wait_for(
            lambda: victim.status()["buffers"],
            60,
            "the receive buffers unmapped after the repair",
            until=lambda b: b["receive_buffers"] == 0,
        )
    finally:
        victim.stop()
        holder.stop()


def test_many_concurrent_downloads_then_none_leave_no_buffer_mapped(tmp_path: Path) -> None:
    """Three daemons load four snapshots at once (every daemon receives over the wire into many
    buffers at a time); once all are ready and nothing downloads, no daemon keeps a receive or
    chunk buffer (``GET /v1/status`` ``buffers``)."""
    from support.swarm import Swarm

    bucket = f"file://{tmp_path}/bucket"
    idents = [f"run{i}" for i in range(4)]
    ckpts = {}
    b = open_bucket(bucket)
    try:
        for i, ident in enumerate(idents):
            ckpts[ident] = write_hf_dir(tmp_path / f"trainer{i}", make_state(i, scale=4), 1)
            publish_full(b, ident, i + 1, dir=ckpts[ident], chunk_size=256 << 10)
    finally:
        b.close()
    swarm = Swarm(tmp_path / "nodes", 3, bucket, extra_env={"BDN_LOAD_STARTUP": "false", "BDN_KEEP_READY": "4"})
    with swarm:
        for ident in idents:
            for d in swarm.daemons:
                assert d.prefetch(ident)[0] == 202
        for d in swarm.daemons:
            for ident in idents:
                d.wait_ready(ident, 300)
                got = Path(d.get(f"/v1/snapshots/{ident}")["path"])
                for p in ckpts[ident].iterdir():
                    assert (got / p.name).read_bytes() == p.read_bytes(), (d.node_id, ident, p.name)
        assert sum(d.status()["counters"]["peer_wire_bytes_in"] for d in swarm.daemons) > 0
        for d in swarm.daemons:
            wait_for(
                lambda d=d: d.status()["buffers"],
                60,
                f"{d.node_id}: no buffer mapped once nothing downloads",
                until=lambda b: b["receive_buffers"] == 0 and b["chunk_buffers"] == 0,
            )
