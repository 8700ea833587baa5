"""Markdown tables for BENCHMARKS.md from bench/results/{delta,handoff,apply_speed}.json.

    .venv/bin/python -m bench.delta.report
"""

from __future__ import annotations

import json
from pathlib import Path

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
        enc = f"{r['encode_gbps']:.2f}" if r["encode_gbps"] is not None else "—"
        dec = f"{r['decode_gbps']:.2f}" if r["decode_gbps"] is not None else "—"
        out.append(f"| {r['input']} | {r['changed_fraction']:.2%} | {r['codec']} | {r['threads'] or '—'} | "
                   f"{r['bytes'] / 1e6:.3f} | {r['raw_bytes'] / r['bytes']:.1f} | {rel} | {enc} | {dec} |")
    return "\n".join(out)


def handoff_table(path: Path) -> str:
    rows = json.loads(path.read_text())["rows"]
    out = ["| method | GB | seconds | ms per GB | GB/s | vs memcpy |", "|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['method']} | {r['bytes'] / 1e9:.2f} | {r['seconds']:.4f} | {r['seconds'] / (r['bytes'] / 1e9) * 1e3:.1f} | "
                   f"{r['gbps']:.2f} | {r['gbps'] / r['memcpy_gbps']:.2f}x |")
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


if __name__ == "__main__":
    for name, fn in (("apply_speed.json", apply_table), ("delta.json", delta_table), ("handoff.json", handoff_table)):
        if (R / name).exists():
            print(f"\n### {name}\n\n{fn(R / name)}")
