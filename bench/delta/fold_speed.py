"""Catching up k deltas on one node: folding the chain (bdn/daemon/apply/fold.py) against applying the
deltas one by one, each into its own snapshot directory (what bdnd did before, and still does with
``fold_deltas = false``).

A trainer publishes an anchor and 16 deltas (``bdn.publish``, into a ``file://`` bucket on disk);
the node holds the anchor READY in /dev/shm. For k = 1, 4, 16 both ways run the node's own work
from the diff files on hand to a verified target (the fetch is the same bytes either way and is
left out):

* one by one: per delta, the staging files reserved (``posix_fallocate``, as ``Store``), the
  non-diff files copied, ``diskio.apply_delta`` (base = the previous step's directory),
  ``diskio.verify_results`` (xxh3 of every rebuilt chunk against the manifest),
  ``headers.check_snapshot`` (the safetensors library's check);
* fold: the target's staging files reserved, ``fold.fold_chain`` (one copy of the ancestor, every
  diff applied in place, Adler-32 per tensor per diff), ``verify_results`` and the header check
  of the target only.

Both ways are interleaved per run; the files of both are compared with the trainer's. Rows hold
the median of ``--runs`` with min and max (bench/runs.py), and the shm bytes each way leaves.

    .venv/bin/python -m bench.delta.fold_speed [--runs 3] [--size-gb 0.25] [--quick]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bdn.daemon.apply import headers
from bdn.daemon.apply.fold import fold_chain
from bdn.daemon.store import diskio
from bdn.fileops import save
from bdn.proto.manifest import Manifest
from bdn.publish import publish_delta, publish_full
from bench import runs
from bench.delta import inputs

SHM = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
KS = (1, 4, 16)
CHUNK = 4 << 20


def _write(d: Path, state: dict[str, np.ndarray]) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    save(d / "model.safetensors", state, {"format": "pt"})
    (d / "config.json").write_text(json.dumps({"hidden_size": 384, "model_type": "bench"}))
    return d


def publish_chain(work: Path, name: str, n: int, fmt: str) -> tuple[str, list[Manifest], Path, str]:
    """Anchor + ``n`` deltas of input ``name`` into ``work/bucket``; (bucket dir, manifests of the
    deltas in order, anchor dir, sha256 of the last step's model file)."""
    bucket = work / "bucket"
    bucket.mkdir(parents=True)
    url = f"file://{bucket}"
    rng = np.random.default_rng(1)
    if name == "minilm":
        state = inputs.minilm_bf16()
        step = lambda s, i: inputs.demo_step(s, 0.02, rng)  # noqa: E731
    else:
        state = inputs.synthetic_base(float(name.split("@")[1]))
        step = lambda s, i: inputs.synthetic_step(s, 0.03, i)  # noqa: E731
    prev = _write(work / "ck0", state)
    publish_full(url, "step000000", 0, dir=prev, chunk_size=CHUNK)
    anchor = work / "anchor"
    shutil.copytree(prev, anchor)
    ms = []
    for i in range(1, n + 1):
        state = step(state, i)
        cur = _write(work / f"ck{i}", state)
        ms.append(
            publish_delta(
                url,
                f"step{i:06d}",
                i,
                f"step{i - 1:06d}",
                dir=cur,
                base_dir=prev,
                chunk_size=CHUNK,
                compression_format=fmt,
            )
        )
        if prev != work / "ck0":
            shutil.rmtree(prev)
        prev = cur
    last = hashlib.sha256((prev / "model.safetensors").read_bytes()).hexdigest()
    shutil.rmtree(prev)
    shutil.rmtree(work / "ck0")
    return str(bucket), ms, anchor, last


def _staging(root: Path, m: Manifest, bucket: Path) -> Path:
    d = root / m.identity
    for f in m.files:
        p = d / f.path
        p.parent.mkdir(parents=True, exist_ok=True)
        if f.is_diff:
            with open(p, "wb") as fh:
                fh.truncate(f.result_size)
                if f.result_size:
                    os.posix_fallocate(fh.fileno(), 0, f.result_size)
        else:
            shutil.copyfile(bucket / m.identity / f.path, p)
    return d


def _du(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def one_by_one(chain: list[Manifest], anchor: Path, bucket: Path, root: Path, workers: int) -> Path:
    prev = anchor
    for m in chain:
        st = _staging(root, m, bucket)
        diskio.apply_delta(m, prev, bucket / m.identity, st, workers)
        diskio.verify_results(m, st)
        headers.check_snapshot(m, st)
        prev = st
    return prev


def folded(chain: list[Manifest], anchor: Path, bucket: Path, root: Path, workers: int) -> Path:
    m = chain[-1]
    st = _staging(root, m, bucket)
    fold_chain(chain, anchor, lambda ident: bucket / ident, st, workers)
    diskio.verify_results(m, st)
    headers.check_snapshot(m, st)
    return st


def measure(name: str, fmt: str, n_runs: int, workers: int) -> list[dict[str, Any]]:
    work = Path(tempfile.mkdtemp(prefix="bdn-bench-fold-", dir="/var/tmp"))
    shm = Path(tempfile.mkdtemp(prefix="bdn-bench-fold-", dir=SHM))
    try:
        bucket_s, ms, anchor_disk, want = publish_chain(work, name, max(KS), fmt)
        bucket = Path(bucket_s)
        anchor = shm / "anchor"
        shutil.copytree(anchor_disk, anchor)
        size = (anchor / "model.safetensors").stat().st_size
        diff_bytes = [m.stored_bytes for m in ms]
        rows = []
        for k in KS:
            chain = ms[:k]
            times: dict[str, list[float]] = {"one_by_one": [], "fold": []}
            left: dict[str, int] = {}
            for _ in range(n_runs):
                for way, fn in (("one_by_one", one_by_one), ("fold", folded)):
                    root = shm / way
                    t0 = time.perf_counter()
                    out = fn(chain, anchor, bucket, root, workers)
                    times[way].append(time.perf_counter() - t0)
                    left[way] = _du(root)
                    if k == max(KS):
                        got = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
                        assert got == want, f"{way}: the rebuilt file is not the trainer's"
                    shutil.rmtree(root)
            for way, ts in times.items():
                st = runs.summarize({"seconds": ts})
                rows.append(
                    {
                        "input": name,
                        "codec": fmt,
                        "k": k,
                        "way": way,
                        "workers": workers,
                        "model_bytes": size,
                        "diff_bytes": sum(diff_bytes[:k]),
                        "shm_bytes_left": left[way],
                        "seconds": st["median"]["seconds"],
                        **st,
                    }
                )
                print(
                    f"  {name:12s} {fmt} k={k:2d} {way:10s}: {runs.spread(rows[-1], 'seconds', 3)} s"
                    f"  shm {left[way] / 1e6:.0f} MB",
                    flush=True,
                )
        return rows
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="MiniLM only")
    ap.add_argument("--size-gb", type=float, default=0.25)
    ap.add_argument("--codec", default="arc_v2")
    ap.add_argument("--out", default="bench/results/fold.json")
    runs.add_runs_arg(ap)
    args = ap.parse_args()
    workers = os.cpu_count() or 1
    load = os.getloadavg()
    print(f"fold vs one by one on {workers} cores, load {load[0]:.1f}")
    names = ["minilm"] + ([] if args.quick else [f"synthetic@{args.size_gb:g}"])
    rows = []
    for name in names:
        rows += measure(name, args.codec, args.runs, workers)
    doc = {
        "bench": "fold",
        "cores": workers,
        "load_before": load,
        "load_after": os.getloadavg(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
