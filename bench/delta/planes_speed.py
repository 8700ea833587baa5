"""bdn_planes_v1 against arc_v2 as shipped in ``bdn/proto/arc.py``: stored size and apply speed.

    .venv/bin/python -m bench.delta.planes_speed [--size-gb 0.5] [--frac 0.02] [--runs 5]

Inputs: the MiniLM demo delta (bf16, 2 % of values move), a ``--size-gb`` synthetic bf16
checkpoint with ``--frac`` of its values moved by 1-3 ulps (``bench/delta/inputs.py``; 7B-model
matrix shapes), and one bf16 tensor of ``--tensor-mb`` MB moved the same way (a large embedding or
LM head: arc_v2 decodes one tensor on one core, bdn_planes_v1 on all). For each,
both formats are written by ``fileops.write_diff_file`` and applied the way bdnd applies a delta
(``bench.delta.apply_speed.apply_once``: mmaps, a fallocated /dev/shm target). Runs are
interleaved (arc_v2, planes, arc_v2, ... with the order flipped every repeat) so that load from
other processes hits both alike; GB/s are reconstructed bytes per second of wall time, best and
median of ``--runs``, with ``runs``/``median``/``min``/``max`` of ``decode_gbps`` (bench/runs.py).
Every decode is checked bit-exact once. Results: bench/results/planes_speed.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from bdn import fileops
from bench import runs
from bench.delta import inputs
from bench.delta.apply_speed import SHM, apply_once

FORMATS = ("arc_v2", "bdn_planes_v1")


def measure(pair: inputs.Pair, work: Path, repeat: int, threads: list[int]) -> list[dict]:
    """Both formats of ``pair``, applied ``repeat`` times per thread count, interleaved."""
    diffs, sizes, enc = {}, {}, {}
    for fmt in FORMATS:
        diffs[fmt] = work / f"{pair.base.parent.name}.{fmt}.diff"
        t0 = time.perf_counter()
        fileops.write_diff_file(pair.base, pair.target, diffs[fmt], fmt, workers=max(threads))
        enc[fmt] = time.perf_counter() - t0
        sizes[fmt] = diffs[fmt].stat().st_size
    out = SHM / f"bdn-bench-planes-{os.getpid()}"
    rows = []
    try:
        want = np.memmap(pair.target, dtype=np.uint8, mode="r")
        for fmt in FORMATS:  # bit-exact check, untimed
            apply_once(pair.base, diffs[fmt], out, fmt, max(threads))
            assert np.array_equal(np.memmap(out, dtype=np.uint8, mode="r"), want), fmt
        del want
        for workers in threads:
            times: dict[str, list[float]] = {f: [] for f in FORMATS}
            for r in range(repeat):
                for fmt in FORMATS if r % 2 == 0 else FORMATS[::-1]:
                    times[fmt].append(apply_once(pair.base, diffs[fmt], out, fmt, workers))
            for fmt in FORMATS:
                best, med = min(times[fmt]), statistics.median(times[fmt])
                row = {
                    "input": pair.input,
                    "changed_fraction": round(pair.changed_fraction, 6),
                    "codec": fmt,
                    "threads": workers,
                    "raw_bytes": pair.raw_bytes,
                    "bytes": sizes[fmt],
                    "size_vs_arc_v2": sizes["arc_v2"] / sizes[fmt],
                    "encode_gbps": pair.raw_bytes / enc[fmt] / 1e9,
                    "decode_gbps_best": pair.raw_bytes / best / 1e9,
                    "decode_gbps_median": pair.raw_bytes / med / 1e9,
                    "repeat": repeat,
                    **runs.summarize({"decode_gbps": [pair.raw_bytes / t / 1e9 for t in times[fmt]]}),
                }
                rows.append(row)
                print(
                    f"  {pair.input:16s} {fmt:13s} threads={workers}: {sizes[fmt] / 1e6:9.3f} MB "
                    f"({row['size_vs_arc_v2']:.2f}x)  decode best {row['decode_gbps_best']:.2f} GB/s, "
                    f"median {row['decode_gbps_median']:.2f} GB/s",
                    flush=True,
                )
    finally:
        out.unlink(missing_ok=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=0.5)
    ap.add_argument("--frac", type=float, default=0.02)
    runs.add_runs_arg(ap, default=5)
    ap.add_argument("--repeat", type=int, dest="runs", help=argparse.SUPPRESS)  # the old name of --runs
    ap.add_argument("--tensor-mb", type=int, default=256, help="size of the one-tensor input (0: skip it)")
    ap.add_argument("--out", default="bench/results/planes_speed.json")
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    threads = sorted({1, 2, cores})
    load = os.getloadavg()
    print(f"bdn_planes_v1 vs arc_v2 on {cores} cores, threads {threads}, load average {load[0]:.1f}", flush=True)
    rows: list[dict] = []
    work = Path(tempfile.mkdtemp(prefix="bdn-bench-planes-"))
    try:
        base = inputs.minilm_bf16()
        tgt = inputs.demo_step(base, 0.02, np.random.default_rng(2026))
        pair = inputs.write_pair(work, "minilm", base, tgt, inputs.changed_fraction(base, tgt))
        rows += measure(pair, work, args.runs, threads)
        base = inputs.synthetic_base(args.size_gb)
        tgt = inputs.synthetic_step(base, args.frac, 1)
        pair = inputs.write_pair(work, f"synthetic {args.size_gb:g}GB", base, tgt, inputs.changed_fraction(base, tgt))
        del base, tgt
        rows += measure(pair, work, args.runs, threads)
        if args.tensor_mb:
            rng = np.random.default_rng(11)
            one = {
                "lm_head.weight": (rng.standard_normal((args.tensor_mb << 9, 1024), dtype=np.float32) * 0.02).astype(
                    inputs.BF16
                )
            }
            tgt = inputs.synthetic_step(one, args.frac, 2)
            pair = inputs.write_pair(
                work, f"one tensor {args.tensor_mb}MB", one, tgt, inputs.changed_fraction(one, tgt)
            )
            del one, tgt
            rows += measure(pair, work, args.runs, threads)
    finally:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    Path(args.out).write_text(
        json.dumps({"cores": cores, "load_average_at_start": load, "rows": rows}, indent=1) + "\n"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
