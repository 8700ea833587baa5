"""Rebound hot-loads, back to back, build each new snapshot in the page pool's recycled pages.

A real bdnd (default ``keep_ready`` 2, a ``gc_grace_s`` longer than the test) and a real engine
process (``python -m bdn.engines hf``: transformers, the default rebinding swap) go through an
anchor and four deltas of a tiny LlamaForCausalLM, one hot-load each, every POST as soon as the
replica is done with the previous one (a burst, as a trainer that steps faster than the grace).
The grace keeps a snapshot that just became ready (someone asked for it), but a snapshot the
replica targeted or served and then left is done with: GC removes it (keeping the newest two),
its file becomes a spare and the next snapshot's file is that spare's pages. Before this, GC
removed nothing within the grace, and every snapshot of the burst was ``posix_fallocate``d in
fresh tmpfs pages (the hot-load benchmark's rebound row, issue 27). The daemon's log line per
snapshot, ``reserved N bytes, M in recycled pages``, is what is checked; the last snapshot's
files are verified against READY.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bdn.engines.hf import torch_available

_why = torch_available()
if _why:
    pytest.skip(f"the transformers engine needs torch and transformers ({_why})", allow_module_level=True)

from bdn.client import hot_load, hot_load_status, open_snapshot  # noqa: E402
from bdn.publish import publish_delta, publish_full, publish_startup  # noqa: E402
from support.api import http, wait_for  # noqa: E402
from support.swarm import Swarm, free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "engine"))
import tiny_llama  # noqa: E402

CHUNK = 64 << 10
IDS = [f"step{i:06d}" for i in range(1, 6)]  # an anchor and four deltas
RESERVED = re.compile(r"snapshot (\S+): reserved (\d+) bytes, (\d+) in recycled pages")

pytestmark = pytest.mark.timeout(900)


def replica_done(url: str, identity: str):
    reps = hot_load_status(url)
    errs = [r for r in reps if r["loading_state"]["stage"] == "error"]
    assert not errs, errs
    done = all(r["current_snapshot_identity"] == identity and r["loading_state"]["stage"] == "done" for r in reps)
    return reps if done else None


def test_rebound_hot_loads_in_a_burst_take_recycled_pages(tmp_path: Path) -> None:
    bucket = f"file://{tmp_path}/bucket"
    d1 = tmp_path / "ck1"
    _model, state = tiny_llama.make_tiny_llama(d1, hidden=64, layers=2, seed=3)
    publish_full(bucket, IDS[0], 1, dir=d1, chunk_size=CHUNK)
    prev = d1
    for i, ident in enumerate(IDS[1:], start=2):
        state = tiny_llama.optimizer_step(state, 0.02, seed=10 + i)
        d = tiny_llama.save_state(tmp_path / f"ck{i}", d1, state)
        publish_delta(bucket, ident, i, IDS[i - 2], dir=d, base_dir=prev, chunk_size=CHUNK)
        prev = d
    publish_startup(bucket, IDS[0])
    model_file = (d1 / "model.safetensors").stat().st_size

    # the grace outlasts the test however slow the machine: only having been left frees a snapshot
    with Swarm(tmp_path / "nodes", 1, bucket, extra_env={"BDN_GC_GRACE_S": "3600"}) as swarm:
        node = swarm.daemons[0]
        port = free_port()
        out = tmp_path / "engine.log"
        with out.open("wb") as f:
            engine = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "bdn.engines",
                    "hf",
                    "--bdn-url",
                    node.url,
                    "--listen",
                    f"127.0.0.1:{port}",
                    "--log-level",
                    "info",
                ],
                env=dict(os.environ),
                stdout=f,
                stderr=subprocess.STDOUT,
            )
        try:

            def served(ident: str):
                assert engine.poll() is None, out.read_text(errors="replace")
                return replica_done(node.url, ident)

            # the daemon alone is done at once: wait for the engine's own ack of the anchor
            wait_for(
                lambda: (reps := served(IDS[0])) and reps[0]["engines"] == 1 and reps[0]["last_swap"],
                600,
                f"the engine to serve {IDS[0]}",
                detail=node.log,
            )
            for prev_id, ident in zip(IDS, IDS[1:]):
                hot_load(node.url, ident, previous=prev_id)
                wait_for(lambda i=ident: served(i), 300, f"the replica done with {ident}", detail=node.log)
            log = node.log_path.read_text(errors="replace")
            recycled = {m.group(1): int(m.group(3)) for m in RESERVED.finditer(log)}
            print({k: recycled.get(k) for k in IDS})
            assert set(recycled) >= set(IDS), log[-3000:]
            # from the fourth snapshot on, its model file is built in pages GC recycled
            for ident in IDS[3:]:
                assert recycled[ident] >= model_file, (ident, recycled, log[-3000:])
            for ident in IDS[:2]:  # left by the replica, older than the two newest: removed
                assert f"gc: removed snapshot {ident}" in log, log[-3000:]
            status, body = http("GET", f"{node.url}/v1/snapshots/{IDS[-1]}")
            assert status == 200 and body["state"] == "ready", body
            with open_snapshot(node.store / IDS[-1]) as s:
                s.verify()
        finally:
            engine.terminate()
            try:
                engine.wait(60)
            except subprocess.TimeoutExpired:
                engine.kill()
                engine.wait()
    # the engine's own lines (read once it exited: its output is buffered)
    swaps = re.findall(r"serving (step\d+) .*: (swapped the \d+ changed tensors|loaded a new model)", out.read_text())
    # one first load, then the changed tensors of each delta (rebound: the engine's default)
    assert [w[:6] for _, w in swaps] == ["loaded"] + ["swappe"] * 4, out.read_text(errors="replace")
