"""Real Hugging Face checkpoint directories for tests: bf16 safetensors shards plus config files."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np

from bdn.bucket import open_bucket
from bdn.fileops import save
from bdn.proto.manifest import Manifest
from bdn.publish import publish_full

BF16 = ml_dtypes.bfloat16


def make_state(seed: int = 0, scale: int = 1) -> dict[str, np.ndarray]:
    """A small transformer-shaped state dict (bf16 matrices, an f32 norm, an int64 buffer)."""
    rng = np.random.default_rng(seed)
    d = 64 * scale
    st: dict[str, np.ndarray] = {
        "embed.weight": rng.normal(0, 0.02, (500, d)).astype(BF16),
        "layers.0.attn.qkv.weight": rng.normal(0, 0.02, (3 * d, d)).astype(BF16),
        "layers.0.mlp.up.weight": rng.normal(0, 0.02, (4 * d, d)).astype(BF16),
        "layers.0.mlp.down.weight": rng.normal(0, 0.02, (d, 4 * d)).astype(BF16),
        "layers.0.norm.weight": np.ones(d, dtype=np.float32),
        "layers.1.attn.qkv.weight": rng.normal(0, 0.02, (3 * d, d)).astype(BF16),
        "layers.1.mlp.up.weight": rng.normal(0, 0.02, (4 * d, d)).astype(BF16),
        "position_ids": np.arange(128, dtype=np.int64),
    }
    return st


def optimizer_step(state: dict[str, np.ndarray], frac: float = 0.02, seed: int = 1) -> dict[str, np.ndarray]:
    """A simulated RL step: about ``frac`` of the floating-point values change."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, arr in state.items():
        if arr.dtype.kind not in "fV" and arr.dtype != BF16:
            out[name] = arr.copy()
            continue
        w = arr.astype(np.float32)
        mask = rng.random(w.shape) < frac
        w[mask] += rng.normal(0, 1, int(mask.sum())).astype(np.float32) * (np.abs(w[mask]) * 0.05 + 1e-3)
        out[name] = w.astype(arr.dtype)
    return out


SHARDS = {
    "model-00001-of-00002.safetensors": (
        "embed.weight",
        "layers.0.attn.qkv.weight",
        "layers.0.mlp.up.weight",
        "layers.0.mlp.down.weight",
        "layers.0.norm.weight",
    ),
    "model-00002-of-00002.safetensors": ("layers.1.attn.qkv.weight", "layers.1.mlp.up.weight", "position_ids"),
}


def write_hf_dir(path: Path, state: dict[str, np.ndarray], step: int = 0) -> Path:
    """Write ``state`` as a two-shard Hugging Face directory (config, tokenizer, index)."""
    path.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for shard, names in SHARDS.items():
        save(path / shard, {n: state[n] for n in names}, {"format": "pt"})
        weight_map.update({n: shard for n in names})
    total = sum(a.nbytes for a in state.values())
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    (path / "config.json").write_text(json.dumps({"model_type": "toy", "hidden_size": 64, "step": step}))
    (path / "tokenizer.json").write_text(json.dumps({"version": "1.0", "vocab": {f"t{i}": i for i in range(300)}}))
    return path


def publish_state(
    root: Path, bucket: str, identity: str, version: int, *, scale: int, chunk_size: int, endpoint: str | None = None
) -> tuple[Manifest, Path]:
    """``make_state(version, scale)`` written as ``root/trainer/<identity>`` and published to
    ``bucket`` (S3 at ``endpoint``, or file://) as full snapshot ``identity`` at policy version
    ``version``; the manifest and the trainer's directory."""
    ck = write_hf_dir(root / "trainer" / identity, make_state(version, scale=scale), version)
    b = open_bucket(bucket, endpoint_url=endpoint)
    try:
        return publish_full(b, identity, version, dir=ck, chunk_size=chunk_size), ck
    finally:
        b.close()


def flip_byte(path: Path, offset: int, mask: int = 0xFF) -> None:
    """XOR the byte at ``offset`` of the file at ``path`` with ``mask``, in place (bit rot, a bad
    write). As root it writes through a 0444 file, as an engine's mistake would not."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))
