"""Chunks that go bad in shm after READY (bdn/daemon/serve/chunkcheck.py, issue 12 review finding 1),
on real daemons: a receiver that gets a bad chunk tells the peer that sent it; the peer re-hashes
the chunk (a lying report changes nothing), quarantines and re-fetches it when it is bad; the
scrub finds one nobody asked for; ready snapshot files are read-only (0444)."""

from __future__ import annotations

import re
import stat
from pathlib import Path

from bdn.publish import publish_full
from support.api import wait_for
from support.checkpoints import flip_byte, make_state, write_hf_dir
from support.swarm import Daemon

CHUNK = 64 << 10
SHARD = "model-00001-of-00002.safetensors"
NO_STARTUP = {"BDN_LOAD_STARTUP": "false"}


def _metric(d: Daemon, name: str) -> float:
    text = d.get("/metrics").decode()
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    assert m, f"no {name}"
    return float(m.group(1))


def _report(d: Daemon, digest: str) -> int:
    """A signed ``POST bad_chunk`` for ``digest``'s address, as a peer would send it."""
    return d.peer_post("bad_chunk", {"address": d.keys.address(digest), "snapshot": "step000001"})[0]


def _ready_bytes(d: Daemon) -> bytes | None:
    snap = d.get("/v1/snapshots/step000001")
    return (Path(snap["path"]) / SHARD).read_bytes() if snap["state"] == "ready" else None


def test_a_lying_report_changes_nothing_and_the_scrub_repairs_a_bad_chunk(tmp_path: Path) -> None:
    bucket = f"file://{tmp_path}/bucket"
    ck = write_hf_dir(tmp_path / "ck", make_state(0, scale=2), 1)
    m = publish_full(bucket, "step000001", 1, dir=ck, chunk_size=CHUNK)
    shard = m.file(SHARD)
    good = (ck / SHARD).read_bytes()
    d = Daemon(tmp_path, "n1", bucket, extra_env=dict(NO_STARTUP, BDN_SCRUB_MBIT="200"))
    d.start([])
    try:
        d.wait_healthy(240)  # generous: a loaded machine imports for tens of seconds
        assert d.prefetch("step000001")[0] == 202
        path = Path(d.wait_ready("step000001")["path"])
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in path.iterdir()}
        assert set(modes.values()) == {0o444}, modes
        # A report on a good chunk: re-hashed, refuted, nothing dropped.
        assert _report(d, shard.chunks[1]) == 202
        wait_for(
            lambda: _metric(d, "bdn_bad_chunk_reports_refuted_total") == 1, 120, "report refuted", 0.1, detail=d.log
        )
        assert d.get("/v1/snapshots/step000001")["state"] == "ready"
        assert _metric(d, "bdn_chunks_quarantined_total") == 0
        # A chunk gone bad that nobody reports: the scrub finds it, quarantines, re-fetches it.
        flip_byte(path / SHARD, 2 * CHUNK + 3)
        wait_for(lambda: _metric(d, "bdn_chunks_quarantined_total") == 1, 120, "scrub quarantined", 0.1, detail=d.log)
        wait_for(lambda: _ready_bytes(d) == good, 120, "repaired", 0.1, detail=d.log)
        assert _metric(d, "bdn_chunks_scrubbed_total") > 0
    finally:
        d.stop()


def test_a_receiver_reports_a_bad_chunk_and_the_sender_repairs_it(tmp_path: Path) -> None:
    bucket = f"file://{tmp_path}/bucket"
    ck = write_hf_dir(tmp_path / "ck", make_state(0, scale=2), 1)
    publish_full(bucket, "step000001", 1, dir=ck, chunk_size=CHUNK)
    good = (ck / SHARD).read_bytes()
    # The receiver starts only once the sender's copy went bad (two daemons running together
    # would both fetch it: a peer's request makes a daemon join the snapshot).
    sender = Daemon(tmp_path / "nodes", "sender", bucket, extra_env=NO_STARTUP)
    receiver = Daemon(tmp_path / "nodes", "receiver", bucket, extra_env=NO_STARTUP)
    try:
        sender.start([])
        sender.wait_healthy()
        assert sender.prefetch("step000001")[0] == 202
        path = Path(sender.wait_ready("step000001")["path"])
        flip_byte(path / SHARD, CHUNK + 5)  # served as it is on disk until someone notices
        # The receiver takes chunks from the holder first: it gets the bad one, penalises the
        # sender, tells it, and takes the chunk elsewhere.
        receiver.start([sender.peer_url])
        receiver.wait_healthy()
        assert receiver.prefetch("step000001")[0] == 202
        receiver.wait_ready("step000001")
        assert _ready_bytes(receiver) == good
        wait_for(
            lambda: _metric(sender, "bdn_chunks_quarantined_total") == 1,
            120,
            "sender quarantined",
            0.1,
            detail=sender.log,
        )
        wait_for(lambda: _ready_bytes(sender) == good, 120, "sender repaired", 0.1, detail=sender.log)
        assert _metric(sender, "bdn_bad_chunk_reports_refuted_total") == 0
    finally:
        receiver.stop()
        sender.stop()
