"""bdnd restarted under a serving engine (SIGTERM, the same shm_dir), with real processes: the
transformers engine (its driver, a real hot-load chain of ``bdn_planes_v1`` deltas) registers
again and says what it serves, so the restarted daemon counts it (the replica ``done``, the
snapshot leased) and the next delta is a word-level swap relative to it, bit for bit.

Before the fix a re-registered engine was never offered the snapshot it already served (it polls
``after`` it) and so never acknowledged it: the replica stayed ``ready`` with one engine for good,
the served snapshot had no lease (GC could take it), and the next offer carried no changed
tensors or words (the engine compared the snapshots, or reloaded whole).
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from bdn.engines.hf import torch_available

_why = torch_available()
if _why:
    pytest.skip(f"the transformers engine needs torch and transformers ({_why})", allow_module_level=True)

import torch  # noqa: E402
import xxhash  # noqa: E402

from bdn.client import hot_load, hot_load_status  # noqa: E402
from bdn.engines.service import HFService  # noqa: E402
from bdn.publish import publish_delta, publish_full, publish_startup  # noqa: E402
from support.api import wait_for  # noqa: E402
from support.swarm import Daemon, free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "engine"))
import tiny_llama  # noqa: E402

CHUNK = 64 << 10
IDS = [f"step{i:06d}" for i in range(1, 4)]


def digests(state: dict[str, torch.Tensor]) -> dict[str, str]:
    return {
        k: xxhash.xxh3_128_hexdigest(v.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        for k, v in state.items()
    }


def test_a_restarted_daemon_counts_the_engine_that_serves_already_and_the_next_swap_is_word_level(
    tmp_path: Path,
) -> None:
    bucket = f"file://{tmp_path}/bucket"
    dirs = [tmp_path / "ck1"]
    _model, s = tiny_llama.make_tiny_llama(dirs[0], hidden=64, layers=2, seed=5)
    states = [s]
    publish_full(bucket, IDS[0], 1, dir=dirs[0], chunk_size=CHUNK)
    for i in range(1, len(IDS)):
        states.append(tiny_llama.optimizer_step(states[-1], 0.02, seed=40 + i, tensors=1000))
        dirs.append(tiny_llama.save_state(tmp_path / f"ck{i + 1}", dirs[0], states[-1]))
        publish_delta(
            bucket,
            IDS[i],
            i + 1,
            IDS[i - 1],
            dir=dirs[i],
            base_dir=dirs[i - 1],
            compression_format="bdn_planes_v1",
            chunk_size=CHUNK,
        )
    publish_startup(bucket, IDS[0])
    d = Daemon(tmp_path / "nodes", "node0", bucket, extra_env={"BDN_KEEP_READY": "1", "BDN_GC_GRACE_S": "0"})

    def engines() -> list[dict]:
        return d.get("/v1/engines")["engines"]

    def done(identity: str) -> bool:
        reps = hot_load_status(d.url)
        return all(r["current_snapshot_identity"] == identity and r["loading_state"]["stage"] == "done" for r in reps)

    d.start([])
    svc = None
    try:
        d.wait_healthy()
        svc = HFService(d.url, "127.0.0.1", free_port(), replica_id="node0", poll_timeout=2.0).start()
        wait_for(lambda: done(IDS[0]) and svc.engine.identity == IDS[0], 180, f"{IDS[0]} served")
        assert hot_load(d.url, IDS[1], previous=IDS[0])["accepted"] is True
        wait_for(lambda: done(IDS[1]) and svc.engine.identity == IDS[1], 180, f"{IDS[1]} served")
        assert svc.engine.last_swap["changed_source"] == "words"
        (before,) = engines()

        d.stop(signal.SIGTERM, timeout=60)
        assert d.proc is not None and d.proc.returncode == 0, d.log()
        d.start([])
        d.wait_healthy()
        # the engine's next poll finds the daemon restarted (404) and registers again, saying what it serves
        (after,) = wait_for(
            lambda: [e for e in engines() if e["engine_id"] != before["engine_id"]], 120, "the engine registered again"
        )
        assert after["serving"] == IDS[1], after
        (rep,) = hot_load_status(d.url)
        assert rep["loading_state"]["stage"] == "done" and rep["engines"] == 1, rep
        # the next delta: offered relative to what the engine serves, applied word by word
        assert hot_load(d.url, IDS[2], previous=IDS[1])["accepted"] is True
        wait_for(lambda: done(IDS[2]) and svc.engine.identity == IDS[2], 180, f"{IDS[2]} served", detail=d.log)
        rep2 = svc.engine.last_swap
        assert rep2["mode"] == "partial" and rep2["changed_source"] == "words", rep2
        assert svc.engine.weights_digest() == digests(states[2])
    finally:
        if svc is not None:
            svc.stop()
        d.stop()
