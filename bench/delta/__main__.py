"""Delta formats side by side: size, encode and decode GB/s, and the entropy floor of each delta.

    .venv/bin/python -m bench.delta [--quick] [--size-gb 2] [--runs 3]

``--quick``: MiniLM (demo step, 2%) and a 0.2 GB synthetic at 2% only (< 2 minutes). Full: MiniLM,
a ``--size-gb`` synthetic bf16 checkpoint at 0.5%, 2% and 10% changed values, and (with torch)
two real AdamW fine-tuning steps. Every codec and thread count is run ``--runs`` times (each run in
a fresh child process); rows keep ``encode_gbps``/``decode_gbps`` as the medians and ``runs``,
``median``, ``min``, ``max`` of both (``bench/runs.py``); stored sizes are exact and the same in
every run. Writes bench/results/delta.json (``--quick``: delta.quick.json) and the plot beside it.

Entropy floor of a delta, per tensor with n elements of which k changed (summed over tensors):
    H = log2 C(n, k)  +  k * H_emp(new values at the changed positions)
where H_emp is the empirical (plug-in) entropy of the changed elements' new values, in bits. The
row ``entropy floor (xor)`` uses the XOR words instead of the new values (a conditional model
that knows the base, and the smaller of the two).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from bdn.fileops import read_header
from bench import runs
from bench.delta import codecs, inputs

RESULTS = Path("bench/results")


def _h(values: np.ndarray) -> float:
    if values.size == 0:
        return 0.0
    _, counts = np.unique(values, return_counts=True)
    p = counts / values.size
    return float(-(p * np.log2(p)).sum())


def entropy_floor(pair: inputs.Pair) -> tuple[int, int]:
    """(bytes at the floor with new values, bytes at the floor with XOR words)."""
    h = read_header(pair.base)
    base = np.memmap(pair.base, dtype=np.uint8, mode="r")
    tgt = np.memmap(pair.target, dtype=np.uint8, mode="r")
    bits_new = bits_xor = 0.0
    for i in h.tensors.values():
        dt = codecs._elem(i)
        b, t = base[i.start : i.end].view(dt), tgt[i.start : i.end].view(dt)
        nz = np.flatnonzero(b != t)
        n, k = b.size, nz.size
        pos = (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)) / math.log(2)
        bits_new += pos + k * _h(t[nz])
        bits_xor += pos + k * _h(b[nz] ^ t[nz])
    return math.ceil(bits_new / 8), math.ceil(bits_xor / 8)


def pairs(args: argparse.Namespace, work: Path):
    base = inputs.minilm_bf16()
    tgt = inputs.demo_step(base, 0.02, np.random.default_rng(2026))
    yield inputs.write_pair(work, "minilm", base, tgt, inputs.changed_fraction(base, tgt))
    size = 0.2 if args.quick else args.size_gb
    base = inputs.synthetic_base(size)
    name = f"synthetic {size:g}GB"
    for j, frac in enumerate([0.02] if args.quick else [0.005, 0.02, 0.10]):
        tgt = inputs.synthetic_step(base, frac, j + 1)
        yield inputs.write_pair(work, f"{name}@{frac}", base, tgt, inputs.changed_fraction(base, tgt))
        del tgt
    del base
    if args.quick:
        return
    try:
        import torch  # noqa: F401
    except ImportError:
        print("finetune: torch not installed, skipped (pip install torch==2.13.0)")
        return
    states = list(inputs.finetune_states(steps=2))
    for s in range(1, len(states)):
        yield inputs.write_pair(
            work, f"finetune step {s}@", states[s - 1], states[s], inputs.changed_fraction(states[s - 1], states[s])
        )


def run_codec(name: str, pair: inputs.Pair, work: Path, threads: int) -> codecs.Result:
    """One run of one codec, in a forked child: torch, zipnn and glibc keep freed memory, and a
    2 GB input run in one process grew past the machine's 24 GiB."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as one:
        return one.submit(codecs.CODECS[name], pair, work, threads).result()


def main() -> None:
    warnings.filterwarnings("ignore")
    ap = argparse.ArgumentParser(description="delta formats benchmark")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--size-gb", type=float, default=2.0)
    ap.add_argument("--codecs", default=",".join(codecs.CODECS), help="comma-separated codec names")
    runs.add_runs_arg(ap)
    ap.add_argument("--out", help="results file (default bench/results/delta.json, delta.quick.json)")
    ap.add_argument("--plot-only", metavar="JSON", help="redraw the plot of a results file and exit")
    args = ap.parse_args()
    if args.plot_only:
        plot(json.loads(Path(args.plot_only).read_text())["rows"], Path(args.plot_only).with_suffix(".png"))
        return
    cores = os.cpu_count() or 1
    threads = sorted({1, cores})
    print(f"delta benchmark on {cores} cores ({os.uname().machine}), threads {threads}", flush=True)
    rows: list[dict] = []
    out = Path(args.out) if args.out else RESULTS / ("delta.quick.json" if args.quick else "delta.json")
    work = Path(tempfile.mkdtemp(prefix="bdn-bench-delta-"))
    try:
        for pair in pairs(args, work):
            fb, fx = entropy_floor(pair)
            common = {
                "input": pair.input,
                "changed_fraction": round(pair.changed_fraction, 6),
                "raw_bytes": pair.raw_bytes,
            }
            rows.append(
                {
                    **common,
                    "codec": "entropy floor (new values)",
                    "bytes": fb,
                    "encode_gbps": None,
                    "decode_gbps": None,
                    "threads": None,
                }
            )
            rows.append(
                {
                    **common,
                    "codec": "entropy floor (xor)",
                    "bytes": fx,
                    "encode_gbps": None,
                    "decode_gbps": None,
                    "threads": None,
                }
            )
            print(
                f"\n{pair.input} ({pair.raw_bytes / 1e9:.3f} GB, {pair.changed_fraction:.2%} changed): "
                f"floor {fb / 1e6:.3f} MB (xor {fx / 1e6:.3f} MB)",
                flush=True,
            )
            base_size = None
            for name in args.codecs.split(","):
                for th in threads:
                    try:
                        got = [run_codec(name, pair, work, th) for _ in range(args.runs)]
                    except ImportError as e:
                        print(f"  {name:28s} not installed: {e}")
                        rows.append(
                            {
                                **common,
                                "codec": name,
                                "bytes": None,
                                "encode_gbps": None,
                                "decode_gbps": None,
                                "threads": th,
                                "error": f"not installed: {e}",
                            }
                        )
                        break
                    except Exception as e:  # a codec that fails is a row that says so
                        traceback.print_exc(limit=2)
                        rows.append(
                            {
                                **common,
                                "codec": name,
                                "bytes": None,
                                "encode_gbps": None,
                                "decode_gbps": None,
                                "threads": th,
                                "error": str(e)[:200],
                            }
                        )
                        break
                    size = got[0].bytes
                    if any(r.bytes != size for r in got):  # every codec here is deterministic
                        raise AssertionError(f"{name}: stored size differs between runs: {[r.bytes for r in got]}")
                    if name == "arc_v2 (bdn)":
                        base_size = base_size or size
                    stats = runs.summarize(
                        {
                            "encode_gbps": [round(pair.raw_bytes / r.encode_s / 1e9, 3) for r in got],
                            "decode_gbps": [round(pair.raw_bytes / r.decode_s / 1e9, 3) for r in got],
                        }
                    )
                    rows.append(
                        {
                            **common,
                            "codec": name,
                            "bytes": size,
                            "threads": th,
                            "encode_gbps": stats["median"]["encode_gbps"],
                            "decode_gbps": stats["median"]["decode_gbps"],
                            **stats,
                        }
                    )
                    rel = f"  {base_size / size:5.2f}x arc_v2" if base_size else ""
                    print(
                        f"  {name:28s} t={th} {size / 1e6:9.3f} MB  ratio {pair.raw_bytes / size:6.1f}{rel}"
                        f"  enc {runs.spread(rows[-1], 'encode_gbps')}  dec {runs.spread(rows[-1], 'decode_gbps')} GB/s"
                        f"  ({args.runs} run{'s' if args.runs > 1 else ''})",
                        flush=True,
                    )
            for p in work.glob("*.diff"):
                p.unlink()
            pair.target.unlink()
            write(rows, out, cores, args.runs)  # after every input: a run cut short keeps what it measured
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write(rows, out, cores, args.runs)
    print(f"\nwrote {out}")
    plot(rows, out.with_suffix(".png"))


def write(rows: list[dict], out: Path, cores: int, n_runs: int) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "machine": {"cores": cores, "arch": os.uname().machine, "when": time.strftime("%Y-%m-%d")},
                "runs": n_runs,
                "rows": rows,
            },
            indent=1,
        )
        + "\n"
    )


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    cores = max((r["threads"] or 1) for r in rows)
    ins = list(dict.fromkeys(r["input"] + f" {r['changed_fraction']:.1%}" for r in rows))
    names = list(dict.fromkeys(r["codec"] for r in rows))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(14, 5))
    wdt = 0.8 / len(names)
    for j, name in enumerate(names):
        ratio, dec = [], []
        for lab in ins:
            sel = [
                r
                for r in rows
                if r["codec"] == name
                and r["input"] + f" {r['changed_fraction']:.1%}" == lab
                and r["bytes"]
                and r["threads"] in (None, cores)
            ]
            ratio.append(sel[0]["raw_bytes"] / sel[0]["bytes"] if sel else 0)
            dec.append(sel[0]["decode_gbps"] or 0 if sel else 0)
        x = np.arange(len(ins)) + j * wdt
        a1.bar(x, ratio, wdt, label=name, color=f"C{j}")
        if not name.startswith("entropy"):
            a2.bar(x, dec, wdt, label=name, color=f"C{j}")
    for a, t in (
        (a1, "compression ratio (raw / stored), higher is better"),
        (a2, f"decode GB/s of rebuilt bytes, {cores} threads"),
    ):
        a.set_xticks(np.arange(len(ins)) + 0.4 - wdt / 2)
        a.set_xticklabels(ins, rotation=20, ha="right", fontsize=8)
        a.set_title(t, fontsize=10)
    a1.set_yscale("log")
    a1.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
