"""Make the benchmark's snapshot: a Hugging Face directory of bf16 safetensors shards.

The values are bf16 normals (the top 16 bits of float32 normals), so the bytes look like real
weights to anything that might compress them. Generated once per size and cached.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from bdn.fileops import save_raw
from bdn.proto.chunks import digest as xxh3_digest

TENSOR_SHAPE = (4096, 2048)  # 16 MiB of bf16 per tensor
TENSOR_BYTES = TENSOR_SHAPE[0] * TENSOR_SHAPE[1] * 2
TENSORS_PER_SHARD = 16  # 256 MiB shards
CHUNK = 16 * 1024 * 1024


def make_snapshot(root: Path, total_bytes: int, seed: int = 1) -> Path:
    """Write (or reuse) a snapshot of about ``total_bytes`` under ``root/snap-<MiB>``; return it."""
    n_tensors = max(1, round(total_bytes / TENSOR_BYTES))
    d = root / f"snap-{n_tensors * TENSOR_BYTES // 2**20}MiB"
    done = d / ".complete"
    if done.exists():
        return d
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    n_shards = -(-n_tensors // TENSORS_PER_SHARD)
    weight_map: dict[str, str] = {}
    t = 0
    for s in range(n_shards):
        name = f"model-{s + 1:05d}-of-{n_shards:05d}.safetensors"
        tensors = {}
        for _ in range(min(TENSORS_PER_SHARD, n_tensors - t)):
            f32 = rng.standard_normal(TENSOR_SHAPE[0] * TENSOR_SHAPE[1], dtype=np.float32) * 0.02
            bf16 = (f32.view(np.uint32) >> 16).astype(np.uint16)
            tname = f"model.layers.{t // 4}.mlp.w{t % 4}.weight"
            tensors[tname] = ("BF16", TENSOR_SHAPE, bf16)
            weight_map[tname] = name
            t += 1
        save_raw(d / name, tensors, {"format": "pt"})
    total = sum(p.stat().st_size for p in d.glob("*.safetensors"))
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )
    (d / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "torch_dtype": "bfloat16",
                "hidden_size": 2048,
                "intermediate_size": 4096,
                "num_hidden_layers": -(-n_tensors // 4),
            }
        )
    )
    done.write_text("ok\n")
    return d


def snapshot_files(d: Path) -> list[Path]:
    """The snapshot's files (relative order fixed), without the cache marker."""
    return sorted(p for p in d.iterdir() if p.is_file() and not p.name.startswith("."))


def chunk_digests(path: Path, chunk: int = CHUNK) -> list[str]:
    """xxh3-128 hex of each ``chunk``-byte range of ``path`` (the manifest's chunk digests)."""
    out = []
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            out.append(xxh3_digest(b))
    return out


def digest_table(d: Path) -> dict[str, list[str]]:
    """{relative path: chunk digests} for every file of the snapshot (what nodes verify against)."""
    return {p.name: chunk_digests(p) for p in snapshot_files(d)}


def snapshot_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in snapshot_files(d))


if __name__ == "__main__":
    import sys

    p = make_snapshot(Path(sys.argv[1]), int(float(sys.argv[2]) * 2**30))
    print(p, snapshot_bytes(p), os.listdir(p))
