"""Trainer ranks for the sharded-publish tests: a layered bf16 model every rank regenerates from a
seed, which layers each of ``world`` ranks owns, and a rank as a real process
(``python tests/support/ranks.py URL IDENTITY RANK WORLD [BASE]``): it calls
``bdn.publish.publish_part`` with its tensors of step ``IDENTITY`` (anchor = policy version 1,
each later step one optimizer step on the one before) and exits 0, or 1 printing the error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from support.checkpoints import BF16, optimizer_step

LAYERS = 4
CHUNK = 16 << 10


def model(version: int) -> dict[str, np.ndarray]:
    """Policy version ``version`` (1 = the anchor) of a 4-layer bf16 model, same on every call."""
    rng = np.random.default_rng(7)
    d = 48
    st: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": rng.normal(0, 0.02, (300, d)).astype(BF16),
        "model.norm.weight": np.ones(d, dtype=np.float32),
    }
    for i in range(LAYERS):
        st[f"model.layers.{i}.self_attn.qkv_proj.weight"] = rng.normal(0, 0.02, (3 * d, d)).astype(BF16)
        st[f"model.layers.{i}.mlp.up_proj.weight"] = rng.normal(0, 0.02, (4 * d, d)).astype(BF16)
        st[f"model.layers.{i}.input_layernorm.weight"] = np.ones(d, dtype=np.float32)
    for v in range(2, version + 1):
        st = optimizer_step(st, 0.05, v)
    return st


def owner(name: str, world: int) -> int:
    """The rank owning ``name``: layer ``i`` -> rank ``i % world``, the rest -> the last rank."""
    parts = name.split(".")
    return int(parts[2]) % world if parts[1] == "layers" else world - 1


def owned(state: dict[str, np.ndarray], rank: int, world: int) -> dict[str, np.ndarray]:
    """The tensors of ``state`` that ``rank`` of ``world`` owns."""
    return {n: a for n, a in state.items() if owner(n, world) == rank}


def run_ranks(
    url: str, identity: str, version: int, world: int, base: str | None = None
) -> list[subprocess.Popen[str]]:
    """Start ``world`` rank processes publishing their parts of ``identity`` (policy ``version``)."""
    args = [str(version)] + ([base] if base else [])
    return [
        subprocess.Popen(
            [sys.executable, __file__, url, identity, str(r), str(world), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]


def main(argv: list[str]) -> int:
    from bdn.publish import publish_part

    url, identity, rank, world, version = argv[0], argv[1], int(argv[2]), int(argv[3]), int(argv[4])
    base = argv[5] if len(argv) > 5 else None
    mine = owned(model(version), rank, world)
    base_tensors = owned(model(version - 1), rank, world) if base else None
    try:
        publish_part(
            url,
            identity,
            mine,
            rank=rank,
            world_size=world,
            base=base,
            base_tensors=base_tensors,
            chunk_size=CHUNK,
            workers=2,
        )
    except Exception as e:  # noqa: BLE001 - any error: the test reads the line
        print(f"rank {rank}: {type(e).__name__}: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
