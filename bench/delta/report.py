"""Markdown tables for BENCHMARKS.md from bench/results/{delta,handoff,apply_speed}.json.

    .venv/bin/python -m bench.delta.report [--quick]

Cells measured more than once print ``median (min–max)`` (``bench/runs.py``); each table's caption
says how many runs it stands for. ``--quick`` reads the ``*.quick.json`` files instead.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench import runs

R = Path("bench/results")


def delta_table(path: Path) -> str:
    data = json.loads(path.read_text())
    rows = data["rows"]
    out = ["| input | changed | codec | threads | stored MB | ratio | vs arc_v2 (bdn) | encode GB/s | decode GB/s |",
           "|---|---|---|---|---|---|---|---|---|"]
    arc = {(r["input"], r["changed_fraction"]): r["bytes"] for r in rows if r["codec"] == "arc_v2 (bdn)" and r["bytes"]}
    for r in rows:
        key = (r["input"], r["changed_fraction"])
        if r["bytes"] is None:
            out.append(f"| {r['input']} | {r['changed_fraction']:.2%} | {r['codec']} | {r['threads']} | "
                       f"{r.get('error', 'failed')} | | | | |")
            continue
        rel = f"{arc[key] / r['bytes']:.2f}x" if key in arc else ""
        enc = runs.spread(r, "encode_gbps") if r["encode_gbps"] is not None else "—"
        dec = runs.spread(r, "decode_gbps") if r["decode_gbps"] is not None else "—"
        out.append(f"| {r['input']} | {r['changed_fraction']:.2%} | {r['codec']} | {r['threads'] or '—'} | "
                   f"{r['bytes'] / 1e6:.3f} | {r['raw_bytes'] / r['bytes']:.1f} | {rel} | {enc} | {dec} |")
    timed = [r for r in rows if r.get("decode_gbps") is not None]
    out.append(f"\nGB/s: {runs.runs_label(timed, 'decode_gbps')}; sizes are exact.")
    return "\n".join(out)


def handoff_table(path: Path) -> str:
    rows = json.loads(path.read_text())["rows"]
    out = ["| method | GB | seconds | ms per GB | GB/s | vs memcpy |", "|---|---|---|---|---|---|"]
    for r in rows:
        gb = r["bytes"] / 1e9
        out.append(f"| {r['method']} | {gb:.2f} | {runs.spread(r, 'seconds', 4)} | "
                   f"{runs.spread(r, 'seconds', 1, 1e3 / gb)} | {r['gbps']:.2f} | {r['gbps'] / r['memcpy_gbps']:.2f}x |")
    out.append(f"\nseconds and ms per GB: {runs.runs_label(rows, 'seconds')}; GB/s and vs memcpy from the median.")
    return "\n".join(out)


def apply_table(path: Path) -> str:
    rows = json.loads(path.read_text())
    out = ["| input | MB | workers | before (6196018) GB/s | after GB/s | speed-up |", "|---|---|---|---|---|---|"]
    by = {(r["input"], r["workers"], r.get("impl")): r for r in rows}
    for (inp, w, impl), r in by.items():
        if impl != "now" or (inp, w, "baseline") not in by:
            continue
        b = by[(inp, w, "baseline")]
        out.append(f"| {inp} | {r['raw_bytes'] / 1e6:.0f} | {w} | {b['decode_gbps']:.2f} | {r['decode_gbps']:.2f} | "
                   f"{r['decode_gbps'] / b['decode_gbps']:.2f}x |")
    return "\n".join(out)


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="BENCHMARKS.md tables from bench/results")
    ap.add_argument("--quick", action="store_true", help="the --quick results (delta.quick.json, handoff.quick.json)")
    a = ap.parse_args()
    sfx = ".quick.json" if a.quick else ".json"
    for name, fn in (("apply_speed.json", apply_table), ("delta" + sfx, delta_table), ("handoff" + sfx, handoff_table)):
        if (R / name).exists():
            print(f"\n### {name}\n\n{fn(R / name)}")


if __name__ == "__main__":
    main()
