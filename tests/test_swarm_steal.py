"""Reads taken over at the end of a slow owner's list (``steal_reads``, bdn.daemon.fetch.fetcher).

Five real daemons on a file:// bucket; one reads the bucket at 2 Mbit/s (``bucket_mbit``), the
others at full speed. The fast ones finish their own chunks at once and read the slow owner's
last chunks for it, announced over the transfer wire, so that the slow owner gives its own read
of them up: every chunk is still read from the bucket exactly once (fetch once), nobody falls
back, and every node ends with the trainer's bytes."""

from __future__ import annotations

from pathlib import Path

from bdn.publish import publish_full
from support.checkpoints import make_state, write_hf_dir
from support.swarm import Daemon

IDENTITY = "step000001"


def test_fast_nodes_take_over_a_slow_owners_last_reads(tmp_path: Path) -> None:
    bucket = f"file://{tmp_path}/bucket"
    src = write_hf_dir(tmp_path / "ckpt", make_state(7, scale=8))  # ~9 MB: 36 chunks of 256 KiB
    manifest = publish_full(bucket, IDENTITY, 1, dir=src, chunk_size=256 * 1024)
    n_chunks = sum(1 for _ in manifest.stored_chunks())
    assert n_chunks >= 24

    # five: with four live peers or more, a request waits at most QUEUE_S for a stream to the
    # owner (bdn.daemon.fetch.wire_source) and then sleeps until an announcement, which is
    # where a take-over finds it; with fewer, requests queue at the owner until it answers
    daemons = [Daemon(tmp_path / "nodes", f"node{i}", bucket) for i in range(5)]
    daemons[0].env["BDN_BUCKET_MBIT"] = "2"  # the slow owner: 250 kB/s, its share would take ~12 s
    urls = [d.peer_url for d in daemons]
    try:
        for d in daemons:
            d.start(urls)
        for d in daemons:
            d.wait_healthy()
        for d in daemons:
            assert d.prefetch(IDENTITY)[0] in (200, 202)
        for d in daemons:
            d.wait_ready(IDENTITY, timeout=300)
        counters = [d.status()["counters"] for d in daemons]
        owner_reads = [c["bucket_chunks_owner"] for c in counters]
        assert sum(c["bucket_chunks_fallback"] for c in counters) == 0
        assert sum(owner_reads) == n_chunks, owner_reads  # every chunk read once, by one node
        assert sum(c["bucket_chunks_taken_over"] for c in counters[1:]) > 0, counters
        assert counters[0]["bucket_chunks_taken_over"] == 0
        # every read taken over was granted by its owner first (TAKE/GIVE): the slow owner gave
        # them all, and nobody read a chunk without a grant
        taken = sum(c["bucket_chunks_taken_over"] for c in counters)
        assert sum(c["bucket_reads_given"] for c in counters) >= taken, counters
        assert sum(c["chunk_verify_failures"] for c in counters) == 0
        for d in daemons:
            snap = d.get(f"/v1/snapshots/{IDENTITY}")
            assert snap["state"] == "ready", (d.node_id, snap)
            for f in src.iterdir():
                assert (Path(snap["path"]) / f.name).read_bytes() == f.read_bytes(), (d.node_id, f.name)
    finally:
        for d in daemons:
            d.stop()
