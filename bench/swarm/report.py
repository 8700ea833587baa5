"""Turn bench/results/swarm.json into the plot (bench/results/swarm.png) and a Markdown table.

    .venv/bin/python -m bench.swarm.report [--json bench/results/swarm.json] [--all] [--profiles]

Prints BENCHMARKS.md's table (bdn, libtorrent and boto3 per point), then with ``--all`` every
row with every column (per-node bytes, CPU), then the loopback ceiling rows.

Rows measured more than once (``run.py --runs N``) print ``median (min–max)`` for seconds and
bucket egress (bench/runs.py); the table's caption says how many runs it stands for.

``--profiles`` also prints the hottest frames (self time) of each py-spy profile that
``run.py --profile`` left in bench/swarm/profiles/.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path
from typing import Any

from bench import runs
from bench.swarm.run import row_key

REPO = Path(__file__).resolve().parents[2]


def main_rows(rows: list[dict[str, Any]], bucket_mbit: float | None) -> list[dict[str, Any]]:
    return [
        r
        for r in rows
        if r.get("nic_mbit") and r.get("fault") is None and (bucket_mbit is None or r.get("bucket_mbit") == bucket_mbit)
    ]


def plot(rows: list[dict[str, Any]], out: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib not installed: {out} not drawn (pip install matplotlib)", file=sys.stderr)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = min((r["bucket_mbit"] for r in rows if r.get("bucket_mbit")), default=None)
    rs = main_rows(rows, base)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = {"bdn": "o-", "boto3": "s--", "libtorrent": "^-."}
    # the same daemon before a change (system "bdn@<rev>"): same marker, thinner dotted line
    styles.update({s: "o:" for s in {r["system"] for r in rs} if s.startswith("bdn@")})
    for system in sorted({r["system"] for r in rs}, key=lambda s: (s not in styles, s)):
        pts = sorted((r["nodes"], r["seconds"]) for r in rs if r["system"] == system and r["seconds"])
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], styles.get(system, "x:"), label=system)
    ns = sorted({r["nodes"] for r in rs})
    if rs:
        fl = rs[0]["floor_seconds"]
        ax.plot(ns, [fl] * len(ns), "k:", label="floor S / NIC")
        ax.set_title(
            f"{rs[0]['snapshot_bytes'] / 2**30:.2f} GiB snapshot, NIC {rs[0]['nic_mbit']:g} Mbit/s, "
            f"bucket {base:g} Mbit/s"
        )
    ax.set_xlabel("nodes N")
    ax.set_ylabel("seconds until the last node holds the verified snapshot")
    ax.set_xticks(ns)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def fmt(x: Any, nd: int = 2) -> str:
    return "–" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def table(rows: list[dict[str, Any]]) -> str:
    swarm = [r for r in rows if r.get("nic_mbit")]
    # one block per (bucket rate, fault), by N; before/after rows of a system next to each other
    order = {"bdn": 0, "boto3": 2, "libtorrent": 3}
    swarm.sort(
        key=lambda r: (
            r.get("bucket_mbit") or 0,
            r.get("fault") or "",
            r["nodes"],
            order.get(r["system"], 1 if r["system"].startswith("bdn") else 4),
            r["system"],
        )
    )
    by = {(r["system"], r["nodes"], r.get("bucket_mbit"), r.get("fault")): r for r in swarm}
    out = [
        "| system | N | bucket Mbit/s | fault | seconds | floor s | ×floor | bucket egress / S "
        "| bucket wire / S | per node recv MB (min–max) | per node sent MB (min–max) | own CPU-s / machine busy CPU-s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in swarm:
        S = r["snapshot_bytes"]
        pn = r.get("per_node") or {}
        recv = [v["received_wire"] / 1e6 for v in pn.values()]
        sent = [v["sent_wire"] / 1e6 for v in pn.values()]
        out.append(
            "| "
            + " | ".join(
                [
                    r["system"],
                    str(r["nodes"]),
                    fmt(r.get("bucket_mbit"), 0),
                    r.get("fault") or "",
                    runs.spread(r, "seconds", 1),
                    fmt(r["floor_seconds"], 1),
                    fmt(r["seconds"] / r["floor_seconds"] if r["seconds"] else None),
                    runs.spread(r, "bucket_egress_bytes", 3, 1 / S),
                    fmt(r["bucket_wire_bytes"] / S if r.get("bucket_wire_bytes") is not None else None, 3),
                    f"{min(recv):.0f}–{max(recv):.0f}" if recv else "–",
                    f"{min(sent):.0f}–{max(sent):.0f}" if sent else "–",
                    f"{fmt(r.get('own_cpu_s'), 1)} / {fmt(r.get('machine_busy_cpu_s'), 1)}",
                ]
            )
            + " |"
        )
    out.append("")
    out.append(
        f"seconds and bucket egress: {runs.runs_label(swarm, 'seconds')}; ratios and the other "
        "columns are of the median run."
    )
    out.append("")
    out.append("| ratio | N | value |")
    out.append("|---|---|---|")
    for (system, n, bm, fault), r in sorted(
        by.items(), key=lambda kv: (kv[0][1], kv[0][2] or 0, kv[0][3] or "", kv[0][0])
    ):
        if not (system == "bdn" or system.startswith("bdn@")) or not r["seconds"]:
            continue
        where = f"{n} (bucket {bm:g}{', ' + fault if fault else ''})"
        line = [f"| {system}/floor | {where} | {r['seconds'] / r['floor_seconds']:.2f} |"]
        others = ["boto3", "libtorrent"] if not fault else ["libtorrent"]
        # before/after: the current daemon against each earlier one measured at the same point
        if system == "bdn":
            others += sorted(k[0] for k in by if k[0].startswith("bdn@") and k[1:] == (n, bm, fault))
        for other in others:
            o = by.get((other, n, bm, fault))
            if o and o["seconds"]:
                line.append(f"| {system}/{other} | {where} | {r['seconds'] / o['seconds']:.2f} |")
        out.extend(line)
    return "\n".join(out)


def user_table(rows: list[dict[str, Any]]) -> str:
    """BENCHMARKS.md's swarm table: one line per point, bdn against boto3 and libtorrent.

    Only the current systems (``bdn``, ``bdn-recycled`` when the file has it, ``boto3``,
    ``libtorrent``); rows of earlier daemons (``bdn@<rev>``) and tuning variants (``bdn[...]``)
    are history, not the current table. A point shows when bdn or bdn-recycled measured it.
    """
    systems = ("bdn", "bdn-recycled", "boto3", "libtorrent")
    by = {row_key(r): r for r in rows if r["system"] in systems and r.get("nic_mbit")}
    recycled = any(k[0] == "bdn-recycled" for k in by)
    points = sorted({k[1:] for k in by}, key=lambda p: (p[1] or 0, p[2] or "", p[0]))
    head = "| N | bucket Mbit/s | fault | bdn s | ×floor | bucket egress / S |"
    if recycled:
        head += " bdn, recycled pages s | ×floor | bucket egress / S |"
    out = [head + " libtorrent s | boto3 s | floor s |", "|" + "---|" * head.count("|") + "---|---|---|"]
    out[1] = "|" + "---|" * (out[0].count("|") - 1)
    shown = []

    def cells(r: dict[str, Any] | None) -> list[str]:
        if r is None:
            return ["–", "–", "–"]
        shown.append(r)
        return [
            runs.spread(r, "seconds", 1),
            fmt(r["seconds"] / r["floor_seconds"] if r.get("seconds") else None, 3),
            runs.spread(r, "bucket_egress_bytes", 3, 1 / r["snapshot_bytes"]),
        ]

    for n, bm, fault in points:
        b, rb, lt, bo = (by.get((s, n, bm, fault)) for s in systems[:2] + ("libtorrent", "boto3"))
        if b is None and rb is None:
            continue
        fl = (b or rb)["floor_seconds"]
        line = [str(n), fmt(bm, 0), fault or "", *cells(b)]
        if recycled:
            line += cells(rb)
        line += [runs.spread(lt, "seconds", 1) if lt else "–", runs.spread(bo, "seconds", 1) if bo else "–", fmt(fl, 1)]
        out.append("| " + " | ".join(line) + " |")
    out.append("")
    out.append(f"bdn: {runs.runs_label(shown, 'seconds')}.")
    return "\n".join(out)


def profiles(d: Path, top: int = 12) -> str:
    out = []
    for f in sorted(d.glob("*.collapsed")):
        self_t: collections.Counter[str] = collections.Counter()
        incl: collections.Counter[str] = collections.Counter()
        total = 0
        for line in f.read_text().splitlines():
            stack, _, n = line.rpartition(" ")
            if not stack or not n.isdigit():
                continue
            c = int(n)
            total += c
            frames = stack.split(";")
            self_t[frames[-1]] += c
            for fr in set(frames):
                incl[fr] += c
        out.append(f"### {f.stem}: {total} samples")
        for fr, c in self_t.most_common(top):
            out.append(f"  self {100 * c / max(1, total):5.1f}%  {fr}")
        out.append("")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=str(REPO / "bench" / "results" / "swarm.json"))
    ap.add_argument("--png", default=str(REPO / "bench" / "results" / "swarm.png"))
    ap.add_argument("--profiles", action="store_true")
    ap.add_argument("--all", action="store_true", help="the full table of every row (every column, every system)")
    a = ap.parse_args()
    rows = json.loads(Path(a.json).read_text())
    plot(rows, Path(a.png))
    print(user_table(rows))
    if a.all:
        print()
        print(table(rows))
    for r in rows:
        if r["system"].split("@")[0] in ("bdn-loopback", "iperf3-loopback", "moto-unshaped-get"):
            print(json.dumps({k: v for k, v in r.items() if k not in ("per_node",)}))
            if r.get("MB_per_s") is not None:
                print(
                    f"  {r['system']}: {runs.spread(r, 'MB_per_s', 0)} MB/s, "
                    f"{runs.spread(r, 'MB_per_cpu_s', 0)} MB per CPU-s ({runs.runs_label([r], 'MB_per_s')})"
                )
    if a.profiles:
        print(profiles(REPO / "bench" / "swarm" / "profiles"))


if __name__ == "__main__":
    main()
