"""bdnd restarted under a serving engine (SIGTERM, the same shm_dir), with real processes. The
restarted daemon knows its engines at once (the table it keeps, bdn/daemon/replica/registry.py):
the transformers engine (its driver, a real hot-load chain of ``bdn_planes_v1`` deltas) is counted
(the replica ``done``, its snapshot leased), a target hot-loaded before the engine polls again is
``done`` only once the engine swapped it, word by word and bit for bit; an engine that registers
again names what it serves; an ack of an offer the previous run made is taken.

Before: the restarted daemon had no engine, so a ready target was ``done`` at once while the
engine still served the previous snapshot, which GC then collected (the engine reloaded whole
when it came back); and a re-registered engine was never offered the snapshot it already served
(it polls ``after`` it), so the replica stayed ``ready`` with one engine for good.
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
from support.api import http, wait_for  # noqa: E402
from support.swarm import Daemon, free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "engine"))
import tiny_llama  # noqa: E402

CHUNK = 64 << 10
IDS = [f"step{i:06d}" for i in range(1, 4)]
WORDS = ("words", "words-pingpong")  # a word-level swap: in place or ping-pong (the default)


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
        assert svc.engine.last_swap["changed_source"] in WORDS
        (before,) = engines()

        d.stop(signal.SIGTERM, timeout=60)
        assert d.proc is not None and d.proc.returncode == 0, d.log()
        d.start([])
        d.wait_healthy()
        # the restarted daemon knows the engine (same id, what it serves) before the engine polls again
        (after,) = engines()
        assert after["engine_id"] == before["engine_id"] and after["serving"] == IDS[1], after
        (rep,) = hot_load_status(d.url)
        assert rep["loading_state"]["stage"] == "done" and rep["engines"] == 1, rep
        # the next delta at once: the replica is done only once the engine swapped it, word by word
        # (its snapshot was kept: not collected while the engine had not polled yet)
        assert hot_load(d.url, IDS[2], previous=IDS[1])["accepted"] is True
        wait_for(lambda: done(IDS[2]), 180, f"{IDS[2]} done", detail=d.log)
        assert svc.engine.identity == IDS[2], "the replica said done while its engine served the previous snapshot"
        rep2 = svc.engine.last_swap
        assert rep2["mode"] == "partial" and rep2["changed_source"] in WORDS, rep2
        assert svc.engine.weights_digest() == digests(states[2])
    finally:
        if svc is not None:
            svc.stop()
        d.stop()


def _small_chain(tmp_path: Path) -> str:
    """A one-layer model as an anchor and two bdn_planes_v1 deltas; the bucket's URL."""
    bucket = f"file://{tmp_path}/bucket"
    _model, s = tiny_llama.make_tiny_llama(tmp_path / "ck1", hidden=32, layers=1, seed=7)
    publish_full(bucket, IDS[0], 1, dir=tmp_path / "ck1", chunk_size=CHUNK)
    for i in (1, 2):
        s = tiny_llama.optimizer_step(s, 0.02, seed=3 + i, tensors=1000)
        tiny_llama.save_state(tmp_path / f"ck{i + 1}", tmp_path / "ck1", s)
        publish_delta(
            bucket,
            IDS[i],
            i + 1,
            IDS[i - 1],
            dir=tmp_path / f"ck{i + 1}",
            base_dir=tmp_path / f"ck{i}",
            compression_format="bdn_planes_v1",
        )
    publish_startup(bucket, IDS[0])
    return bucket


def test_a_hot_load_accepted_before_sigterm_is_the_target_after_the_restart(tmp_path: Path) -> None:
    """A lone daemon (no peer to gossip the target back) stopped before its engine took the
    hot-load's snapshot: after the restart that snapshot is still the target and is offered."""
    d = Daemon(tmp_path / "nodes", "node0", _small_chain(tmp_path))
    d.start([])
    try:
        d.wait_healthy()
        d.wait_ready(IDS[0])
        status, reg = http("POST", d.url + "/v1/engines", {"name": "raw"})
        assert status == 201
        eid = reg["engine_id"]
        assert d.get(f"/v1/engines/{eid}/next?timeout=60")["identity"] == IDS[0]
        assert http("POST", f"{d.url}/v1/engines/{eid}/ack", {"identity": IDS[0], "pause_ms": 1.0})[0] == 200
        assert hot_load(d.url, IDS[2])["accepted"] is True  # (two deltas on: folded)
        d.wait_ready(IDS[2])  # (the engine has not polled: not offered yet)
        d.stop(signal.SIGTERM, timeout=60)
        assert d.proc is not None and d.proc.returncode == 0, d.log()
        d.start([])
        d.wait_healthy()
        offer = d.get(f"/v1/engines/{eid}/next?after={IDS[0]}&serving={IDS[0]}&timeout=60")
        assert offer["identity"] == IDS[2] and offer["changed_tensors_base"] == IDS[0], offer
        (rep,) = hot_load_status(d.url)
        assert rep["loading_state"]["identity"] == IDS[2] and rep["request_id"] is not None, rep
    finally:
        d.stop()


def test_an_offer_outstanding_at_sigterm_is_acked_to_the_restarted_daemon(tmp_path: Path) -> None:
    """An engine offered a snapshot when bdnd stops answers the restarted daemon under the same id
    (its ack, or, when the ack was lost while the daemon was down, its next poll saying what it
    serves); one that registers again naming what it serves is counted as serving it."""
    d = Daemon(tmp_path / "nodes", "node0", _small_chain(tmp_path))
    d.start([])
    try:
        d.wait_healthy()
        d.wait_ready(IDS[0])
        status, reg = http("POST", d.url + "/v1/engines", {"name": "raw"})
        assert status == 201
        eid = reg["engine_id"]
        offer = d.get(f"/v1/engines/{eid}/next?timeout=60")
        assert offer["identity"] == IDS[0]
        assert http("POST", f"{d.url}/v1/engines/{eid}/ack", {"identity": IDS[0], "pause_ms": 1.0})[0] == 200
        assert hot_load(d.url, IDS[1], previous=IDS[0])["accepted"] is True
        offer = d.get(f"/v1/engines/{eid}/next?after={IDS[0]}&timeout=60")
        assert offer["identity"] == IDS[1] and offer["changed_words"]["base"] == IDS[0]

        d.stop(signal.SIGTERM, timeout=60)
        assert d.proc is not None and d.proc.returncode == 0, d.log()
        d.start([])
        d.wait_healthy()
        status, ans = http("POST", f"{d.url}/v1/engines/{eid}/ack", {"identity": IDS[1], "pause_ms": 2.0})
        assert status == 200, (status, ans)
        (e,) = d.get("/v1/engines")["engines"]
        assert e["engine_id"] == eid and e["serving"] == IDS[1], e
        assert d.get("/v1/current")["identity"] == IDS[1]
        # the same with the ack lost while the daemon was down: the engine's next poll says what it serves
        assert hot_load(d.url, IDS[2], previous=IDS[1])["accepted"] is True
        offer = d.get(f"/v1/engines/{eid}/next?after={IDS[1]}&serving={IDS[1]}&timeout=60")
        assert offer["identity"] == IDS[2]
        d.stop(signal.SIGTERM, timeout=60)
        assert d.proc.returncode == 0, d.log()
        d.start([])
        d.wait_healthy()
        assert d.request("GET", f"/v1/engines/{eid}/next?after={IDS[2]}&serving={IDS[2]}&timeout=0")[0] == 204
        (e,) = d.get("/v1/engines")["engines"]
        assert e["serving"] == IDS[2] and e["offered"] == IDS[2], e
        (rep,) = hot_load_status(d.url)
        assert rep["loading_state"]["stage"] == "done", rep
        assert d.request("GET", f"/v1/engines/{eid}/next?serving=..&timeout=0")[0] == 400
        # an engine the daemon does not know registers naming what it serves: counted at once
        assert http("DELETE", f"{d.url}/v1/engines/{eid}")[0] == 200
        status, reg = http("POST", d.url + "/v1/engines", {"name": "again", "serving": IDS[1]})
        assert status == 201 and reg["serving"] == IDS[1], reg
        status, reg = http("POST", d.url + "/v1/engines", {"name": "bad", "serving": "../x"})
        assert status == 400, reg
    finally:
        d.stop()
