"""Markdown tables for BENCHMARKS.md from bench/results/{delta,planes_speed,handoff,apply_speed}.json.

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
    out = [
        "| input | changed | codec | threads | stored MB | ratio | vs arc_v2 (bdn) | encode GB/s | decode GB/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    arc = {(r["input"], r["changed_fraction"]): r["bytes"] for r in rows if r["codec"] == "arc_v2 (bdn)" and r["bytes"]}
    for r in rows:
        key = (r["input"], r["changed_fraction"])
        if r["bytes"] is None:
            out.append(
                f"| {r['input']} | {r['changed_fraction']:.2%} | {r['codec']} | {r['threads']} | "
                f"{r.get('error', 'failed')} | | | | |"
            )
            continue
        rel = f"{arc[key] / r['bytes']:.2f}x" if key in arc else ""
        enc = runs.spread(r, "encode_gbps") if r["encode_gbps"] is not None else "—"
        dec = runs.spread(r, "decode_gbps") if r["decode_gbps"] is not None else "—"
        out.append(
            f"| {r['input']} | {r['changed_fraction']:.2%} | {r['codec']} | {r['threads'] or '—'} | "
            f"{r['bytes'] / 1e6:.3f} | {r['raw_bytes'] / r['bytes']:.1f} | {rel} | {enc} | {dec} |"
        )
    timed = [r for r in rows if r.get("decode_gbps") is not None]
    out.append(f"\nGB/s: {runs.runs_label(timed, 'decode_gbps')}; sizes are exact.")
    return "\n".join(out)


#: BENCHMARKS.md's size table: the shipped formats and the others, by the names rows carry.
SIZE_CODECS = (
    "entropy floor (xor)",
    "arc_v2 (bdn)",
    "bdn_planes_v1 (bdn)",
    "arc_v2 (fireworks)",
    "sparse+zstd (TRL layout)",
    "zipnn(xor)",
)


def size_table(path: Path, *more: Path) -> str:
    """Stored MB per input and codec, and how many times smaller than arc_v2.

    The inputs are ``path``'s; a cell ``path`` lacks is taken from ``more`` (results of the same
    input from another run: sizes are exact, so they agree) and marked ``¹`` with the file named.
    """
    rows = json.loads(path.read_text())["rows"]
    inputs = list(dict.fromkeys((r["input"], r["changed_fraction"], r["raw_bytes"]) for r in rows))
    size = {(r["input"], r["changed_fraction"], r["codec"]): (r["bytes"], "") for r in rows if r.get("bytes")}
    borrowed = []
    for m in more:
        if not m.exists():
            continue
        for r in json.loads(m.read_text())["rows"]:
            key = (r["input"], r["changed_fraction"], r["codec"])
            if r.get("bytes") and key not in size:
                size[key] = (r["bytes"], "¹")
                borrowed.append(m.name)
    head = " | ".join(c.replace(" (bdn)", "") for c in SIZE_CODECS)
    out = [f"| input | changed | MB | {head} |", "|---|---|---|" + "---|" * len(SIZE_CODECS)]
    for inp, frac, raw in inputs:
        arc = size.get((inp, frac, "arc_v2 (bdn)"), (None, ""))[0]
        cells = []
        for c in SIZE_CODECS:
            b, mark = size.get((inp, frac, c), (None, ""))
            if b is None:
                cells.append("not measured yet")
            elif c == "arc_v2 (bdn)" or arc is None:
                cells.append(f"{b / 1e6:.3f}{mark}")
            else:
                cells.append(f"{b / 1e6:.3f} ({arc / b:.2f}×){mark}")
        out.append(f"| {inp} | {frac:.2%} | {raw / 1e6:.0f} | " + " | ".join(cells) + " |")
    out.append("\nStored MB (× = how many times smaller than arc_v2); sizes are exact and the same in every run.")
    if borrowed:
        out.append(f"¹ the same input measured in {', '.join(sorted(set(borrowed)))}.")
    return "\n".join(out)


def planes_table(path: Path) -> str:
    """bdn_planes_v1 against arc_v2, applied as bdnd applies a delta (bench.delta.planes_speed)."""
    rows = json.loads(path.read_text())["rows"]
    by = {(r["input"], r["threads"], r["codec"]): r for r in rows}
    out = ["| input | MB | threads | arc_v2 GB/s | bdn_planes_v1 GB/s |", "|---|---|---|---|---|"]
    for (inp, th, codec), r in by.items():
        if codec != "arc_v2" or (inp, th, "bdn_planes_v1") not in by:
            continue
        p = by[(inp, th, "bdn_planes_v1")]
        out.append(f"| {inp} | {r['raw_bytes'] / 1e6:.0f} | {th} | {_apply_gbps(r)} | {_apply_gbps(p)} |")
    n = {r.get("repeat") for r in rows}
    out.append(
        f"\nGB/s of rebuilt bytes, median (min–max) of {', '.join(str(x) for x in sorted(n - {None}))} runs"
        " (files written before --runs give the median and, in brackets, the best)."
    )
    return "\n".join(out)


def _apply_gbps(r: dict) -> str:
    if "median" in r:
        return runs.spread(r, "decode_gbps")
    return f"{r['decode_gbps_median']:.2f} (best {r['decode_gbps_best']:.2f})"


def handoff_table(path: Path) -> str:
    rows = json.loads(path.read_text())["rows"]
    out = ["| method | GB | seconds | ms per GB | GB/s | vs memcpy |", "|---|---|---|---|---|---|"]
    for r in rows:
        gb = r["bytes"] / 1e9
        out.append(
            f"| {r['method']} | {gb:.2f} | {runs.spread(r, 'seconds', 4)} | "
            f"{runs.spread(r, 'seconds', 1, 1e3 / gb)} | {r['gbps']:.2f} | {r['gbps'] / r['memcpy_gbps']:.2f}x |"
        )
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
        out.append(
            f"| {inp} | {r['raw_bytes'] / 1e6:.0f} | {w} | {b['decode_gbps']:.2f} | {r['decode_gbps']:.2f} | "
            f"{r['decode_gbps'] / b['decode_gbps']:.2f}x |"
        )
    return "\n".join(out)


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="BENCHMARKS.md tables from bench/results")
    ap.add_argument("--quick", action="store_true", help="the --quick results (delta.quick.json, handoff.quick.json)")
    a = ap.parse_args()
    sfx = ".quick.json" if a.quick else ".json"
    if not a.quick and (R / "delta.0.5gb.json").exists():
        print(f"\n### delta.0.5gb.json (size_table)\n\n{size_table(R / 'delta.0.5gb.json', R / 'delta.quick.json')}")
    for name, fn in (
        ("delta" + sfx, size_table),
        ("handoff" + sfx, handoff_table),
        ("delta" + sfx, delta_table),
        ("apply_speed.json", apply_table),
    ):
        if (R / name).exists():
            print(f"\n### {name} ({fn.__name__})\n\n{fn(R / name)}")
    for p in sorted(R.glob("planes_speed*.json")):
        print(f"\n### {p.name} (planes_table)\n\n{planes_table(p)}")


if __name__ == "__main__":
    main()
