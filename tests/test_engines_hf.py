"""The Hugging Face transformers engine (bdn.engines.hf) hot-swapped by a real bdnd.

A tiny LlamaForCausalLM (about 0.8 MB in bf16, made with save_pretrained, no hub download) is
published as an anchor and two deltas; one real bdnd process serves it; the engine (HFEngine, its
OpenAI-compatible server on loopback and the hot-swap driver, in this process) goes 1 -> 2 -> 3
with one hot-load each. After every swap its parameters equal the trainer's bit for bit, every
answer reports the right policy version, and only the tensors the optimizer step changed were
copied, by the list of changed tensors in the daemon's offer. The hot-load request's prompt-cache
and in-flight policies reach the engine and show in answers and in the replica state. A snapshot
the engine cannot load is acked as the replica's error while policy 1 keeps serving. An engine
killed with -9 expires after engine_ttl_s and the replica is done with the engine that remains.
The ``current`` link and ``bdnctl path current`` follow the served snapshot. Stopping (SIGTERM
to the command, ``stop()`` in process) unregisters at once instead of waiting out the long-poll.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from bdn.engines.hf import torch_available

_why = torch_available()
if _why:
    pytest.skip(f"the transformers engine needs torch and transformers ({_why})", allow_module_level=True)

import torch  # noqa: E402
import xxhash  # noqa: E402

from bdn.cli import bdnctl  # noqa: E402
from bdn.client import hot_load, hot_load_status, open_snapshot  # noqa: E402
from bdn.client.fleet import list_engines  # noqa: E402
from bdn.engines import changed as changed_mod  # noqa: E402
from bdn.engines.hf import HFEngine  # noqa: E402
from bdn.engines.options import HotLoadOptions  # noqa: E402
from bdn.engines.service import HFService  # noqa: E402
from bdn.publish import publish_delta, publish_full, publish_startup  # noqa: E402
from support.api import http, wait_for  # noqa: E402
from support.swarm import Swarm, free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "engine"))
import tiny_llama  # noqa: E402

CHUNK = 64 << 10
IDS = ["step000001", "step000002", "step000003"]
PROMPT = [{"role": "user", "content": "Tell me about checkpoints."}]


def digests(state: dict[str, torch.Tensor]) -> dict[str, str]:
    return {
        k: xxhash.xxh3_128_hexdigest(v.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        for k, v in state.items()
    }


def replica_done(url: str, identity: str):
    reps = hot_load_status(url)
    errs = [r for r in reps if r["loading_state"]["stage"] == "error"]
    assert not errs, errs
    return (
        reps
        if all(r["current_snapshot_identity"] == identity and r["loading_state"]["stage"] == "done" for r in reps)
        else None
    )


def chat(url: str, **kw: Any) -> dict[str, Any]:
    status, ans = http(
        "POST",
        url + "/v1/chat/completions",
        {"messages": PROMPT, "max_tokens": 8, "temperature": 0, "top_logprobs": 3, **kw},
    )
    assert status == 200, ans
    return ans


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory):
    """The trainer's three checkpoints, published to a file:// bucket: anchor, delta, delta."""
    root = tmp_path_factory.mktemp("hf")
    bucket = f"file://{root}/bucket"
    d1 = root / "ck1"
    _model, s1 = tiny_llama.make_tiny_llama(d1, hidden=64, layers=2, seed=3)
    s2 = tiny_llama.optimizer_step(s1, 0.02, seed=11)
    s3 = tiny_llama.optimizer_step(s2, 0.02, seed=12)
    d2 = tiny_llama.save_state(root / "ck2", d1, s2)
    d3 = tiny_llama.save_state(root / "ck3", d1, s3)
    publish_full(bucket, IDS[0], 1, dir=d1, chunk_size=CHUNK)
    publish_delta(bucket, IDS[1], 2, IDS[0], dir=d2, base_dir=d1, chunk_size=CHUNK)
    publish_delta(bucket, IDS[2], 3, IDS[1], dir=d3, base_dir=d2, chunk_size=CHUNK)
    publish_startup(bucket, IDS[0])
    # A full snapshot transformers cannot load (unknown model_type), for the failed swap.
    bad = tiny_llama.save_state(root / "bad", d1, s2)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["model_type"] = "no_such_model_type"
    (bad / "config.json").write_text(json.dumps(cfg))
    publish_full(bucket, "broken000002", 2, dir=bad, chunk_size=CHUNK)
    return {"root": root, "bucket": bucket, "states": [s1, s2, s3], "dirs": [d1, d2, d3]}


@pytest.fixture
def node(trainer, tmp_path: Path):
    with Swarm(tmp_path / "nodes", 1, trainer["bucket"]) as swarm:
        yield swarm.daemons[0]


def test_hf_engine_goes_1_2_3_with_one_hot_load_each(trainer, node, capsys) -> None:
    states = trainer["states"]
    with HFService(node.url, "127.0.0.1", free_port(), replica_id="node0", poll_timeout=2.0) as svc:
        wait_for(lambda: replica_done(node.url, IDS[0]), 120, f"{IDS[0]} served")
        assert svc.engine.last_swap["mode"] == "load"
        answers = {}
        # Requests keep arriving during both hot-loads; each answer is checked against its policy below.
        during: list[dict] = []
        stop = threading.Event()

        def load() -> None:
            while not stop.is_set():
                during.append(chat(svc.url))

        loader = threading.Thread(target=load)
        loader.start()
        # step 2 with the defaults (RESET_ALL, wait, 30 s); step 3 preserves the prompt cache
        options = [{}, {}, {"prompt_cache_policy": "PRESERVE", "inflight_wait_s": 10}]
        for i, ident in enumerate(IDS):
            if i:
                ans = hot_load(node.url, ident, previous=IDS[i - 1], **options[i])
                assert ans["accepted"] is True
                reps = wait_for(lambda ident=ident: replica_done(node.url, ident), 120, f"{ident} served")
                report = svc.engine.last_swap
                # Only the tensors the optimizer step changed were copied, by the daemon's list.
                changed = sorted(
                    k
                    for k in states[i]
                    if not torch.equal(states[i][k].view(torch.int16), states[i - 1][k].view(torch.int16))
                )
                assert report["mode"] == "partial", report
                assert sorted(svc.engine.last_swap_tensors) == changed and len(changed) == 3
                assert report["tensors_copied"] == 3 and report["tensors_total"] == len(states[i])
                assert report["bytes_copied"] == sum(states[i][k].numel() * 2 for k in changed)
                assert report["changed_source"] == "offer"
                preserve = options[i].get("prompt_cache_policy") == "PRESERVE"
                assert report["prompt_cache"] == ("preserved" if preserve else "reset")
                assert report["inflight_policy"] == "wait"
                assert report["inflight_wait_s"] == options[i].get("inflight_wait_s", 30)
                rep = reps[0]
                assert rep["last_swap_pause_ms"] == pytest.approx(report["pause_ms"], abs=1e-3)
                # the replica reports the policies in force and the engine's swap report
                assert rep["prompt_cache_policy"] == ("PRESERVE" if preserve else "RESET_ALL")
                assert rep["inflight_policy"] == "wait" and rep["inflight_wait_s"] == report["inflight_wait_s"]
                last = rep["last_swap"]
                assert last["mode"] == "partial" and last["changed_source"] == "offer"
                assert last["tensors_copied"] == 3 and last["prompt_cache"] == report["prompt_cache"]
                (eng,) = list_engines(node.url)["engines"]
                assert eng["serving"] == ident and eng["swap"]["identity"] == ident
                assert eng["prompt_cache_policy"] == rep["prompt_cache_policy"]
            # the current link names the served snapshot; bdnctl path current resolves it
            shm_root = Path(node.wait_ready(ident)["path"]).parent
            assert os.readlink(shm_root / "current") == ident
            assert bdnctl.main(["--url", node.url, "path", "current"]) == 0
            assert capsys.readouterr().out.strip() == str(shm_root / ident)
            status, w = http("GET", svc.url + "/debug/weights")
            assert status == 200 and w["identity"] == ident and w["policy_version"] == i + 1
            assert w["tensors"] == digests(states[i]), f"{ident}: parameters differ from the trainer's"
            ans = chat(svc.url)
            ed = ans["nvext"]["engine_data"]
            assert ed["policy_version"] == i + 1 and ed["policy_versions"] == [i + 1]
            assert ed["snapshot_identity"] == ident and ed["replica_id"] == "node0"
            ch = ans["choices"][0]
            assert len(ch["token_ids"]) == len(ch["logprobs"]["content"]) > 0
            assert all(len(c["top_logprobs"]) == 3 and c["logprob"] <= 0 for c in ch["logprobs"]["content"])
            answers[ident] = ans
        stop.set()
        loader.join(60)
        # RESET_ALL at step 2: no answer of policy 2 reused a prefix policy 1 computed; PRESERVE
        # at step 3: the first answer of policy 3 reused the prefix policy 2 had cached.
        every = [*during, *answers.values()]
        cache_of = [
            (a["nvext"]["engine_data"]["policy_version"], a["nvext"]["engine_data"]["prompt_cache"]) for a in every
        ]
        assert not [c for v, c in cache_of if v == 2 and c["policy_version"] == 1]
        assert [c for v, c in cache_of if v == 3 and c["policy_version"] == 2 and c["cached_tokens"] > 0]
        # The same greedy request, answered by three policies, from one engine.
        lp = [a["choices"][0]["logprobs"]["content"][0]["logprob"] for a in answers.values()]
        assert len(set(lp)) == 3, lp
        # Every answer given while the engine swapped says which policy made it, and it did.
        assert len(during) > 3
        for a in during:
            ed = a["nvext"]["engine_data"]
            assert len(ed["policy_versions"]) == 1 and ed["policy_version"] == ed["policy_versions"][0]
            got = a["choices"][0]["logprobs"]["content"][0]["logprob"]
            nearest = min(range(3), key=lambda v: abs(lp[v] - got))
            assert nearest + 1 == ed["policy_version"] and ed["snapshot_identity"] == IDS[nearest], (ed, got, lp)


def test_a_failed_swap_is_acked_and_the_old_policy_keeps_serving(trainer, node) -> None:
    with HFService(node.url, "127.0.0.1", free_port(), replica_id="node0", poll_timeout=2.0) as svc:
        wait_for(lambda: replica_done(node.url, IDS[0]), 120, f"{IDS[0]} served")
        before = chat(svc.url)
        hot_load(node.url, "broken000002")

        def errored():
            reps = hot_load_status(node.url)
            return reps if reps[0]["loading_state"]["stage"] == "error" else None

        reps = wait_for(errored, 120, "the replica to report the failed swap")
        reason = reps[0]["loading_state"]["reason"]
        assert "no_such_model_type" in reason and "EngineError" in reason, reason
        assert reps[0]["current_snapshot_identity"] == IDS[0]
        after = chat(svc.url)
        assert after["nvext"]["engine_data"]["policy_version"] == 1
        assert after["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]
        status, w = http("GET", svc.url + "/debug/weights")
        assert w["tensors"] == digests(trainer["states"][0])


def test_prompt_cache_policy_and_changed_tensors_from_the_offer(trainer, node) -> None:
    """PRESERVE keeps prefixes computed by the old policy (visible in answers); RESET_ALL drops them.

    Snapshots are the ones bdnd rebuilt; the offers are what the daemon will send once it
    forwards the hot-load options (docs/ENGINES.md, "What the daemon is asked to send").
    """
    for ident in IDS:
        node.prefetch(ident)
        node.wait_ready(ident)
    base = Path(node.wait_ready(IDS[0])["path"]).parent
    snaps = [open_snapshot(base / i) for i in IDS]
    engine = HFEngine()
    try:
        engine.swap(engine.prepare(snaps[0], {}, HotLoadOptions()))
        prompt = engine.encode_chat(PROMPT)

        def gen():
            with engine.gate.admit() as t:
                return engine.generate(t, prompt, 4, temperature=0)

        first = gen()
        assert first.cached_tokens == 0 and first.policy_versions == [1]
        assert gen().cached_tokens == len(prompt) - 1  # the prompt cache works within a policy

        opts = HotLoadOptions.from_offer({"prompt_cache_policy": "PRESERVE"})
        prep = engine.prepare(snaps[1], {}, opts)
        rep = engine.swap(prep)
        assert rep["prompt_cache"] == "preserved" and rep["prompt_cache_entries_dropped"] == 0
        g = gen()
        assert g.policy_versions == [2] and g.cached_tokens == len(prompt) - 1 and g.cache_policy_version == 1

        # The daemon's list of changed tensors, relative to the snapshot served, is used as is.
        names = ["model.layers.0.mlp.up_proj.weight"]
        offer = {"changed_tensors": names, "changed_tensors_base": IDS[1], "prompt_cache_policy": "RESET_ALL"}
        prep = engine.prepare(snaps[2], offer, HotLoadOptions.from_offer(offer))
        assert prep.mode == "partial" and prep.changed_source == "offer" and list(prep.tensors) == names
        rep = engine.swap(prep)
        assert rep["prompt_cache"] == "reset" and rep["prompt_cache_entries_dropped"] >= 1
        g = gen()
        assert g.policy_versions == [3] and g.cached_tokens == 0 and g.cache_policy_version is None
        # A list relative to another snapshot is not trusted: the engine compares instead.
        stale = {"changed_tensors": names, "changed_tensors_base": IDS[0]}
        assert engine.prepare(snaps[1], stale, HotLoadOptions()).changed_source == "compared"
        with pytest.raises(Exception, match="not in"):
            engine.prepare(snaps[1], {"changed_tensors": ["nope"], "changed_tensors_base": IDS[2]}, HotLoadOptions())
    finally:
        for s in snaps:
            s.close()


def test_inflight_policies_on_a_generating_request(trainer, node) -> None:
    """keep: a long request continues across the swap and reports both policies; abort: it ends."""
    node.prefetch(IDS[1])
    base = Path(node.wait_ready(IDS[1])["path"]).parent
    snaps = [open_snapshot(base / i) for i in IDS[:2]]
    engine = HFEngine()
    try:
        engine.swap(engine.prepare(snaps[0], {}, HotLoadOptions()))
        prompt = engine.encode_chat(PROMPT)
        for policy in ("keep", "abort"):
            target = snaps[1] if engine.identity == IDS[0] else snaps[0]
            started, result = threading.Event(), {}

            def long_request(started=started, result=result):
                with engine.gate.admit() as t:
                    started.set()
                    result["g"] = engine.generate(t, prompt, 400, temperature=1.0, seed=1, stop_ids=set())

            th = threading.Thread(target=long_request)
            th.start()
            started.wait(120)
            wait_for(lambda: engine.gate.in_flight == 1, 120, "the request to run")
            old_v = engine.policy_version
            rep = engine.swap(engine.prepare(target, {}, HotLoadOptions(inflight_policy=policy)))
            th.join(120)
            g = result["g"]
            if policy == "keep":
                assert rep["kept"] == 1 and rep["aborted"] == 0
                if g.finish_reason == "length" and len(g.policy_versions) == 2:
                    assert g.policy_versions == [old_v, target.policy_version]
                else:  # the request finished before the swap got in: still exactly one policy
                    assert g.policy_versions == [old_v]
            else:
                assert rep["aborted"] == 1 and g.finish_reason == "abort" and g.policy_versions == [old_v]
                assert len(g.token_ids) < 400
    finally:
        for s in snaps:
            s.close()


def test_full_reload_copies_every_tensor_in_place(trainer, node) -> None:
    """partial=False: the comparison point for the pause; the result is the same bits."""
    node.prefetch(IDS[1])
    base = Path(node.wait_ready(IDS[1])["path"]).parent
    snaps = [open_snapshot(base / i) for i in IDS[:2]]
    engine = HFEngine(partial=False)
    try:
        engine.swap(engine.prepare(snaps[0], {}, HotLoadOptions()))
        rep = engine.swap(engine.prepare(snaps[1], {}, HotLoadOptions()))
        assert rep["mode"] == "full" and rep["tensors_copied"] == rep["tensors_total"] == len(trainer["states"][1])
        assert engine.weights_digest() == digests(trainer["states"][1])
    finally:
        for s in snaps:
            s.close()


@pytest.mark.parametrize("method", ["rebind", "copy"])
def test_both_swap_methods_serve_the_target_bit_for_bit(trainer, node, method: str) -> None:
    """The model itself (its own state dict and its logits, not only the engine's table) holds the
    target after a partial swap, whether parameters are rebound to the staged tensors or copied."""
    node.prefetch(IDS[1])
    base = Path(node.wait_ready(IDS[1])["path"]).parent
    snaps = [open_snapshot(base / i) for i in IDS[:2]]
    engine, fresh = HFEngine(swap_method=method), HFEngine()
    try:
        engine.swap(engine.prepare(snaps[0], {}, HotLoadOptions()))
        rep = engine.swap(engine.prepare(snaps[1], {}, HotLoadOptions()))
        assert rep["mode"] == "partial" and rep["swap_method"] == method and rep["tensors_copied"] == 3
        model_state = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
        assert digests(model_state) == digests(trainer["states"][1]) == engine.weights_digest()
        fresh.swap(fresh.prepare(snaps[1], {}, HotLoadOptions()))
        ids = torch.tensor([[1, 2, 3, 4, 5]])
        with torch.no_grad():
            assert torch.equal(engine.model(input_ids=ids).logits, fresh.model(input_ids=ids).logits)
    finally:
        for s in snaps:
            s.close()


def byte_ranges(a: torch.Tensor, b: torch.Tensor) -> list[list[int]]:
    """The half-open byte ranges where two tensors' bytes differ, from the tensor's first byte."""
    x = a.contiguous().reshape(-1).view(torch.uint8).numpy()
    y = b.contiguous().reshape(-1).view(torch.uint8).numpy()
    diff = (x != y).nonzero()[0].tolist()
    out: list[list[int]] = []
    for i in diff:
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return out


def test_partial_swap_reads_only_the_offers_changed_byte_ranges(trainer, node) -> None:
    """With changed_ranges in the offer, the engine reads only those bytes of the snapshot (the rest
    of each staged tensor is the served parameter) and serves the target bit for bit; a range
    outside a tensor fails the prepare with one line and the old policy keeps serving."""
    node.prefetch(IDS[1])
    base = Path(node.wait_ready(IDS[1])["path"]).parent
    snaps = [open_snapshot(base / i) for i in IDS[:2]]
    s1, s2 = trainer["states"][:2]
    changed = [k for k in s2 if not torch.equal(s1[k].view(torch.uint8), s2[k].view(torch.uint8))]
    infos = changed_mod.tensor_infos(snaps[1])  # the offer's ranges are absolute offsets in the file
    ranges = {k: [[a + infos[k].start, b + infos[k].start] for a, b in byte_ranges(s1[k], s2[k])] for k in changed}
    offer = {"changed_tensors": changed, "changed_tensors_base": IDS[0], "changed_ranges": ranges}
    engine = HFEngine()
    try:
        engine.swap(engine.prepare(snaps[0], {}, HotLoadOptions()))
        bad = dict(offer, changed_ranges={changed[0]: [[0, 1 << 40]]})
        with pytest.raises(Exception, match="outside its bytes"):
            engine.prepare(snaps[1], bad, HotLoadOptions())
        assert engine.weights_digest() == digests(s1)
        rep = engine.swap(engine.prepare(snaps[1], offer, HotLoadOptions()))
        assert rep["mode"] == "partial" and rep["changed_source"] == "offer"
        assert rep["tensors_copied"] == len(changed) == rep["tensors_by_ranges"]
        assert rep["bytes_copied"] == sum(e - s for spans in ranges.values() for s, e in spans)
        assert rep["bytes_copied"] < sum(s2[k].numel() * s2[k].element_size() for k in changed) / 10
        assert engine.weights_digest() == digests(s2)
    finally:
        for s in snaps:
            s.close()


def test_the_command_serves_and_stops_on_sigterm(trainer, node, tmp_path: Path) -> None:
    """``python -m bdn.engines hf`` as a process: registers, serves policy 1, exits 0 on SIGTERM
    without waiting out its long-poll to bdnd: it unregisters, which ends the poll at once; and
    once stopped the process ends without the interpreter's teardown (with torch loaded that took
    4-14 s on a loaded machine): here a teardown that would never end (an exit handler that sleeps
    an hour, from a ``sitecustomize`` on the engine's path) does not hold it."""
    port = free_port()
    out = tmp_path / "engine.log"
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import atexit, time\natexit.register(time.sleep, 3600)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p))
    with out.open("wb") as f:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bdn.engines",
                "hf",
                "--bdn-url",
                node.url,
                "--listen",
                f"127.0.0.1:{port}",
                "--replica-id",
                "node0",
                "--log-level",
                "info",
            ],
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    try:

        def healthy():
            assert proc.poll() is None, out.read_text(errors="replace")
            if not _listening(port):
                return None
            try:
                status, body = http("GET", f"http://127.0.0.1:{port}/health", timeout=60)
            except OSError:  # listening but too starved to answer yet (load 40+): ask again, a state, not a window
                return None
            return body if status == 200 else None

        # /health answers while the first load still runs (identity None): wait for the load
        body = wait_for(
            healthy, 600, "the engine to serve step 1", until=lambda b: b is not None and b.get("identity") is not None
        )
        assert body["identity"] == IDS[0] and body["policy_version"] == 1
        wait_for(lambda: replica_done(node.url, IDS[0]), 120, "the replica done")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0, out.read_text(errors="replace")
        log = out.read_text(errors="replace")
        # what the shutdown did, in order: the signal, the DELETE (which ended the long-poll), done
        stopping = [ln for ln in log.splitlines() if "stopping" in ln or "unregistered" in ln or "stopped in" in ln]
        print("\n".join(stopping))
        assert all(k in log for k in ("SIGTERM: stopping", "unregistered engine", "stopped in")), log
        assert log.index("SIGTERM: stopping") < log.index("unregistered engine") < log.index("stopped in")
        # at --log-level info: the engine's own lines, not httpx's line per request to bdnd
        assert "bdn.client.engine: registered with" in log and "bdn.engines.driver: serving step000001" in log, log
        assert "httpx" not in log and "HTTP Request:" not in log, log
        # the swap in plain words, its pause as the other lines give durations: "paused 0.19 ms"
        assert re.search(
            r"serving step000001 \(policy version 1\): loaded a new model object \(first load, \d+ tensors\), "
            r"paused \d+\.\d\d ms$",
            log,
            re.M,
        ), log
        # it unregistered on the way out (the fleet view follows the replica's report: a state)
        wait_for(lambda: hot_load_status(node.url)[0]["engines"] == 0, 120, "the replica to list no engine")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_stop_does_not_wait_out_the_long_poll(trainer, node) -> None:
    """An engine idle in a long-poll of 300 s (the daemon's cap) stops at once: ``stop()``
    unregisters, the daemon answers the poll, the driver thread ends; it does not register again."""
    svc = HFService(node.url, "127.0.0.1", free_port(), replica_id="node0", poll_timeout=300.0).start()
    stopped = threading.Event()
    try:
        wait_for(lambda: replica_done(node.url, IDS[0]) and svc.engine.identity == IDS[0], 120, f"{IDS[0]} served")
        wait_for(lambda: list_engines(node.url)["engines"][0]["serving"] == IDS[0], 120, "the ack")
        assert svc._driver is not None
        wait_for(svc._driver.polling.is_set, 120, "the driver to wait for the next offer")
        threading.Thread(target=lambda: (svc.stop(), stopped.set()), daemon=True).start()
        # generous, and far below the 300 s the poll would have held the stop
        assert stopped.wait(60), "stop() waited for the long-poll"
        assert not svc._driver.is_alive()
        assert list_engines(node.url)["engines"] == []
    finally:
        if not stopped.is_set():  # failed: do not wait out the poll here (the node's teardown ends it)
            svc.stop_event.set()
            svc.http.stop()


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _engine_process(bdn_url: str, port: int, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bdn.engines",
            "hf",
            "--bdn-url",
            bdn_url,
            "--listen",
            f"127.0.0.1:{port}",
            "--replica-id",
            "node0",
            "--name",
            "doomed",
            "--log-level",
            "warning",
        ],
        env=dict(os.environ),
        stdout=subprocess.DEVNULL,
        stderr=log.open("wb"),  # a slow or failed start leaves its reason
    )


@pytest.mark.timeout(1800)  # its waits (900 s for two engines to start at load) outlast the 300 s default
def test_an_engine_killed_without_unregistering_expires(trainer, tmp_path: Path, capsys) -> None:
    """Two engines serve policy 1; one is killed with -9 (no DELETE). After engine_ttl_s the daemon
    drops it (its leases released) and the hot-load to policy 2 completes with the other."""
    with Swarm(tmp_path / "nodes", 1, trainer["bucket"], extra_env={"BDN_ENGINE_TTL_S": "3"}) as swarm:
        node = swarm.daemons[0]
        with HFService(
            node.url, "127.0.0.1", free_port(), replica_id="node0", name="survivor", poll_timeout=2.0
        ) as svc:
            doomed_log = tmp_path / "doomed.log"
            doomed = _engine_process(node.url, free_port(), doomed_log)
            try:

                def both_serve():
                    eng = list_engines(node.url)["engines"]
                    return eng if len(eng) == 2 and all(e["serving"] == IDS[0] for e in eng) else None

                wait_for(
                    both_serve,
                    900,
                    "both engines to serve policy 1",
                    detail=lambda: doomed_log.read_text(errors="replace")[-2000:],
                )
                assert bdnctl.main(["--url", node.url, "engines"]) == 0
                table = capsys.readouterr().out
                assert "doomed" in table and "survivor" in table and "SEEN_S_AGO" in table
                doomed.send_signal(signal.SIGKILL)
                doomed.wait(120)
                hot_load(node.url, IDS[1], previous=IDS[0])
                reps = wait_for(lambda: replica_done(node.url, IDS[1]), 600, "the replica done without the dead engine")
                assert reps[0]["engines"] == 1
                (eng,) = list_engines(node.url)["engines"]
                assert eng["name"] == "survivor" and eng["serving"] == IDS[1]
                assert svc.engine.identity == IDS[1]
                assert "not seen for over 3 s: dropped" in node.log_path.read_text()
            finally:
                if doomed.poll() is None:
                    doomed.kill()
                    doomed.wait()


def test_hot_load_options_are_validated_and_wait_has_a_deadline(trainer, node, capsys) -> None:
    status, ans = http(
        "POST", node.url + "/hot_load/v1/models/hot_load", {"identity": IDS[1], "inflight_policy": "drain"}
    )
    assert status == 400 and "inflight_policy" in ans["error"] and "\n" not in ans["error"]
    status, ans = http("POST", node.url + "/hot_load/v1/models/hot_load", {"identity": IDS[1], "inflight_wait_s": -1})
    assert status == 400 and "inflight_wait_s" in ans["error"]
    # the startup snapshot is ready first: a later hot-load would cancel its load (superseded)
    node.wait_ready(IDS[0])
    # files without a manifest: accepted, never ready; --wait gives up at its deadline with exit 1
    pending = Path(trainer["root"]) / "bucket" / "pending000009"
    pending.mkdir(parents=True, exist_ok=True)
    (pending / "config.json").write_text("{}")
    code = bdnctl.main(["--url", node.url, "hot-load", "pending000009", "--wait", "--timeout", "2"])
    err = capsys.readouterr().err
    assert code == 1 and "not done after 2 s" in err, err
    assert bdnctl._parser().parse_args(["hot-load", "x", "--wait"]).timeout == 600.0
    # `path IDENTITY` names a ready snapshot's directory
    assert bdnctl.main(["--url", node.url, "path", IDS[0]]) == 0
    assert capsys.readouterr().out.strip().endswith(IDS[0])
