"""Node work per step: turning snapshot N into N+1 on one node, against its physical floors.

    .venv/bin/python -m bench.nodework [--size-gb 2] [--runs 3] [--fracs 0.001,0.01,0.02] [--patterns scattered,clustered]
    .venv/bin/python -m bench.nodework --report bench/results/nodework.json ...   # the BENCHMARKS.md table

A synthetic bf16 checkpoint of ``--size-gb`` GB (``bench/delta/inputs.py``: 7B-class layer
shapes) in one safetensors file in /dev/shm, and per changed fraction and pattern one optimizer-like
step (``ulp_step``: exactly that fraction of the values moves by 1-3 ulps) published as a
``bdn_planes_v1`` diff. Patterns: ``scattered`` (every tensor, uniformly) and ``clustered`` (the
same number of changed values, all in the first few tensors, each at most half changed). Timed,
interleaved in every run (the machine is shared; the ratios to floors of the same run count):

* ``memcpy_s``: one ``np.copyto`` of the whole model into existing pages (the first floor);
* ``sparse_floor_s``: reading the diff file once (a copy into a buffer) plus the in-place XOR of
  exactly the changed bytes at precomputed positions (the second floor);
* ``today_s``: today's node step: ``fileops.apply_delta_file`` (base + diff into a staging file
  whose pages exist, as the page pool gives it, ``--workers`` threads) and the xxh3 check of every
  rebuilt chunk (``diskio.verify_results``);
* ``sparse_s``: the sparse step (``bdn.proto.sparse.apply_sparse``) on the buffer's mapping held
  from before (as the daemon holds a spare buffer's): the buffer holds the base, the diff is
  applied in place writing only changed words, each changed tensor's Adler-32 updated from the
  changed bytes and checked, untouched chunks' digests compared with the buffer's. The buffer is
  put back to the base between runs (untimed);
* ``sparse_numpy_s``: the same step with the kernel's numpy path (``fused=False``): the compiled
  kernel (``bdn.proto.sparse_kernel``, numba, loaded before the runs) against it in the same run;
* ``sparse_cold_s``: the same through ``bdn.fileops.apply_sparse_file``, which maps the file for
  this apply: every touched page then costs a page fault (on this VM ~2.5 us a 4 KiB page, 0.66 s a
  GiB when every page is touched: more than the copy of the model).

Writes ``bench/results/nodework.json`` (rows with runs/median/min/max, bench/runs.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np

from bdn import fileops
from bdn.daemon.store import diskio
from bdn.proto import arc, sparse, sparse_kernel
from bdn.proto.delta_tasks import raw_adler32
from bdn.proto.manifest import Manifest
from bench import runs
from bench.delta import inputs

SHM = Path("/dev/shm")
CHUNK = 16 << 20


def clustered_step(base: dict[str, np.ndarray], frac: float, seed: int) -> dict[str, np.ndarray]:
    """The same number of changed values as a ``frac`` scattered step, packed into the first tensors."""
    rng = np.random.default_rng(seed)
    total = sum(a.size for a in base.values())
    left = round(frac * total)
    out = {}
    for name, arr in base.items():
        bits = arr.view(np.uint16).reshape(-1).copy()
        if left > 0:
            k = min(left, bits.size // 2)
            idx = np.arange(k) * 2  # every other value of the tensor's first part: few 4 KiB pages apart
            step = np.where(rng.random(k) < 0.5, 1, -1).astype(np.int32)
            v = bits[idx].astype(np.int32)
            mag = np.clip((v & 0x7FFF) + step, 1, 0x7F7F)
            bits[idx] = ((v & 0x8000) | mag).astype(np.uint16)
            left -= k
        out[name] = bits.view(inputs.BF16).reshape(arr.shape)
    return out


def manifest_for(work: Path, base: Path, target: Path, diff: Path) -> Manifest:
    """A delta manifest for one file (only what verify and the sparse step read)."""
    doc = {
        "format": "bdn.snapshot/1",
        "identity": "t",
        "kind": "delta",
        "policy_version": 2,
        "created_at": "2026-12-01T00:00:00Z",
        "chunk_size": CHUNK,
        "base_identity": "b",
        "compression_format": "bdn_planes_v1",
        "checksum_format": "alder32",
        "files": [
            {
                "path": "model.safetensors",
                "size": diff.stat().st_size,
                "chunks": fileops.chunk_digests(diff, CHUNK),
                "result": {"size": target.stat().st_size, "chunks": fileops.chunk_digests(target, CHUNK)},
            }
        ],
    }
    return Manifest.from_json(json.dumps(doc).encode())


def sparse_step(
    o: np.ndarray,
    diff: Path,
    bh: Any,
    adlers: dict[str, int],
    workers: int,
    size: int,
    base_digests: list[str],
    m: Manifest,
    fused: bool | None = None,
) -> sparse.SparseResult:
    """The sparse step on the buffer's held mapping ``o``: map the diff, apply it in place, compare
    the untouched chunks' digests (what ``sparse_s`` times)."""
    dmap = np.memmap(diff, dtype=np.uint8, mode="r")
    _, streams = arc.read_diff_header(dmap, len(dmap))
    sa = sparse.apply_sparse(o, bh, dmap, streams, adlers, map=fileops.thread_map(workers), fused=fused)
    touched = sparse.touched_chunks(sa.ranges, size, CHUNK)
    sparse.check_untouched(touched, base_digests, m.files[0].result_chunks, "model.safetensors")
    return sa


def report(paths: list[str]) -> None:
    """Print BENCHMARKS.md's table from result files (rows in file order)."""

    def sp(r: dict, k: str, nd: int = 3) -> str:
        return f"{r['median'][k]:.{nd}f} ({r['min'][k]:.{nd}f}–{r['max'][k]:.{nd}f})"

    print(
        "| pattern | changed | diff MB | memcpy(model) s | sparse floor s | today s | sparse (mapping populated ahead) s"
        " | sparse, mapped per apply s | sparse / floor | sparse / memcpy | CPU s: sparse / floor | CPU s: sparse / memcpy"
        " | sparse peak heap (model sizes) | today / floor | CPU s: sparse (numpy path) / floor |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")

    def numpy_path(r: dict) -> str:
        if "sparse_numpy_cpu_s" not in r.get("median", {}):
            return ""
        return f"{r['median']['sparse_numpy_cpu_s'] / r['median']['sparse_floor_cpu_s']:.1f}x"

    for path in paths:
        for r in json.loads(Path(path).read_text())["rows"]:
            heap = r.get("sparse_heap_peak_bytes")
            hs = "" if heap is None else f"{heap / r['model_bytes']:.4f}"
            print(
                f"| {r['pattern']} | {r['frac'] * 100:g} % | {r['diff_bytes'] / 1e6:.1f} | {sp(r, 'memcpy_s')} | "
                f"{sp(r, 'sparse_floor_s', 4)} | {sp(r, 'today_s', 2)} | {sp(r, 'sparse_s')} | {sp(r, 'sparse_cold_s')} | "
                f"{r['sparse_over_floor']:.1f}x | {r['sparse_over_memcpy']:.2f}x | "
                f"{r.get('sparse_cpu_over_floor_cpu', float('nan')):.1f}x | {r.get('sparse_cpu_over_memcpy_cpu', float('nan')):.2f}x | "
                f"{hs} | {r['today_over_floor']:.1f}x | {numpy_path(r)} |"
            )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--report", nargs="+", metavar="JSON", help="print the BENCHMARKS.md table of these result files")
    ap.add_argument("--size-gb", type=float, default=2.0)
    ap.add_argument("--fracs", default="0.001,0.01,0.02")
    ap.add_argument("--patterns", default="scattered,clustered")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--out", default="bench/results/nodework.json")
    runs.add_runs_arg(ap)
    a = ap.parse_args()
    if a.report:
        report(a.report)
        return
    work = Path(tempfile.mkdtemp(prefix="bdn-nodework-", dir=SHM))
    rows = []
    load0 = os.getloadavg()
    try:
        base_state = inputs.synthetic_base(a.size_gb)
        bpath = work / "base" / "model.safetensors"
        bpath.parent.mkdir()
        fileops.save(bpath, base_state, {"format": "pt"})
        size = bpath.stat().st_size
        base_digests = fileops.chunk_digests(bpath, CHUNK)
        base_map = np.memmap(bpath, dtype=np.uint8, mode="r")
        bh = fileops.read_header(bpath)
        base_adlers = {n: int(raw_adler32(base_map[i.start : i.end])) for n, i in bh.tensors.items()}
        out = work / "out" / "model.safetensors"  # the staging file / the spare buffer: pages exist
        out.parent.mkdir()
        shutil.copyfile(bpath, out)
        fused = sparse_kernel.warm()  # numba's import and the cached kernel: once per process, untimed
        print(
            f"nodework: {size / 1e9:.2f} GB bf16, {os.cpu_count()} cores, load {load0}, fused kernel {fused}",
            flush=True,
        )
        for pattern in a.patterns.split(","):
            for frac in (float(f) for f in a.fracs.split(",")):
                step = inputs.synthetic_step if pattern == "scattered" else clustered_step
                tgt_state = step(base_state, frac, 1)
                tpath = work / "target" / "model.safetensors"
                tpath.parent.mkdir(exist_ok=True)
                fileops.save(tpath, tgt_state, {"format": "pt"})
                del tgt_state
                diff = work / "model.diff"
                t0 = time.perf_counter()
                fileops.write_diff_file(bpath, tpath, diff, "bdn_planes_v1", workers=a.workers)
                enc_s = time.perf_counter() - t0
                m = manifest_for(work, bpath, tpath, diff)
                tmap = np.memmap(tpath, dtype=np.uint8, mode="r")
                idx = np.flatnonzero(base_map != tmap)  # the changed bytes (the floor's positions)
                xor = base_map[idx] ^ tmap[idx]
                del tmap
                dsize = diff.stat().st_size
                dbuf = np.empty(dsize, dtype=np.uint8)
                ts: dict[str, list[float]] = {
                    "memcpy_s": [],
                    "sparse_floor_s": [],
                    "today_s": [],
                    "sparse_s": [],
                    "sparse_cold_s": [],
                    "memcpy_cpu_s": [],
                    "sparse_floor_cpu_s": [],
                    "sparse_cpu_s": [],
                    "sparse_numpy_s": [],
                    "sparse_numpy_cpu_s": [],
                }
                written = heap_peak = 0
                o = np.memmap(out, dtype=np.uint8, mode="r+")  # the buffer, mapped once (its pages hot)
                np.copyto(o, base_map)
                for _ in range(a.runs):
                    np.copyto(o, base_map)  # the buffer holds the base (untimed)
                    t0, c0 = time.perf_counter(), time.process_time()
                    np.copyto(o, base_map)
                    ts["memcpy_s"].append(time.perf_counter() - t0)
                    ts["memcpy_cpu_s"].append(time.process_time() - c0)
                    t0, c0 = time.perf_counter(), time.process_time()
                    np.copyto(dbuf, np.memmap(diff, dtype=np.uint8, mode="r"))
                    o[idx] ^= xor
                    ts["sparse_floor_s"].append(time.perf_counter() - t0)
                    ts["sparse_floor_cpu_s"].append(time.process_time() - c0)
                    np.copyto(o, base_map)
                    t0, c0 = time.perf_counter(), time.process_time()  # the sparse step on the buffer's held mapping
                    sa = sparse_step(o, diff, bh, base_adlers, a.workers, size, base_digests, m)
                    ts["sparse_s"].append(time.perf_counter() - t0)
                    ts["sparse_cpu_s"].append(time.process_time() - c0)
                    written = sa.written
                    assert np.array_equal(o[idx], base_map[idx] ^ xor)
                    np.copyto(o, base_map)
                    t0, c0 = time.perf_counter(), time.process_time()  # the same, numpy path
                    sparse_step(o, diff, bh, base_adlers, a.workers, size, base_digests, m, fused=False)
                    ts["sparse_numpy_s"].append(time.perf_counter() - t0)
                    ts["sparse_numpy_cpu_s"].append(time.process_time() - c0)
                    assert np.array_equal(o[idx], base_map[idx] ^ xor)
                    np.copyto(o, base_map)
                    tracemalloc.start()  # untimed: the step's peak heap (numpy buffers are traced)
                    sparse_step(o, diff, bh, base_adlers, a.workers, size, base_digests, m)
                    heap_peak = max(heap_peak, tracemalloc.get_traced_memory()[1])
                    tracemalloc.stop()
                    np.copyto(o, base_map)
                    o.flush()
                    t0 = time.perf_counter()  # the same through a mapping made for this apply
                    sa = fileops.apply_sparse_file(out, diff, base_adlers, workers=a.workers)
                    touched = sparse.touched_chunks(sa.ranges, size, CHUNK)
                    sparse.check_untouched(touched, base_digests, m.files[0].result_chunks, "model.safetensors")
                    ts["sparse_cold_s"].append(time.perf_counter() - t0)
                    assert fileops.first_mismatch(out, CHUNK, m.files[0].result_chunks) is None
                    t0 = time.perf_counter()
                    fileops.apply_delta_file(bpath, diff, out, "bdn_planes_v1", size, workers=a.workers)
                    diskio.verify_results(m, out.parent)
                    ts["today_s"].append(time.perf_counter() - t0)
                del o
                st = runs.summarize(ts)
                row = {
                    "pattern": pattern,
                    "frac": frac,
                    "fused": fused,
                    "model_bytes": size,
                    "diff_bytes": dsize,
                    "changed_bytes": len(idx),
                    "written_bytes": written,
                    "sparse_heap_peak_bytes": heap_peak,
                    "encode_s": enc_s,
                    **st,
                    **{k: st["median"][k] for k in ts},
                }
                med = st["median"]
                row["sparse_over_floor"] = med["sparse_s"] / med["sparse_floor_s"]
                row["sparse_over_memcpy"] = med["sparse_s"] / med["memcpy_s"]
                row["today_over_floor"] = med["today_s"] / med["sparse_floor_s"]
                row["sparse_cpu_over_floor_cpu"] = med["sparse_cpu_s"] / med["sparse_floor_cpu_s"]
                row["sparse_cpu_over_memcpy_cpu"] = med["sparse_cpu_s"] / med["memcpy_cpu_s"]
                row["sparse_numpy_cpu_over_floor_cpu"] = med["sparse_numpy_cpu_s"] / med["sparse_floor_cpu_s"]
                row["sparse_cold_over_floor"] = med["sparse_cold_s"] / med["sparse_floor_s"]
                rows.append(row)
                print(
                    f"  {pattern:9s} {frac * 100:5.2f} %: diff {dsize / 1e6:7.1f} MB  memcpy "
                    f"{runs.spread(row, 'memcpy_s', 3)} s  floor {runs.spread(row, 'sparse_floor_s', 4)} s  "
                    f"today {runs.spread(row, 'today_s', 3)} s  sparse {runs.spread(row, 'sparse_s', 4)} s  "
                    f"cold map {runs.spread(row, 'sparse_cold_s', 3)} s "
                    f"(sparse = {row['sparse_over_floor']:.1f}x floor, {row['sparse_over_memcpy']:.2f}x memcpy; "
                    f"today = {row['today_over_floor']:.1f}x floor; CPU s: sparse {row['sparse_cpu_over_floor_cpu']:.1f}x "
                    f"floor, {row['sparse_cpu_over_memcpy_cpu']:.2f}x memcpy, numpy path "
                    f"{row['sparse_numpy_cpu_over_floor_cpu']:.1f}x floor; heap peak {heap_peak / 1e6:.0f} MB "
                    f"= {heap_peak / size:.3f} model)",
                    flush=True,
                )
                write(a.out, load0, a.workers, rows)  # after every row: a long run stopped early keeps its rows
    finally:
        shutil.rmtree(work, ignore_errors=True)


def write(out: str, load0: tuple[float, float, float], workers: int, rows: list[dict]) -> None:
    """The result file: the load at the start and now, and the rows so far."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {
                "load_start": load0,
                "load_end": os.getloadavg(),
                "cores": os.cpu_count(),
                "workers": workers,
                "rows": rows,
            },
            indent=1,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
