"""Run the fleet simulations and write bench/results/fleetsim.json, fleetsim.png and a table.

    .venv/bin/python -m bench.fleetsim [--only validate,n100,n1000,n10000] [--out PATH] [--merge]

Runs (bench/fleetsim/sim.py, policies from bdn/control):

- ``validate``: today's daemon model at N = 8, 200 Mbit/s NICs, a 200 Mbit/s bucket, 1 GiB in
  16 MiB chunks (64): bench/swarm measured 80.8 s there (bench/results/swarm.json, the bdn row at
  N = 8, 200 Mbit/s, no fault; floor 43.0 s). The row stores the prediction's error.
- ``nN`` for N in 100, 1,000, 10,000: the fleet policy, 100 Gbit/s NICs, a bucket of 10 GB/s
  aggregate and 100 MB/s per connection, RTT 0.2 ms + up to 0.2 ms jitter, 1 % of the nodes
  killed at half the floor, 5 % joining at a quarter of it; a 700 GB anchor and a 20 GB delta.
  The bytes are real; the chunk count is scaled down (``CHUNKS``) so that a run stays within a
  few minutes on one core; each row says by how much (``chunk_scale``).
- ``today-n100``: today's daemon model at N = 100 on the same fleet, for its control rate.

Each row: time until the last live node holds the snapshot and its ratio to the floor
(``S / min(NIC, bucket)``), bucket egress / S, duplicate bucket reads, control messages per
node per second (mean and max over live nodes: SWIM, BITFIELD, HAVE, hot-load pushes, sent
plus received), control state per node, hot-load target spread and completion times.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from bench.fleetsim.sim import REAL_CHUNK, FleetSim, Scenario

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "bench" / "results" / "fleetsim.json"
MEASURED_N8_S = 80.75  # bench/results/swarm.json: bdn, N = 8, 200 Mbit/s NIC and bucket, no fault
GB = 1e9
#: simulated chunks per run (the real snapshot has bytes / 16 MiB): what fits a few minutes
CHUNKS = {100: 128, 1000: 32}
SNAPSHOTS = {"anchor": 700 * GB, "delta": 20 * GB}


def scenarios(only: set[str] | None) -> list[Scenario]:
    out = []
    if not only or "validate" in only:
        out.append(Scenario("validate-n8", 8, 1073753398, 64, 200e6 / 8, 200e6 / 8, 0.0,
                            rtt_s=0.0005, jitter_s=0.0005, policy="today"))
    for n, chunks in CHUNKS.items():
        if only and f"n{n}" not in only:
            continue
        for kind, size in SNAPSHOTS.items():
            out.append(Scenario(f"fleet-n{n}-{kind}", n, size, chunks, 100e9 / 8, 10 * GB, 100e6,
                                rtt_s=0.0002, jitter_s=0.0002, policy="fleet", kill_frac=0.01, late_frac=0.05))
    for n in (100, 1000, 10000):
        if only and f"ctl{n}" not in only:
            continue
        # the control plane alone (no chunks): SWIM, hot-load gossip, joins and deaths, 30 s
        out.append(Scenario(f"control-n{n}", n, 20 * GB, 1, 100e9 / 8, 10 * GB, 100e6, rtt_s=0.0002,
                            jitter_s=0.0002, policy="fleet", kill_frac=0.01, late_frac=0.05, data=False,
                            min_sim_s=30.0, kill_at_floor=5.0, late_at_floor=2.5))
    if not only or "today-n100" in only:
        out.append(Scenario("today-n100-delta", 100, 20 * GB, 256, 100e9 / 8, 10 * GB, 100e6,
                            rtt_s=0.0002, jitter_s=0.0002, policy="today", kill_frac=0.01, late_frac=0.05))
    return out


def run_one(sc: Scenario) -> dict[str, Any]:
    t0 = time.perf_counter()
    r = FleetSim(sc).run()
    r["name"] = sc.name
    r["wall_s"] = round(time.perf_counter() - t0, 1)
    r["chunk_scale"] = round(sc.snapshot_bytes / REAL_CHUNK / sc.chunks, 1)
    if sc.name == "validate-n8" and r["seconds"]:
        r["measured_s"] = MEASURED_N8_S
        r["error"] = round(r["seconds"] / MEASURED_N8_S - 1, 4)
    return r


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| run | N | S | chunks (x real) | seconds | floor s | x floor | egress / S | dup reads "
            "| ctrl msg/node/s mean | max | peer state B/node | member table B/node | target spread s | wall s |")
    lines = [head, "|" + "---|" * 15]
    for r in rows:
        sc = r["scenario"]
        lines.append(
            f"| {r['name']} | {sc['n']} | {sc['snapshot_bytes'] / GB:g} GB | {sc['chunks']} ({r['chunk_scale']:g}) "
            f"| {r['seconds']} | {r['floor_s']} | {r['x_floor']} | {r['bucket_egress_over_s']} "
            f"| {r['duplicate_bucket_reads']} | {r['control_msgs_per_node_s_mean']} | {r['control_msgs_per_node_s_max']} "
            f"| {r['peer_state_bytes_per_node_max']} | {r['member_table_bytes_per_node']} "
            f"| {r['hotload_target_spread_s']} | {r['wall_s']} |")
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
        pts = sorted((r["scenario"]["n"], r) for r in rows if r["name"].startswith("fleet-") and r["name"].endswith(kind))
        if not pts:
            continue
        ns = [n for n, _ in pts]
        a.plot(ns, [r["x_floor"] for _, r in pts], marker="o", label=kind)
        b.plot(ns, [r["control_msgs_per_node_s_mean"] for _, r in pts], marker="o", label=f"{kind} mean")
        b.plot(ns, [r["control_msgs_per_node_s_max"] for _, r in pts], marker="x", ls="--", label=f"{kind} max")
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
    ap.add_argument("--only", default="", help="comma-separated: validate, n100, n1000, ctl100, ctl1000, ctl10000, today-n100")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--merge", action="store_true", help="keep rows of --out not re-run")
    args = ap.parse_args()
    only = {x for x in args.only.split(",") if x} or None
    rows: list[dict[str, Any]] = []
    if args.merge and args.out.exists():
        rows = json.loads(args.out.read_text())
    for sc in scenarios(only):
        r = run_one(sc)
        rows = [x for x in rows if x["name"] != sc.name] + [r]
        print(json.dumps({k: v for k, v in r.items() if k != "scenario"}), flush=True)
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
