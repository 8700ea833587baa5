"""A trainer that publishes without bdn-publish, for the foreign-snapshot tests: an anchor and
two RL steps saved as Hugging Face shards, the deltas written by ``fireworks-delta-compression``
(the hosted services' own library), uploaded with plain boto3 (multipart for the large shard, so
its ETag is not an MD5) or copied into a file:// bucket. No bdn.manifest.json anywhere.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from fireworks_delta_compression import delta_compress_dirs
from safetensors.torch import save_file

from support.s3server import create_bucket

MiB = 1 << 20
PART = 5 * MiB  # s3transfer's (and S3's) smallest part
BIG = "model-00001-of-00002.safetensors"
SMALL = "model-00002-of-00002.safetensors"
CONFIG = {"architectures": ["TinyForCausalLM"], "model_type": "tiny", "hidden_size": 2048}


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.layers.0.mlp.weight": torch.randn(1536, 2048, generator=g).to(torch.bfloat16),
        "model.layers.1.mlp.weight": torch.randn(1536, 2048, generator=g).to(torch.bfloat16),
        "lm_head.weight": torch.randn(256, 512, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.ones(512, dtype=torch.float32),
    }


def rl_step(s: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """About 2% of the values change, as hosted providers report per RL step."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in s.items():
        mask = torch.rand(t.shape, generator=g) < 0.02
        out[name] = torch.where(mask, (t.float() * 1.01 + 1e-3).to(t.dtype), t)
    return out


def save_checkpoint(s: dict[str, torch.Tensor], d: Path, config: dict[str, Any] | None = None) -> None:
    d.mkdir(parents=True)
    shard1 = {k: v for k, v in s.items() if ".layers." in k}
    shard2 = {k: v for k, v in s.items() if ".layers." not in k}
    save_file(shard1, str(d / BIG), metadata={"format": "pt"})
    save_file(shard2, str(d / SMALL), metadata={"format": "pt"})
    weight_map = {k: BIG for k in shard1} | {k: SMALL for k in shard2}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (d / "config.json").write_text(json.dumps(config or CONFIG))


@dataclass
class Run:
    trainer: dict[str, Path]  # identity -> the trainer's full checkpoint directory
    published: dict[str, Path]  # identity -> what is uploaded (the anchor, then diff directories)


def make_run(root: Path, steps: int = 3, configs: dict[str, dict[str, Any]] | None = None) -> Run:
    """``step000001`` (anchor) .. ``step00000<steps>`` (deltas: arc_v2, then arc_v1 alternately)."""
    configs = configs or {}
    s = state(1)
    trainer: dict[str, Path] = {}
    for i in range(1, steps + 1):
        if i > 1:
            s = rl_step(s, i)
        ident = f"step{i:06d}"
        trainer[ident] = root / "ckpt" / ident
        save_checkpoint(s, trainer[ident], configs.get(ident))
    published = {"step000001": trainer["step000001"]}
    with ThreadPoolExecutor(2) as pool:  # the library's default is a 4-process pool
        for i in range(2, steps + 1):
            ident, base = f"step{i:06d}", f"step{i - 1:06d}"
            fmt = "arc_v2" if i % 2 == 0 else "arc_v1"
            published[ident] = root / "diffs" / ident
            delta_compress_dirs(str(trainer[base]), str(trainer[ident]), str(published[ident]), fmt, executor=pool)
    return Run(trainer, published)


def boto(endpoint: str) -> Any:
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )


def upload(client: Any, name: str, prefix: str, run: Run, only: list[str] | None = None) -> None:
    """Plain boto3, as a trainer's own upload code: multipart above 5 MiB, in 5 MiB parts."""
    from boto3.s3.transfer import TransferConfig

    config = TransferConfig(multipart_threshold=PART, multipart_chunksize=PART)
    for ident, d in run.published.items():
        if only is not None and ident not in only:
            continue
        for f in sorted(d.rglob("*")):
            if f.is_file():
                client.upload_file(str(f), name, f"{prefix}/{ident}/{f.relative_to(d).as_posix()}", Config=config)


def copy_to(root: Path, run: Run, only: list[str] | None = None) -> None:
    for ident, d in run.published.items():
        if only is None or ident in only:
            shutil.copytree(d, root / ident)


def replace_file(root: Path, key: str, data: bytes) -> None:
    """The trainer overwrites object ``key`` (``identity/path``) of the file:// bucket at ``root``:
    a new file renamed over it, so a reader sees the old bytes or the new, never a mix."""
    p = root / key
    tmp = p.with_name(p.name + ".new")
    tmp.write_bytes(data)
    os.replace(tmp, p)


@dataclass
class StoredRun:
    """A run as the trainer left it in a bucket.

    Attributes:
        kind: ``"s3"`` (a fresh bucket on the moto server, prefix ``run-1``) or ``"file"``.
        url: the bucket URL a daemon or ``open_bucket`` reads.
        endpoint: the S3 endpoint URL (None for ``file``).
        replace: ``(identity/path key, bytes) -> None``: the trainer overwrites one object.
    """

    kind: str
    url: str
    endpoint: str | None
    replace: Callable[[str, bytes], None]


@contextmanager
def stored_run(kind: str, run: Run, tmp_path: Path, endpoint: str | None = None) -> Iterator[StoredRun]:
    """``run`` uploaded with plain boto3 to a new bucket at ``endpoint`` (``kind`` "s3"), or copied
    to the file:// bucket ``tmp_path/bucket`` (``kind`` "file"); the boto3 client is closed on the
    way out."""
    if kind == "s3":
        assert endpoint is not None, "an s3 run needs the moto endpoint"
        name = create_bucket(endpoint)
        client = boto(endpoint)
        try:
            upload(client, name, "run-1", run)

            def put(key: str, data: bytes) -> None:
                client.put_object(Bucket=name, Key=f"run-1/{key}", Body=data)

            yield StoredRun("s3", f"s3://{name}/run-1", endpoint, put)
        finally:
            client.close()
    else:
        root = tmp_path / "bucket"
        copy_to(root, run)
        yield StoredRun("file", f"file://{root}", None, lambda key, data: replace_file(root, key, data))
