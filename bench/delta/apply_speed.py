"""Delta application speed, the way bdnd applies a delta (``bdn/daemon/node.py`` ``_apply_delta``).

The target file is created in /dev/shm and ``posix_fallocate``-d like the daemon's staging file;
base, diff and target are mmapped and ``arc.apply_diff`` runs with 1 and with all workers. GB/s are
reconstructed (target) bytes per second of wall time: ``decode_gbps`` is the median of ``--runs``,
with ``runs``/``median``/``min``/``max`` beside it (bench/runs.py; rows written before 2026-12-01
hold the best of 3 and no ``runs``).

    .venv/bin/python -m bench.delta.apply_speed [--quick] [--runs 3] [--baseline-rev 6196018] [--populate]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from bdn import fileops
from bdn.fileops import read_header
from bdn.proto import arc
from bench import runs
from bench.delta import inputs

SHM = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


POPULATE = 0  # set by --populate: mmap flags the daemon could use (see BENCHMARKS.md)


def load_arc_at(rev: str):
    """bdn/proto/arc.py as of git revision ``rev``, as a separate module (same-run baseline)."""
    import importlib.util
    import subprocess
    import sys

    src = subprocess.run(["git", "show", f"{rev}:bdn/proto/arc.py"], check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "arc_baseline.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("arc_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["arc_baseline"] = mod
    spec.loader.exec_module(mod)
    return mod


IMPLS = {"now": arc}


def apply_once(base: Path, diff: Path, out: Path, fmt: str, workers: int, impl: str = "now") -> float:
    size = base.stat().st_size
    with open(out, "wb") as fh:
        fh.truncate(size)
        os.posix_fallocate(fh.fileno(), 0, size)
    bh = read_header(base)
    with open(base, "rb") as bf, open(diff, "rb") as df, open(out, "r+b") as of:
        with mmap.mmap(df.fileno(), 0, access=mmap.ACCESS_READ) as dm:
            dh = arc.read_diff_header(dm, os.fstat(df.fileno()).st_size)
            t0 = time.perf_counter()
            with (
                mmap.mmap(bf.fileno(), 0, flags=mmap.MAP_SHARED | POPULATE, prot=mmap.PROT_READ) as bm,
                mmap.mmap(of.fileno(), 0, flags=mmap.MAP_SHARED | POPULATE) as om,
            ):
                if impl == "now":
                    arc.apply_diff(bm, bh, dm, dh, om, fmt, map=fileops.thread_map(workers))
                else:  # a baseline revision's arc.py, from before the thread pool moved to fileops
                    IMPLS[impl].apply_diff(bm, bh, dm, dh, om, fmt, workers=workers)
                om.flush()
                return time.perf_counter() - t0


def measure(pair: inputs.Pair, work: Path, fmt: str, n_runs: int) -> list[dict]:
    diff = work / f"{pair.base.parent.name}.{fmt}.diff"
    fileops.write_diff_file(pair.base, pair.target, diff, fmt, workers=os.cpu_count() or 1)
    out = SHM / f"bdn-bench-apply-{os.getpid()}"
    rows = []
    try:
        for workers in sorted({1, os.cpu_count() or 1}):
            times: dict[str, list[float]] = {k: [] for k in IMPLS}
            for _ in range(n_runs):  # interleaved, so load from other processes hits both alike
                for impl in IMPLS:
                    times[impl].append(apply_once(pair.base, diff, out, fmt, workers, impl))
                    if pair.raw_bytes < 200 << 20:
                        assert out.read_bytes() == pair.target.read_bytes()
            for impl, ts in times.items():
                st = runs.summarize({"seconds": ts, "decode_gbps": [pair.raw_bytes / t / 1e9 for t in ts]})
                rows.append(
                    {
                        "input": pair.input,
                        "codec": fmt,
                        "workers": workers,
                        "raw_bytes": pair.raw_bytes,
                        "seconds": st["median"]["seconds"],
                        "decode_gbps": st["median"]["decode_gbps"],
                        "impl": impl,
                        **st,
                    }
                )
                print(
                    f"  {pair.input:10s} {fmt} {impl:9s} workers={workers}: "
                    f"{runs.spread(rows[-1], 'seconds', 1, 1e3)} ms  {runs.spread(rows[-1], 'decode_gbps')} GB/s",
                    flush=True,
                )
    finally:
        out.unlink(missing_ok=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="MiniLM only")
    ap.add_argument("--size-gb", type=float, default=2.0)
    runs.add_runs_arg(ap)
    ap.add_argument("--repeat", type=int, dest="runs", help=argparse.SUPPRESS)  # the old name of --runs
    ap.add_argument("--label", default="now")
    ap.add_argument("--out", default="bench/results/apply_speed.json")
    ap.add_argument("--populate", action="store_true", help="map base and target with MAP_POPULATE")
    ap.add_argument("--baseline-rev", help="also time bdn/proto/arc.py of this git revision, interleaved")
    args = ap.parse_args()
    if args.baseline_rev:
        IMPLS["baseline"] = load_arc_at(args.baseline_rev)
    global POPULATE
    POPULATE = mmap.MAP_POPULATE if args.populate else 0
    work = Path(tempfile.mkdtemp(prefix="bdn-bench-apply-"))
    print(f"apply_diff speed on {os.cpu_count()} cores, label {args.label!r}")
    rows = []
    try:
        base = inputs.minilm_bf16()
        tgt = inputs.demo_step(base, 0.02, np.random.default_rng(2026))
        rows += measure(
            inputs.write_pair(work, "minilm", base, tgt, inputs.changed_fraction(base, tgt)), work, "arc_v2", args.runs
        )
        if not args.quick:
            base = inputs.synthetic_base(args.size_gb)
            tgt = inputs.synthetic_step(base, 0.02, 1)
            pair = inputs.write_pair(work, "synthetic", base, tgt, 0.02)
            del base, tgt
            rows += measure(pair, work, "arc_v2", args.runs)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    path = Path(args.out)
    old = json.loads(path.read_text()) if path.exists() else []
    old = [r for r in old if r.get("label") != args.label]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            old + [dict(r, label=args.label, threads=r["workers"], cores=os.cpu_count()) for r in rows], indent=1
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
