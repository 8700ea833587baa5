"""kill -9 of bdnd in the middle of a background catch-up (a freed spare brought forward to the
served snapshot, bdn/daemon/apply/forward.py) or of a seed (a buffer copied from the anchor), with
real processes and real safetensors files: after the restart no spare claimed by the dead catch-up
(nor a half-written tag) is left, and every later delta is READY with the trainer's bytes, whether
it starts from a spare caught up before the kill or rebuilds. The catch-up is held at its claimed
spare by a failpoint (bdn/daemon/process/failpoints.py), so each kill lands inside it."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from bdn.client.fleet import hot_load
from bdn.daemon.process import failpoints
from bdn.proto.keys import derive_keys
from support.api import wait_for
from support.chains import file_chain, step_id
from support.swarm import SECRET, Daemon

CHUNK = 256 << 10
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
SWARM_ID = derive_keys(SECRET).swarm_id
ENV = {"BDN_LOAD_STARTUP": "false", "BDN_KEEP_READY": "1", "BDN_GC_GRACE_S": "0"}

pytestmark = pytest.mark.timeout(900)


def _claimed(spares: Path) -> bool:
    try:
        return any(n.startswith(".claimed-") for n in os.listdir(spares))
    except FileNotFoundError:
        return False


def _metric(d: Daemon, what: str) -> float:
    m = re.search(rf'^bdn_sparse_total\{{what="{what}"\}} (\S+)$', d.get("/metrics").decode(), re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def test_kill_9_during_a_background_catch_up_then_restart_keeps_the_trainers_bytes(tmp_path: Path) -> None:
    steps = 5
    chain = file_chain(
        tmp_path,
        steps,
        chunk_size=CHUNK,
        scale=16,
        frac=0.02,
        formats={v: "bdn_planes_v1" for v in range(2, steps + 2)},
    )

    def hold_catch_up_to(v: int) -> None:  # (read by bdnd when it starts)
        if v <= steps:
            d.env[failpoints.ENV] = f"catch_up.claimed={step_id(v)}"
        else:
            d.env.pop(failpoints.ENV, None)

    d = Daemon(tmp_path / "work", "node0", chain.url, extra_env=ENV)
    spares = d.shm_dir / SWARM_ID / ".spares"
    hold_catch_up_to(3)
    d.start([])
    kills = 0
    try:
        d.wait_healthy()
        previous = None
        for v in range(1, steps + 2):
            hot_load(d.url, step_id(v), previous=previous)
            d.wait_ready(step_id(v), 300)
            got = d.shm_dir / SWARM_ID / step_id(v)
            for shard in SHARDS:
                assert (got / shard).read_bytes() == (chain.dirs[v - 1] / shard).read_bytes(), f"{step_id(v)}/{shard}"
            previous = step_id(v)
            if v < 3 or v == steps + 1:
                continue
            # step v-1's spare is being brought forward to step v: kill -9 while it is claimed
            held = f"failpoint catch_up.claimed reached ({step_id(v)})"
            wait_for(lambda held=held: held in d.log_path.read_text(), 300, f"the catch-up to {step_id(v)} held")
            assert _claimed(spares)
            d.kill()
            kills += 1
            assert _claimed(spares)  # what the crash left
            half_tag = spares / ".tags" / ".0-0.tmp"  # as a kill inside Spares._write_tag leaves it
            half_tag.parent.mkdir(exist_ok=True)
            half_tag.write_text('{"identity": "st')
            hold_catch_up_to(v + 1)
            d.start([])
            d.wait_healthy()
            wait_for(lambda: not _claimed(spares), 60, "the restart removing the claimed spare")
            assert not half_tag.exists()
        assert kills == steps - 2
        assert _metric(d, "chunks_bad") == 0
        # the last catch-up, not held, ends with a spare tagged with the served snapshot
        wait_for(
            lambda: f"to {step_id(steps + 1)} in the background" in d.log_path.read_text(), 300, "the last catch-up"
        )
    finally:
        d.stop()


def test_kill_9_during_a_seed_copy_then_restart_leaves_no_buffer_and_the_next_delta_is_right(tmp_path: Path) -> None:
    """kill -9 while the anchor's buffer is being copied (a seed, held slow by its rate bound):
    the restart deletes the half-copied file and no tag names it; the first delta then copies the
    anchor itself (at full speed, it waits for it) and is READY with the trainer's bytes."""
    chain = file_chain(
        tmp_path, 2, chunk_size=CHUNK, scale=4, frac=0.02, formats={2: "bdn_planes_v1", 3: "bdn_planes_v1"}
    )
    d = Daemon(tmp_path / "work", "node0", chain.url, extra_env=dict(ENV, BDN_SPARSE_SEED_MBIT="0.001"))
    spares = d.shm_dir / SWARM_ID / ".spares"
    d.start([])
    try:
        d.wait_healthy()
        hot_load(d.url, step_id(1))
        d.wait_ready(step_id(1), 300)
        wait_for(lambda: _claimed(spares), 60, "the seed copy under way")
        d.kill()
        half = {n for n in os.listdir(spares) if n.startswith(".claimed-")}
        d.start([])
        d.wait_healthy()
        # (the restarted daemon serves the anchor again and may start a new seed: another name)
        wait_for(lambda: not half & set(os.listdir(spares)), 60, "the restart removing the half-copied buffer")
        tags = spares / ".tags"
        assert not tags.is_dir() or not [t for t in tags.iterdir() if not t.name.startswith(".")]  # no tag on it
        previous = step_id(1)
        for v in (2, 3):
            hot_load(d.url, step_id(v), previous=previous)
            d.wait_ready(step_id(v), 300)
            got = d.shm_dir / SWARM_ID / step_id(v)
            for shard in SHARDS:
                assert (got / shard).read_bytes() == (chain.dirs[v - 1] / shard).read_bytes(), f"{step_id(v)}/{shard}"
            previous = step_id(v)
        assert _metric(d, "applies") >= len(SHARDS)  # step 2 at least, on the copy the delta waited for
        assert _metric(d, "fallbacks") == 0 and _metric(d, "chunks_bad") == 0
    finally:
        d.stop()


def test_sigterm_during_a_seed_copy_stops_it_cleanly(tmp_path: Path) -> None:
    """SIGTERM while the anchor's buffer is being copied (a seed held slow by its rate bound):
    bdnd exits 0 and no background task of the seed or the catch-up dies unobserved (a task that
    asked a thread pool after shutdown had closed it logged "Task exception was never retrieved")."""
    chain = file_chain(tmp_path, 1, chunk_size=CHUNK, scale=4, frac=0.02, formats={})
    # (a shutdown bound far above what the stop needs: with both cores busy its threads may wait
    # for a core, and past the bound bdnd exits 1 by design)
    env = dict(ENV, BDN_SPARSE_SEED_MBIT="0.001", BDN_SHUTDOWN_TIMEOUT_S="120")
    d = Daemon(tmp_path / "work", "node0", chain.url, extra_env=env)
    spares = d.shm_dir / SWARM_ID / ".spares"
    d.start([])
    try:
        d.wait_healthy()
        hot_load(d.url, step_id(1))
        d.wait_ready(step_id(1), 300)
        wait_for(lambda: _claimed(spares), 60, "the seed copy under way")
        assert d.proc is not None
        d.stop(timeout=300)
        assert d.proc.returncode == 0, d.log()
        text = d.log_path.read_text()
        assert "never retrieved" not in text and "after shutdown" not in text, d.log()
        # the copy thread saw the cancel and ended: not left running until the shutdown bound
        assert "still busy after the shutdown timeout" not in text, d.log()
    finally:
        d.stop()
