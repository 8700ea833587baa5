"""One trainer rank of bench/publish, a process of its own driven over stdin/stdout (JSON lines).

Commands (one JSON object per line; the answer is one JSON line):

* ``{"op": "init", "url", "endpoint", "rank", "world", "gib", "layers"}``: build this rank's
  tensors of the bench model (:func:`model_shapes`; rank ``r`` owns layers ``i % world == r`` and
  the last rank the rest), untimed.
* ``{"op": "target", "frac"}``: a target step: a copy of the anchor tensors with ``frac`` of the
  bf16 values moved by 1-3 ulps (positions drawn with replacement), untimed.
* ``{"op": "floor", "identity", "share"}``: upload ``share`` of this rank's anchor files' bytes as they are (no
  digest, no encoding) through ``Bucket.write_buffers``, ``uploads`` files at a time, as the
  publish does: the bucket's bandwidth in this run.
* ``{"op": "memfloor"}``: the least any delta publish of this rank does: read the anchor and the
  last target once, XORing them piece by piece (1 MiB) on every core into a reused buffer: the
  memory floor of this run (seconds).
* ``{"op": "anchor"|"delta", "identity", "base"?}``: ``publish_part`` of the anchor or of the
  last target against the anchor; answers its stats (seconds, bytes).
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ml_dtypes
import numpy as np

from bdn.bucket import open_bucket
from bdn.proto import planes_scan
from bdn.proto.safetensors_fmt import encode_raw, raw_tensors
from bdn.publish import publish_part
from bdn.publish.layout import group, layer_file
from bdn.publish.memfile import METADATA

BF16 = ml_dtypes.bfloat16
UPLOADS = 2
CHUNK = 16 << 20


def model_shapes(gib: float, layers: int) -> dict[str, tuple[int, ...]]:
    """A Llama-like bf16 stack of ``layers`` layers (4 square d x d matrices each, d = 4096 scaled
    down for small sizes) plus an embedding of 1/16 of the model: about ``gib`` GiB."""
    per_layer = gib * (1 << 30) * 15 / 16 / layers / 2  # bf16 values per layer
    d = int((per_layer / 4) ** 0.5) // 64 * 64
    shapes = {
        f"model.layers.{i}.{m}.weight": (d, d)
        for i in range(layers)
        for m in ("self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj")
    }
    shapes["model.embed_tokens.weight"] = (int(gib * (1 << 30) / 16 / 2 / d), d)
    shapes["model.norm.weight"] = (d,)
    return shapes


def owner(name: str, world: int, layers: int) -> int:
    """Layer ``i`` -> rank ``i % world``; the rest -> the last rank."""
    f = layer_file(name)
    return int(f.split(".")[2]) % world if f.startswith("model.layers.") else world - 1


def tensor(name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Weight-like bf16 bit patterns (random sign and mantissa, exponents of |w| ~ 1e-3..0.06)."""
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    n = int(np.prod(shape))
    bits = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    bits &= 0x807F
    bits |= (rng.integers(0, 6, n, dtype=np.uint16) + 0x75) << 7
    return bits.view(BF16).reshape(shape)


def moved(a: np.ndarray, frac: float, rng: np.random.Generator) -> np.ndarray:
    """A copy of ``a`` with ``frac`` of its values moved by 1-3 ulps (indices drawn with replacement)."""
    out = a.copy()
    flat = out.reshape(-1).view(np.uint16)
    k = round(frac * flat.size)
    idx = rng.integers(0, flat.size, k)
    flat[idx] ^= rng.integers(1, 4, k, dtype=np.uint16)
    return out


def read_floor(base: dict[str, np.ndarray], target: dict[str, np.ndarray], threads: int) -> float:
    """Seconds to read ``base`` and ``target`` once: XOR of 1 MiB pieces into a per-thread buffer, on ``threads`` threads."""
    piece = 1 << 20
    pairs = [(base[n].reshape(-1).view(np.uint8), target[n].reshape(-1).view(np.uint8)) for n in base]
    tasks = [(b[i : i + piece], t[i : i + piece]) for b, t in pairs for i in range(0, len(b), piece)]
    local = threading.local()

    def one(task: tuple[np.ndarray, np.ndarray]) -> None:
        out = getattr(local, "out", None)
        if out is None:
            out = local.out = np.empty(piece, dtype=np.uint8)
        np.bitwise_xor(task[0], task[1], out=out[: len(task[0])])

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, tasks, chunksize=16))
    return time.perf_counter() - t0


class Rank:
    """A rank's state between commands."""

    def __init__(self, msg: dict[str, Any]) -> None:
        self.rank, self.world = msg["rank"], msg["world"]
        self.bucket = open_bucket(msg["url"], endpoint_url=msg.get("endpoint"))
        shapes = model_shapes(msg["gib"], msg["layers"])
        self.anchor = {n: tensor(n, s) for n, s in shapes.items() if owner(n, self.world, msg["layers"]) == self.rank}
        self.target: dict[str, np.ndarray] = {}
        # A trainer process loads the encoder's kernel once (numba's import and cached compile);
        # the steps measured here are its steady state.
        self.kernel = planes_scan.warm()

    def run(self, msg: dict[str, Any]) -> dict[str, Any]:
        op = msg["op"]
        if op == "target":
            rng = np.random.default_rng(self.rank)
            self.target = {n: moved(a, msg["frac"], rng) for n, a in self.anchor.items()}
            return {}
        if op == "memfloor":
            return {"seconds": read_floor(self.anchor, self.target, os.cpu_count() or 1)}
        t0 = time.perf_counter()
        if op == "floor":
            files = group(self.anchor, layer_file)
            # A share of the files is enough to measure the bucket's bandwidth (moto takes ~1 min per GiB).
            files = dict(list(files.items())[: max(1, math.ceil(len(files) * msg.get("share", 1.0)))])

            def up(item: tuple[str, dict[str, np.ndarray]]) -> int:
                prefix, parts = encode_raw(raw_tensors(item[1]), METADATA)
                self.bucket.write_buffers(f"{msg['identity']}/{item[0]}", [prefix, *parts])
                return len(prefix) + sum(p.nbytes for p in parts)

            with ThreadPoolExecutor(UPLOADS) as pool:
                n = sum(pool.map(up, files.items()))
            return {"seconds": time.perf_counter() - t0, "stored_bytes": n}
        stats: dict[str, float] = {}
        if op == "anchor":
            publish_part(
                self.bucket,
                msg["identity"],
                self.anchor,
                rank=self.rank,
                world_size=self.world,
                chunk_size=CHUNK,
                uploads=UPLOADS,
                stats=stats,
            )
        else:
            publish_part(
                self.bucket,
                msg["identity"],
                self.target,
                rank=self.rank,
                world_size=self.world,
                base=msg["base"],
                base_tensors=self.anchor,
                chunk_size=CHUNK,
                uploads=UPLOADS,
                stats=stats,
                compression_format=msg.get("format", "bdn_planes_v1"),
            )
        return {"seconds": time.perf_counter() - t0, **stats}


def main() -> None:
    rank: Rank | None = None
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["op"] == "init":
            rank = Rank(msg)
            out: dict[str, Any] = {"bytes": sum(a.nbytes for a in rank.anchor.values()), "kernel": rank.kernel}
        else:
            assert rank is not None
            out = rank.run(msg)
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
