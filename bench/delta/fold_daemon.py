"""Catching up k deltas end to end: one real bdnd holding step 0 READY is asked for step k, with
``fold_deltas = true`` (the chain folded) and ``false`` (one READY snapshot per step, as before),
interleaved per run, each run on a fresh daemon and shm directory.

The bucket is ``file://`` on disk: an anchor and 16 ``arc_v2`` deltas of the real MiniLM model
(bf16, the demo's 2 % step) published by ``bdn.publish``. The time is from the prefetch of step k
to its READY as the local API reports it (``/v1/snapshots/<id>/wait``), so it holds the fetch of
the diff files, the apply, every check and READY. The rebuilt file is compared with the trainer's.

    .venv/bin/python -m bench.delta.fold_daemon [--runs 3] [--out bench/results/fold_daemon.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import runs
from bench.delta import inputs
from bench.delta.fold_speed import _write
from bdn.publish import publish_delta, publish_full

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))  # tests/support: a real bdnd process per run
from support.swarm import Daemon  # noqa: E402

KS = (1, 4, 16)
CHUNK = 4 << 20


def publish(work: Path, n: int) -> tuple[str, dict[int, str]]:
    bucket = work / "bucket"
    url = f"file://{bucket}"
    rng = np.random.default_rng(1)
    state = inputs.minilm_bf16()
    prev = _write(work / "ck0", state)
    publish_full(url, "step000000", 0, dir=prev, chunk_size=CHUNK)
    want = {}
    for i in range(1, n + 1):
        state = inputs.demo_step(state, 0.02, rng)
        cur = _write(work / f"ck{i}", state)
        publish_delta(url, f"step{i:06d}", i, f"step{i - 1:06d}", dir=cur, base_dir=prev, chunk_size=CHUNK)
        want[i] = hashlib.sha256((cur / "model.safetensors").read_bytes()).hexdigest()
        shutil.rmtree(prev)
        prev = cur
    return url, want


def one_run(url: str, root: Path, k: int, fold: bool, want: str) -> float:
    env = {"BDN_LOAD_STARTUP": "false", "BDN_FOLD_DELTAS": "true" if fold else "false", "BDN_LOG_LEVEL": "info",
           "BDN_KEEP_READY": "64", "BDN_STARTUP_SETTLE_S": "0"}
    d = Daemon(root, "node0", url, extra_env=env)
    d.shm_dir = Path(tempfile.mkdtemp(prefix="bdn-bench-fold-", dir="/dev/shm"))
    d.env["BDN_SHM_DIR"] = str(d.shm_dir)
    d.start([])
    try:
        d.wait_healthy()
        assert d.prefetch("step000000")[0] == 202
        d.wait_ready("step000000")
        ident = f"step{k:06d}"
        t0 = time.perf_counter()
        assert d.prefetch(ident)[0] == 202
        snap = d.wait_ready(ident, timeout=600)
        took = time.perf_counter() - t0
        got = hashlib.sha256((Path(snap["path"]) / "model.safetensors").read_bytes()).hexdigest()
        assert got == want, f"{ident}: the rebuilt file is not the trainer's"
        return took
    finally:
        d.stop()
        shutil.rmtree(d.shm_dir, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/fold_daemon.json")
    runs.add_runs_arg(ap)
    args = ap.parse_args()
    load = os.getloadavg()
    print(f"bdnd catching up k deltas, fold on/off, {os.cpu_count()} cores, load {load[0]:.1f}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="bdn-bench-fold-daemon-", dir="/var/tmp"))
    rows: list[dict[str, Any]] = []
    try:
        url, want = publish(work / "trainer", max(KS))
        for k in KS:
            times: dict[bool, list[float]] = {True: [], False: []}
            for r in range(args.runs):
                for fold in (False, True):
                    times[fold].append(one_run(url, work / f"node-{k}-{r}-{fold}", k, fold, want[k]))
            for fold, ts in times.items():
                st = runs.summarize({"seconds": ts})
                rows.append({"input": "minilm", "k": k, "way": "fold" if fold else "one_by_one",
                             "seconds": st["median"]["seconds"], **st})
                print(f"  k={k:2d} {rows[-1]['way']:10s}: {runs.spread(rows[-1], 'seconds', 2)} s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    doc = {"bench": "fold_daemon", "cores": os.cpu_count(), "load_before": load, "load_after": os.getloadavg(),
           "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": rows}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
