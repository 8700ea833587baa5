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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--snapshot", choices=sorted(SNAPSHOTS), default="delta")
    ap.add_argument("--chunks", type=int, default=256)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a Scenario field to override (numbers), e.g. --set upload_queue=32")
    args = ap.parse_args()
    over = {k: _num(v) for k, v in (x.split("=", 1) for x in args.set)}
    sc = fleet(f"timeline-n{args.n}", args.n, SNAPSHOTS[args.snapshot], args.chunks, seed=args.seed, **over)
    sim = FleetSim(sc)
    sim.arrivals = []
    r = sim.run()
    out = {"n": args.n, "chunks": args.chunks, "set": over, "x_floor": r["x_floor"], "seconds": r["seconds"],
           "control_msgs_per_node_s_mean": r["control_msgs_per_node_s_mean"], "chunk_requests": r["chunk_requests"],
           "bucket_egress_over_s": r["bucket_egress_over_s"]}
    out |= analyse(sim.arrivals, sc.floor_s, sc.chunk_bytes)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
