"""Where a fleet run's time goes: a per-hop timeline of one simulation (bench/fleetsim).

    .venv/bin/python -m bench.fleetsim.timeline --n 100 --snapshot delta --chunks 256 [--seed 1]

Records every chunk arrival (time, node, chunk, source: "bucket" or the sending peer) and
reports: when the bucket phase ended (last bucket read), when the first and the last node held
the snapshot, the depth of each arrival (bucket read = 0, a peer's copy = its source's depth + 1),
and per depth the median time from the chunk's bucket read to the arrival. Times in seconds and
as multiples of the floor. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
from typing import Any

import numpy as np

from bench.fleetsim.__main__ import SNAPSHOTS, _num, fleet
from bench.fleetsim.sim import FleetSim


def analyse(arrivals: list[tuple[float, str, int, str]], floor: float, chunk_bytes: float) -> dict[str, Any]:
    """The timeline summary of ``arrivals`` (in time order) for a snapshot of ``floor`` seconds."""
    depth: dict[tuple[str, int], int] = {}
    read_at: dict[int, float] = {}
    by_depth: dict[int, list[float]] = {}
    hop: dict[int, list[float]] = {}
    got_at: dict[tuple[str, int], float] = {}
    for t, node, i, src in arrivals:
        if src == "bucket":
            d = 0
            read_at.setdefault(i, t)
        else:
            d = depth.get((src, i), 0) + 1
            if (src, i) in got_at:
                hop.setdefault(d, []).append(t - got_at[(src, i)])
        depth[(node, i)] = d
        got_at[(node, i)] = t
        if i in read_at:
            by_depth.setdefault(d, []).append(t - read_at[i])
    count: Counter = Counter()
    done: dict[str, float] = {}
    for t, node, _i, _src in arrivals:
        count[node] += 1
        if count[node] == len(read_at):  # a node holding every chunk (killed ones never do)
            done[node] = t
    ds = Counter(depth.values())
    return {
        "floor_s": round(floor, 3),
        "last_bucket_read_s": round(max(read_at.values()), 3) if read_at else None,
        "first_node_done_s": round(min(done.values()), 3) if done else None,
        "last_node_done_s": round(max(done.values()), 3) if done else None,
        "chunk_at_full_nic_s": round(chunk_bytes / 12.5e9, 3),
        "chunk_at_one_of_8_uploads_s": round(chunk_bytes / (12.5e9 / 8), 3),
        "arrivals_by_depth": dict(sorted(ds.items())),
        "median_s_after_bucket_read_by_depth": {d: round(statistics.median(v), 3) for d, v in sorted(by_depth.items())},
        "median_hop_s_by_depth": {d: round(statistics.median(v), 3) for d, v in sorted(hop.items())},
    }


def sample(sim: FleetSim, dt: float, rows: list[dict[str, Any]]) -> None:
    """Every ``dt`` simulated seconds, one row of the fleet's NIC and slot use (see the docstring)."""

    def tick() -> None:
        sc = sim.sc
        live = [x for x in sim.nodes.values() if x.alive and x.ps is not None]
        if live:
            readers = set(sim.owner_map(live[0]).readers) if live[0].omap is not None else set()
            rd = [x for x in live if x.id in readers]
            rest = [x for x in live if x.id not in readers and not x.ps.complete]
            nic = sc.nic_bps * sc.wire_payload

            def use(xs: list[Any], attr: str) -> float | None:
                return round(sum(getattr(x, attr).alloc for x in xs) / (nic * len(xs)), 3) if xs else None

            rows.append(
                {
                    "t": round(sim.env.now, 3),
                    "done": sim.n_done,
                    "live": len(live),
                    "held_mean": round(float(np.mean([x.ps.held.mean() for x in live])), 3),
                    "down_use_incomplete": use(rest, "down"),
                    "up_use_incomplete": use(rest, "up"),
                    "up_use_all": use(live, "up"),
                    "up_use_readers": use(rd, "up"),
                    "downloads_mean": round(float(np.mean([x.nreq for x in rest])), 2) if rest else None,
                    "uploads_mean": round(float(np.mean([x.uploads for x in live])), 2),
                    "uploads_readers": [x.uploads for x in rd],
                    "busy_peers_mean": round(float(np.mean([len(x.busy) for x in rest])), 2) if rest else None,
                }
            )
        if not sim._stop.triggered:
            sim.later(dt, tick)

    sim.later(dt, tick)


def last_nodes(sim: FleetSim, arrivals: list[tuple[float, str, int, str]], top: int = 8) -> dict[str, Any]:
    """Completion percentiles and the last ``top`` nodes' last arrivals (what they waited for)."""
    read_at: dict[int, float] = {}
    depth: dict[tuple[str, int], int] = {}
    mine: dict[str, list[tuple[float, int, str, int]]] = {}
    for t, node, i, src in arrivals:
        d = 0 if src == "bucket" else depth.get((src, i), 0) + 1
        depth[(node, i)] = d
        if src == "bucket":
            read_at.setdefault(i, t)
        mine.setdefault(node, []).append((t, i, src, d))
    live = [x for x in sim.nodes.values() if x.alive and x.done_at is not None]

    def pct(v: list[float]) -> dict[str, float] | None:
        if not v:
            return None
        q = np.percentile(v, [0, 50, 90, 99, 100])
        return dict(zip(("min", "p50", "p90", "p99", "max"), (round(float(x), 3) for x in q)))

    out: dict[str, Any] = {
        "done_initial": pct([x.done_at for x in live if x.joined_at == 0]),
        "done_joiners": pct([x.done_at for x in live if x.joined_at > 0]),
        "bucket_reads_by_reader": {},
        "last": [],
    }
    per_reader: dict[str, list[float]] = {}
    for t, node, _i, src in arrivals:
        if src == "bucket":
            per_reader.setdefault(node, []).append(t)
    for r, ts in sorted(per_reader.items()):
        out["bucket_reads_by_reader"][r] = {"reads": len(ts), "first": round(min(ts), 3), "last": round(max(ts), 3)}
    for x in sorted(live, key=lambda x: x.done_at)[-top:]:
        tail = mine.get(x.id, [])[-4:]
        out["last"].append(
            {
                "node": x.id,
                "done": round(x.done_at, 3),
                "joined": round(x.joined_at, 3),
                "adopted": None if x.adopted_at is None else round(x.adopted_at, 3),
                "tail": [
                    {
                        "t": round(t, 3),
                        "chunk": i,
                        "src": src,
                        "depth": d,
                        "read_at": None if i not in read_at else round(read_at[i], 3),
                    }
                    for t, i, src, d in tail
                ],
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--snapshot", choices=sorted(SNAPSHOTS), default="delta")
    ap.add_argument("--chunks", type=int, default=256)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a Scenario field to override (numbers), e.g. --set max_uploads=16",
    )
    ap.add_argument("--sample", type=float, default=0.0, help="sample NIC and slot use every this many simulated s")
    args = ap.parse_args()
    over = {k: _num(v) for k, v in (x.split("=", 1) for x in args.set)}
    sc = fleet(f"timeline-n{args.n}", args.n, SNAPSHOTS[args.snapshot], args.chunks, seed=args.seed, **over)
    sim = FleetSim(sc)
    sim.arrivals = []
    samples: list[dict[str, Any]] = []
    if args.sample > 0:
        sample(sim, args.sample, samples)
    r = sim.run()
    out = {
        "n": args.n,
        "chunks": args.chunks,
        "set": over,
        "x_floor": r["x_floor"],
        "seconds": r["seconds"],
        "control_msgs_per_node_s_mean": r["control_msgs_per_node_s_mean"],
        "chunk_requests": r["chunk_requests"],
        "bucket_egress_over_s": r["bucket_egress_over_s"],
    }
    out |= analyse(sim.arrivals, sc.floor_s, sc.chunk_bytes)
    if args.sample > 0:
        out |= last_nodes(sim, sim.arrivals) | {"samples": samples}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
