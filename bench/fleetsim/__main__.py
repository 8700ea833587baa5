"""Run the fleet simulations and write bench/results/fleetsim.json, fleetsim.png and a table.

    .venv/bin/python -m bench.fleetsim [--only validate,n100,n1000,n10000,...] [--seeds 1,2,3] [--merge]

Runs (bench/fleetsim/sim.py, policies from bdn/control; today's daemon: bench/fleetsim/today.py):

- ``validate``: today's daemon model at N = 8, 200 Mbit/s NICs, a 200 Mbit/s bucket, 1 GiB in
  16 MiB chunks (64): bench/swarm measured 80.8 s there (bench/results/swarm.json, the bdn row at
  N = 8, 200 Mbit/s, no fault; floor 43.0 s). The row stores the prediction's error.
- ``nN`` for N in 100, 1,000, 10,000: the fleet policy, 100 Gbit/s NICs, a bucket of 10 GB/s
  aggregate and 100 MB/s per connection, RTT 0.2 ms + up to 0.2 ms jitter, 1 % of the nodes
  killed at half the floor, 5 % joining at a quarter of it; a 700 GB anchor and a 20 GB delta.
  Bytes are real; the chunk count is scaled down (``CHUNKS``: a simulated chunk stands for
  ``chunk_scale`` real 16 MiB chunks) so that a run fits the machine; ``chunks`` runs the same
  N with other counts to show what the scaling costs.
- ``ctlN``: the control plane alone (no chunks): SWIM, hot-load gossip, 5 % joining at 5 s, 1 % killed at 10 s;
  30 s (15 s before the fleet branch: joiners counted by 99 % of the members need ~10 s at N = 1,000).
- ``today-n100``: today's daemon model at N = 100 on the same fleet, for its control rate.

Settings of the fleet runs (the daemon's keys): ``bucket_concurrency`` 32 connections per bucket
reader (so :func:`bdn.control.owners.reader_count` gives ceil(1.5 x 100 / 32) = 5 readers, 160
connections, reader slots); peer set k 16, max 32 (4 reader slots); 16 download slots, 4 per
peer; bdnd's upload admission (bdn.daemon.serve.uploads.Uploads: 8 upload slots, 2 copies of a chunk
at once or half the slots while fewer are busy, cut-through slots of their own; a full holder
answers busy), bdnd's SourceBook per node (bdn.daemon.fetch.policy: refusals penalise a peer for
penalty_s 30, rates rank holders); endgame 4 (bdnd's); a HAVE as soon as a chunk is verified;
SWIM period 1 s; hot-load fanout ceil(ln N) + 3.

Each point: the median over ``--seeds`` runs, with the min and max (``spread``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

from bench.fleetsim.scenario import REAL_CHUNK, Scenario
from bench.fleetsim.sim import FleetSim
from bench.fleetsim.today import TodaySim

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "bench" / "results" / "fleetsim.json"
MEASURED_N8_S = 80.75  # bench/results/swarm.json: bdn, N = 8, 200 Mbit/s NIC and bucket, no fault
GB = 1e9
#: simulated chunks per run (the real snapshot has bytes / 16 MiB; the 20 GB delta 1,192): what fits
#: the machine. The published rows run 128 (``--set chunks=128``): N = 1,000 then takes 193-312
#: CPU-s and 146-236 MB per seed, N = 100 20-29 CPU-s; at 256, 337-401 and 26-31 CPU-s
#: (2026-12-07); the cost per node is about constant in N. At 64 or fewer the first hop out of a reader is what costs
CHUNKS = {100: 256, 1000: 256, 10000: 128}
SNAPSHOTS = {"anchor": 700 * GB, "delta": 20 * GB}
FLEET_DEFAULTS: dict[str, Any] = {
    "serial_reads": True,
    "have_flush_s": 0.0,
    "download_slots": 16,
    "max_per_peer": 4,
    "forward": "cut",
    "endgame_chunks": 4,
}
KEYS = (
    "seconds",
    "x_floor",
    "bucket_egress_over_s",
    "duplicate_bucket_reads",
    "control_msgs_per_node_s_mean",
    "control_msgs_per_node_s_max",
    "peer_state_bytes_per_node_max",
    "member_table_bytes_per_node",
    "hotload_target_spread_s",
    "hotload_done_s",
    "wall_s",
)


def fleet(name: str, n: int, size: float, chunks: int, **kw: Any) -> Scenario:
    kw.setdefault("hotload_fanout", math.ceil(math.log(n)) + 3)
    # bdnd as it runs (docs/decisions/0016, 0028, 0008): one chunk at a time per reader, a
    # HAVE as soon as a chunk is verified, max_inflight 16 and max_per_peer 4 (its defaults),
    # chunks forwarded as their real 16 MiB chunks arrive, cut-through behind bucket reads (the
    # lead's); upload admission and the source book are bdnd's (bdn.daemon.serve.uploads, fetch.policy)
    for k, v in FLEET_DEFAULTS.items():
        kw.setdefault(k, v)
    kw.setdefault("kill_frac", 0.01)  # overridable (--set late_frac=0: the joiners' share of the time)
    kw.setdefault("late_frac", 0.05)
    return Scenario(
        name,
        n,
        size,
        chunks,
        100e9 / 8,
        10 * GB,
        100e6,
        rtt_s=0.0002,
        jitter_s=0.0002,
        policy="fleet",
        bucket_concurrency=32,
        **kw,
    )


def scenarios(only: set[str] | None) -> list[Scenario]:
    out = []
    if not only or "validate" in only:
        out.append(
            Scenario(
                "validate-n8",
                8,
                1073753398,
                64,
                200e6 / 8,
                200e6 / 8,
                0.0,
                rtt_s=0.0005,
                jitter_s=0.0005,
                policy="today",
                wire_payload=1448 / 1514,
            )
        )
    for n, chunks in CHUNKS.items():
        for kind, size in SNAPSHOTS.items():
            if only and f"n{n}" not in only and f"n{n}-{kind}" not in only:
                continue
            out.append(fleet(f"fleet-n{n}-{kind}", n, size, chunks))
    if only and "chunks" in only:  # the scaling's cost: the same fleet, other chunk counts
        for c in (32, 64, 128, 256):
            out.append(fleet(f"chunks-n1000-delta-c{c}", 1000, SNAPSHOTS["delta"], c))
    for n in (100, 1000, 10000):
        if only and f"ctl{n}" not in only:
            continue
        out.append(
            fleet(f"control-n{n}", n, 20 * GB, 1, data=False, min_sim_s=30.0, kill_at_floor=5.0, late_at_floor=2.5)
        )
    if not only or "today-n100" in only:
        out.append(
            Scenario(
                "today-n100-delta",
                100,
                20 * GB,
                256,
                100e9 / 8,
                10 * GB,
                100e6,
                rtt_s=0.0002,
                jitter_s=0.0002,
                policy="today",
                kill_frac=0.01,
                late_frac=0.05,
            )
        )
    return out


def _num(v: str) -> Any:
    try:
        return float(v) if "." in v else int(v)
    except ValueError:
        return v


def run_one(sc: Scenario, timeline: bool = False) -> dict[str, Any]:
    """One run of ``sc``: the simulator's result plus wall and CPU seconds. ``timeline`` (fleet
    runs): also record every chunk arrival and add ``timeline``, the summary of
    :mod:`bench.fleetsim.timeline` (bucket phase end, first/last node done, depth per hop,
    completion percentiles); recording decides nothing, the run is the same."""
    t0 = time.perf_counter()
    c0 = time.process_time()
    sim = (TodaySim if sc.policy == "today" else FleetSim)(sc)
    if timeline:
        sim.arrivals = []
    r = sim.run()
    if timeline and sim.arrivals is not None:
        from bench.fleetsim.timeline import analyse, last_nodes

        r["timeline"] = analyse(sim.arrivals, sc.floor_s, sc.chunk_bytes) | last_nodes(sim, sim.arrivals)
    r["name"] = sc.name
    r["wall_s"] = round(time.perf_counter() - t0, 1)
    r["cpu_s"] = round(time.process_time() - c0, 1)
    r["chunk_scale"] = round(sc.snapshot_bytes / REAL_CHUNK / sc.chunks, 1)
    if sc.name == "validate-n8" and r["seconds"]:
        r["measured_s"] = MEASURED_N8_S
        r["error"] = round(r["seconds"] / MEASURED_N8_S - 1, 4)
    return r


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row: the median run's fields, each key of KEYS as the median, plus min/max spread."""
    row = dict(sorted(runs, key=lambda r: (r["seconds"] is None, r["seconds"] or 0))[len(runs) // 2])
    row["seeds"] = [r["scenario"]["seed"] for r in runs]
    row["spread"] = {}
    for k in KEYS:
        vals = [r[k] for r in runs if r.get(k) is not None]
        if len(vals) == len(runs) and vals:
            row[k] = round(statistics.median(vals), 4)
            row["spread"][k] = [min(vals), max(vals)]
    if row.get("seconds") is not None and row.get("measured_s"):
        row["error"] = round(row["seconds"] / row["measured_s"] - 1, 4)
    row["runs"] = [
        {k: r.get(k) for k in KEYS + ("cpu_s",)}
        | {"seed": r["scenario"]["seed"]}
        | ({"timeline": r["timeline"]} if "timeline" in r else {})
        for r in runs
    ]
    return row


#: Fields of a row that are the same for every seed of a run (settings, not results).
SETTINGS = ("name", "scenario", "floor_s", "chunk_scale", "readers", "bucket_connections")


def split_seeds(row: dict[str, Any]) -> list[dict[str, Any]]:
    """A row of several seeds (a published row) as single-seed rows, one per entry of its
    ``runs``, so that :func:`combine` can add seeds to it. The row's other fields are its
    median run's (``row["scenario"]["seed"]``): that seed's row gets them all; the others get
    only :data:`SETTINGS` and their own :data:`KEYS` (their other results were not stored)."""
    if len(row.get("seeds", [])) <= 1:
        return [row]
    out = []
    for run in row["runs"]:
        seed = run["seed"]
        if seed == row["scenario"]["seed"]:
            base = {k: v for k, v in row.items() if k not in ("spread", "runs", "code")}
        else:
            base = {k: row[k] for k in SETTINGS if k in row}
        r = base | {k: run.get(k) for k in KEYS + ("cpu_s",)}
        r |= {"scenario": {**row["scenario"], "seed": seed}, "seeds": [seed]}
        out.append(r | ({"timeline": run["timeline"]} if "timeline" in run else {}))
    return out


def combine(files: list[Path], out: Path, code: str = "") -> None:
    """Rows of one name from several result files (one seed each, from parallel processes,
    or a row of several seeds: :func:`split_seeds`) become one row over all their seeds; the
    rows are merged into ``out``."""
    by_name: dict[str, list[dict[str, Any]]] = {}
    for f in files:
        for row in json.loads(f.read_text()):
            for r in split_seeds(row):
                by_name.setdefault(r["name"], []).append(r)
    rows = json.loads(out.read_text()) if out.exists() else []
    for name, rs in by_name.items():
        if len(rs) == 1:
            row = rs[0]
        else:
            seeds = [r["scenario"]["seed"] for r in rs]
            if len(set(seeds)) != len(seeds):
                raise SystemExit(f"{name}: seed given twice ({sorted(seeds)})")
            row = summarise(rs)
        if code:
            row["code"] = code
        rows = [x for x in rows if x["name"] != name] + [row]
        print(f"{name}: seeds {row.get('seeds')}, x floor {row.get('x_floor')} {row.get('spread', {}).get('x_floor')}")
    order = {s.name: i for i, s in enumerate(scenarios(None))}
    rows.sort(key=lambda r: order.get(r["name"], 99))
    out.write_text(json.dumps(rows, indent=1) + "\n")


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| run | N | S | chunks (x real) | seeds | seconds | floor s | x floor (min-max) | egress / S | dup reads "
        "| ctrl msg/node/s mean | max | peer state B/node | member table B/node | target spread s | wall s |"
    )
    lines = [head, "|" + "---|" * 16]
    for r in rows:
        sc = r["scenario"]
        sp = r.get("spread", {}).get("x_floor")
        xf = f"{r['x_floor']}" + (f" ({sp[0]}-{sp[1]})" if sp and len(r.get("seeds", [])) > 1 else "")
        lines.append(
            f"| {r['name']} | {sc['n']} | {sc['snapshot_bytes'] / GB:g} GB | {sc['chunks']} ({r['chunk_scale']:g}) "
            f"| {len(r.get('seeds', [1]))} | {r['seconds']} | {r['floor_s']} | {xf} | {r['bucket_egress_over_s']} "
            f"| {r['duplicate_bucket_reads']} | {r['control_msgs_per_node_s_mean']} | {r['control_msgs_per_node_s_max']} "
            f"| {r['peer_state_bytes_per_node_max']} | {r['member_table_bytes_per_node']} "
            f"| {r['hotload_target_spread_s']} | {r['wall_s']} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for kind in SNAPSHOTS:
        pts = sorted(
            (r["scenario"]["n"], r) for r in rows if r["name"].startswith("fleet-") and r["name"].endswith(kind)
        )
        if not pts:
            continue
        ns = [n for n, _ in pts]
        a.plot(ns, [r["x_floor"] for _, r in pts], marker="o", label=kind)
        b.plot(ns, [r["control_msgs_per_node_s_mean"] for _, r in pts], marker="o", label=f"{kind} mean")
        b.plot(ns, [r["control_msgs_per_node_s_max"] for _, r in pts], marker="x", ls="--", label=f"{kind} max")
    ctl = sorted((r["scenario"]["n"], r) for r in rows if r["name"].startswith("control-"))
    if ctl:  # membership + hot-load alone, the control plane's own cost
        b.plot(
            [n for n, _ in ctl],
            [r["control_msgs_per_node_s_mean"] for _, r in ctl],
            marker="s",
            label="control only mean",
        )
        b.plot(
            [n for n, _ in ctl],
            [r["control_msgs_per_node_s_max"] for _, r in ctl],
            marker="+",
            ls="--",
            label="control only max",
        )
    a.axhline(1.15, color="grey", ls=":", label="target 1.15")
    for ax in (a, b):
        ax.set_xscale("log")
        ax.set_xlabel("nodes")
        ax.legend(fontsize=7)
    a.set_ylabel("last node done / floor")
    b.set_ylabel("control messages per node per s")
    fig.suptitle("bench/fleetsim: bdn/control policies, 100 Gbit/s NICs, 10 GB/s bucket")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--only", default="", help="comma-separated: validate, n100, n1000, ctl100, ctl1000, ctl10000, today-n100"
    )
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--merge", action="store_true", help="keep rows of --out not re-run")
    ap.add_argument("--seeds", default="1,2,3", help="comma-separated seeds; each point is their median")
    ap.add_argument("--report-only", action="store_true", help="run nothing: the table and plot of --out")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a Scenario field for every run (numbers or words), e.g. --set forward=real",
    )
    ap.add_argument(
        "--timeline", action="store_true", help="also store each run's chunk-arrival summary (bench.fleetsim.timeline)"
    )
    ap.add_argument("--tag", default="", help="appended to each run's name (rows of other settings side by side)")
    ap.add_argument(
        "--combine",
        nargs="+",
        type=Path,
        default=[],
        metavar="FILE",
        help="run nothing: the rows of these --out files (one process per seed), rows of one name "
        "summarised together (median and spread over their seeds), merged into --out",
    )
    ap.add_argument(
        "--code", default="", help="with --combine: the 'code' note of the combined rows (which commit ran)"
    )
    args = ap.parse_args()
    if args.combine:
        combine(args.combine, args.out, args.code)
        return
    over = {k: _num(v) for k, v in (x.split("=", 1) for x in args.set)}
    if args.report_only:
        only = {"-"}
    if not args.report_only:
        only = {x for x in args.only.split(",") if x} or None
    rows: list[dict[str, Any]] = []
    if (args.merge or args.report_only) and args.out.exists():
        rows = json.loads(args.out.read_text())
    seeds = [int(x) for x in args.seeds.split(",") if x]
    for sc in scenarios(only):
        for k, v in over.items():
            setattr(sc, k, v)
        sc.name += args.tag
        runs = []
        for seed in seeds:
            sc.seed = seed
            runs.append(run_one(Scenario(**{**sc.__dict__}), args.timeline))
            print(json.dumps({k: v for k, v in runs[-1].items() if k != "scenario"}), flush=True)
        r = summarise(runs)
        rows = [x for x in rows if x["name"] != sc.name] + [r]
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
    order = {s.name: i for i, s in enumerate(scenarios(None))}
    rows.sort(key=lambda r: order.get(r["name"], 99))
    args.out.write_text(json.dumps(rows, indent=1) + "\n")
    print(table(rows))
    if plot(rows, args.out.with_suffix(".png")):
        print(f"plot: {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
