"""bench/publish: trainer ranks publishing a bf16 model's anchor and deltas, against the bucket's own speed.

    .venv/bin/python -m bench.publish [--gib 2] [--layers 16] [--worlds 1,2,4] [--buckets file,s3] [--runs 3]
    .venv/bin/python -m bench.publish --encode [--runs 3]

Publish: for each bucket (``file://`` under ``--dir``, and a moto S3 server started here) and
each world size, ``world`` rank processes (bench/publish/rank.py) hold their layers of a
``--gib`` GiB bf16 model in memory (rank ``r`` owns layers ``i % world == r``). Each run:

1. *floor*: every rank uploads its anchor files' bytes (S3: ``--floor-share`` of them) as they are (``Bucket.write_buffers``, two
   files at a time, no digest or encoding): ``bandwidth = bytes / seconds`` of the bucket in
   this run, and a step's upload floor is its stored bytes / that bandwidth;
2. *anchor*: ``publish_part`` on every rank, then ``commit_step``;
3. *delta 0.1 %*, *delta 2 %*: targets with that fraction of bf16 values moved by a few ulps
   (made untimed), published as ``bdn_planes_v1`` deltas on the anchor. Before each, the
   *memory floor*: every rank reads its anchor and target tensors once (XOR, all cores, all ranks
   at once): a delta publish cannot take less, whatever the bucket's speed.

Per step: wall seconds (all ranks started together to the last one's return, plus the commit),
the slowest rank's encode (building files: layout, chunk digests, diff streams) and upload
seconds, the commit's seconds, the stored bytes, the floors and the ratios wall / upload floor
and wall / max(upload floor, memory floor). The
objects of a run are removed after it. Results: bench/results/publish.json (median, min, max of
``--runs``; bench/runs.py).

``--encode``: the encoder alone, in CPU seconds of one thread (GB/s per core of model bytes)
and in wall seconds on 1 and 2 threads: ``bdn_planes_v1`` and ``arc_v2`` of a 512 MiB set of
bf16 matrices at 0.1 %, 2 % and 10 % changed, and the chunk digests (xxh3-128) of the target;
first the *read floor*: base and target read once (XOR of 1 MiB pieces into a reused buffer),
the least an encoder does.
Results: bench/results/publish_encode.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bdn.bucket import open_bucket
from bdn.fileops import thread_map
from bdn.proto import arc, planes_scan
from bdn.proto.chunks import concat_digests
from bdn.proto.safetensors_fmt import encode_raw, raw_tensors
from bdn.publish import commit_step
from bench import runs
from bench.publish.rank import moved, read_floor, tensor

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
from support.s3server import create_bucket, start_moto_server, stop_moto_server  # noqa: E402  (tests/ on the path first)

RESULTS = REPO / "bench" / "results"
# moto accepts any credentials; boto3 wants some.
for _k, _v in (
    ("AWS_ACCESS_KEY_ID", "testing"),
    ("AWS_SECRET_ACCESS_KEY", "testing"),
    ("AWS_DEFAULT_REGION", "us-east-1"),
):
    os.environ.setdefault(_k, _v)
CONFIG = {"config.json": b'{"model_type": "llama"}\n'}


class Ranks:
    """``world`` rank processes, each answering one JSON line per command."""

    def __init__(self, world: int, init: dict[str, Any]) -> None:
        env = dict(os.environ, PYTHONPATH=str(REPO))
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-m", "bench.publish.rank"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=env,
                cwd=REPO,
            )
            for _ in range(world)
        ]
        self.all([{**init, "op": "init", "rank": r, "world": world} for r in range(world)])

    def all(self, msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for p, m in zip(self.procs, msgs):
            assert p.stdin is not None
            p.stdin.write(json.dumps(m) + "\n")
            p.stdin.flush()
        out = []
        for p in self.procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            if not line:
                raise RuntimeError(f"a rank exited ({p.wait()})")
            out.append(json.loads(line))
        return out

    def same(self, msg: dict[str, Any]) -> list[dict[str, Any]]:
        return self.all([msg] * len(self.procs))

    def close(self) -> None:
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.close()
            p.wait(timeout=60)


def _step(ranks: Ranks, url: str, endpoint: str | None, msg: dict[str, Any], version: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    answers = ranks.same(msg)
    t1 = time.perf_counter()
    with open_bucket(url, endpoint_url=endpoint) as b:
        m = commit_step(b, msg["identity"], version, world_size=len(ranks.procs), extra_files=CONFIG)
    t2 = time.perf_counter()
    return {
        "wall_s": t2 - t0,
        "ranks_s": t1 - t0,
        "commit_s": t2 - t1,
        "encode_s": max(a["encode_s"] for a in answers),
        "upload_s": max(a["upload_s"] for a in answers),
        "stored_bytes": m.stored_bytes,
        "result_bytes": m.result_bytes,
    }


def _clean(url: str, endpoint: str | None, prefix: str) -> None:
    if url.startswith("file://"):
        root = Path(url.removeprefix("file://"))
        for p in list(root.glob(f"{prefix}*")) + list(root.glob(f".bdn-parts/{prefix}*")):
            shutil.rmtree(p, ignore_errors=True)
        return
    import boto3

    name, _, pre = url.removeprefix("s3://").partition("/")
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    for p in (f"{pre}/{prefix}", f"{pre}/.bdn-parts/{prefix}"):
        keys = [
            o["Key"]
            for page in s3.get_paginator("list_objects_v2").paginate(Bucket=name, Prefix=p)
            for o in page.get("Contents", [])
        ]
        for i in range(0, len(keys), 1000):
            s3.delete_objects(Bucket=name, Delete={"Objects": [{"Key": k} for k in keys[i : i + 1000]]})


def publish_bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    work = Path(tempfile.mkdtemp(prefix="bdn-bench-publish-", dir=args.dir))
    moto = None
    try:
        for kind in args.buckets:
            endpoint = None
            if kind == "file":
                (work / "bucket").mkdir(exist_ok=True)
                url = f"file://{work / 'bucket'}"
            else:
                if moto is None:
                    moto, moto_url = start_moto_server()
                endpoint = moto_url
                url = f"s3://{create_bucket(endpoint)}/run"
            for world in args.worlds:
                ranks = Ranks(world, {"url": url, "endpoint": endpoint, "gib": args.gib, "layers": args.layers})
                try:
                    per: dict[str, list[dict[str, Any]]] = {"anchor": [], "delta 0.1%": [], "delta 2%": []}
                    for r in range(args.runs):
                        tag = f"r{r}w{world}"
                        share = 1.0 if kind == "file" else args.floor_share
                        fl = ranks.same({"op": "floor", "identity": f"{tag}floor", "share": share})
                        floor_wall = max(a["seconds"] for a in fl)
                        bw = sum(a["stored_bytes"] for a in fl) / floor_wall
                        steps = [("anchor", {"op": "anchor", "identity": f"{tag}a"}, None)]
                        steps += [
                            (f"delta {f * 100:g}%", {"op": "delta", "identity": f"{tag}d{i}", "base": f"{tag}a"}, f)
                            for i, f in enumerate((0.001, 0.02))
                        ]
                        for name, msg, frac in steps:
                            mem = 0.0
                            if frac is not None:
                                ranks.same({"op": "target", "frac": frac})
                                mem = max(a["seconds"] for a in ranks.same({"op": "memfloor"}))
                            row = _step(ranks, url, endpoint, msg, 1 if frac is None else 2)
                            row["bandwidth_Bps"] = bw
                            row["floor_s"] = row["stored_bytes"] / bw
                            row["ratio"] = row["wall_s"] / row["floor_s"]
                            # A delta reads the base and the target at least once: its floor is the
                            # larger of that read (all ranks at once, measured just before) and the upload.
                            row["mem_floor_s"] = mem
                            row["ratio_floor"] = row["wall_s"] / max(row["floor_s"], mem)
                            per[name].append(row)
                            print(
                                f"{kind} world={world} run={r} {name}: "
                                + ", ".join(f"{k}={v:.6g}" for k, v in row.items()),
                                flush=True,
                            )
                        _clean(url, endpoint, tag)
                    for name, vals in per.items():
                        metrics = {k: [v[k] for v in vals] for k in vals[0]}
                        summary = runs.summarize(metrics)
                        rows.append(
                            {
                                "bucket": kind,
                                "world": world,
                                "step": name,
                                "gib": args.gib,
                                **summary["median"],
                                **summary,
                            }
                        )
                finally:
                    ranks.close()
    finally:
        if moto is not None:
            stop_moto_server(moto)
        shutil.rmtree(work, ignore_errors=True)
    return rows


def encode_bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    print(f"bdn_planes_v1 kernel (numba): {planes_scan.warm()}", flush=True)
    shapes = {f"m{i}": (4096, 4096) for i in range(16)}  # 512 MiB of bf16
    base = {n: tensor(n, s) for n, s in shapes.items()}
    nbytes = sum(a.nbytes for a in base.values())
    rng = np.random.default_rng(0)
    rows = []
    for frac in (0.001, 0.02, 0.10):
        target = {n: moved(a, frac, rng) for n, a in base.items()}
        prefix, parts = encode_raw(raw_tensors(target), {"format": "pt"})
        for fmt in ("read floor", "bdn_planes_v1", "arc_v2", "digests"):
            vals: dict[str, list[float]] = {"cpu_gbps": [], "wall1_gbps": [], "wall2_gbps": []}
            size = 0
            for _ in range(args.runs):
                for threads in (1, 2):
                    t0, c0 = time.perf_counter(), time.thread_time()
                    if fmt == "read floor":  # base and target read once (XOR into a reused 1 MiB buffer)
                        if threads == 1:
                            out = np.empty(1 << 20, dtype=np.uint8)
                            for n_, a in base.items():
                                b8, t8 = a.reshape(-1).view(np.uint8), target[n_].reshape(-1).view(np.uint8)
                                for i in range(0, len(b8), 1 << 20):
                                    np.bitwise_xor(
                                        b8[i : i + (1 << 20)],
                                        t8[i : i + (1 << 20)],
                                        out=out[: len(b8[i : i + (1 << 20)])],
                                    )
                        else:
                            read_floor(base, target, threads)
                    elif fmt == "digests":
                        concat_digests([prefix, *parts], 16 << 20, thread_map(threads))
                    else:
                        frames, _ = arc.encode_diff_arrays(base, target, fmt, map=thread_map(threads))
                        size = sum(len(f[2]) for f in frames.values())
                    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
                    vals[f"wall{threads}_gbps"].append(nbytes / wall / 1e9)
                    if threads == 1:
                        vals["cpu_gbps"].append(nbytes / cpu / 1e9)
            s = runs.summarize(vals)
            rows.append(
                {
                    "format": fmt,
                    "changed": frac,
                    "model_bytes": nbytes,
                    "stored_fraction": size / nbytes,
                    **s["median"],
                    **s,
                }
            )
            print(f"{fmt} {frac}: " + ", ".join(f"{k}={v:.3g}" for k, v in s["median"].items()), flush=True)
    return rows


def rows_from_log(text: str, gib: float) -> list[dict[str, Any]]:
    """The rows of a publish run rebuilt from the lines it printed (``<bucket> world=W run=R <step>:
    k=v, ...``): a run stopped before its end (moto takes minutes per GiB) keeps what it measured."""
    per: dict[tuple[str, int, str], list[dict[str, float]]] = {}
    for line in text.splitlines():
        head, sep, tail = line.partition(": ")
        parts = head.split(" ", 3)
        if not sep or len(parts) != 4 or not parts[1].startswith("world="):
            continue
        vals = {k: float(v) for k, v in (kv.split("=") for kv in tail.split(", "))}
        per.setdefault((parts[0], int(parts[1][6:]), parts[3]), []).append(vals)
    rows = []
    for (kind, world, step), vals in per.items():
        summary = runs.summarize({k: [v[k] for v in vals] for k in vals[0]})
        rows.append({"bucket": kind, "world": world, "step": step, "gib": gib, **summary["median"], **summary})
    return rows


def report(path: Path) -> str:
    """The markdown table of a results file (publish or encode rows), cells ``median (min–max)``."""
    data = json.loads(path.read_text())
    rows = data["rows"]
    if rows and "format" in rows[0]:
        out = [
            "| stream | changed | GB/s per core (CPU s) | GB/s wall, 1 thread | GB/s wall, 2 threads | stored / model |",
            "|---|---|---|---|---|---|",
        ]
        for r in rows:
            out.append(
                f"| {r['format']} | {r['changed'] * 100:g} % | {runs.spread(r, 'cpu_gbps')} | "
                f"{runs.spread(r, 'wall1_gbps')} | {runs.spread(r, 'wall2_gbps')} | "
                f"{r['stored_fraction'] * 100:.2f} % |"
            )
        return "\n".join(out)
    out = [
        (
            "| bucket | GiB | ranks | step | publish s | encode s (slowest rank) | upload s | commit s | stored MB | "
            "upload floor s | memory floor s | publish / upload floor | publish / max(floors) |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mem = runs.spread(r, "mem_floor_s", 3) if r.get("mem_floor_s") else "–"
        both = runs.spread(r, "ratio_floor") if r.get("mem_floor_s") else "–"
        out.append(
            f"| {r['bucket']} | {r['gib']:g} | {r['world']} | {r['step']} | {runs.spread(r, 'wall_s')} | {runs.spread(r, 'encode_s')} | "
            f"{runs.spread(r, 'upload_s')} | {runs.spread(r, 'commit_s')} | {r['stored_bytes'] / 1e6:.1f} | "
            f"{runs.spread(r, 'floor_s', 3)} | {mem} | {runs.spread(r, 'ratio')} | {both} |"
        )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--buckets", default="file,s3")
    ap.add_argument("--dir", default=None, help="where the file:// bucket lives (default: the temp dir)")
    ap.add_argument(
        "--floor-share",
        type=float,
        default=0.5,
        help="share of each rank's anchor files uploaded to measure the S3 bucket's bandwidth "
        "(default 0.5; file:// uploads them all)",
    )
    ap.add_argument("--encode", action="store_true", help="the encoder alone")
    ap.add_argument("--out", default=None)
    ap.add_argument("--report", default=None, help="print the markdown table of this results file and exit")
    ap.add_argument(
        "--from-log", default=None, help="rebuild the results file from a run's printed lines (a run stopped early)"
    )
    runs.add_runs_arg(ap)
    args = ap.parse_args()
    if args.report:
        print(report(Path(args.report)))
        return
    args.worlds = [int(w) for w in args.worlds.split(",")]
    args.buckets = args.buckets.split(",")
    load = os.getloadavg()
    if args.from_log:
        rows = rows_from_log(Path(args.from_log).read_text(), args.gib)
    else:
        rows = encode_bench(args) if args.encode else publish_bench(args)
    out = Path(args.out) if args.out else RESULTS / ("publish_encode.json" if args.encode else "publish.json")
    out.write_text(
        json.dumps(
            {"cores": os.cpu_count(), "loadavg_start": load, "loadavg_end": os.getloadavg(), "rows": rows}, indent=1
        )
        + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
