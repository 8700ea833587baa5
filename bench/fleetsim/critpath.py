"""Where a fleet run's last nodes waited: per-request waits and the critical path (bench/fleetsim).

    .venv/bin/python -m bench.fleetsim.critpath --n 1000 --chunks 128 [--seed 1] [--set KEY=VALUE]

Records, without changing any decision (it wraps the simulator's request, admission, transfer
and announce steps): for every chunk a node received from a peer, when the node first asked
for it (any peer or owner), when the copy that arrived started, how many "busy" answers it got
and whether it waited in a holder's upload queue. Prints one JSON line of summaries (all peer
arrivals, the arrivals after the last bucket read, the joiners'), the bucket reads per reader,
and for the last nodes the chain of their last chunk back to its bucket read (each hop: first
ask, copy start, announce, arrival, source, busy answers, queued). It found the end-of-snapshot
herd waiting in the simulator's own upload queues (since deleted: a full holder answers busy, as
bdnd's do).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter, defaultdict
from typing import Any

from bench.fleetsim.__main__ import SNAPSHOTS, _num, fleet
from bench.fleetsim.sim import FleetSim


def _pct(v: list[float]) -> list[float] | None:
    if len(v) < 3:
        return None
    q = statistics.quantiles(v, n=10)
    return [round(q[4], 4), round(q[8], 4), round(max(v), 4)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--snapshot", choices=sorted(SNAPSHOTS), default="delta")
    ap.add_argument("--chunks", type=int, default=128)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--last", type=int, default=4, help="last nodes whose chain is printed")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()
    over = {k: _num(v) for k, v in (x.split("=", 1) for x in args.set)}
    sc = fleet(f"critpath-n{args.n}", args.n, SNAPSHOTS[args.snapshot], args.chunks, seed=args.seed, **over)
    sim = FleetSim(sc)
    sim.arrivals = []
    first: dict[tuple[str, int], float] = {}
    busy: Counter = Counter()
    queued: set[tuple[str, int]] = set()
    start: dict[tuple[str, int], tuple[float, str]] = {}
    announced: dict[tuple[str, int], float] = {}
    request, admit, transfer, announce = sim.request, sim.admit, sim.transfer, sim._announce

    def w_request(nd: Any, pid: str, i: int, wait: bool, cb: Any = None) -> None:
        first.setdefault((nd.id, i), sim.env.now)
        request(nd, pid, i, wait, cb)

    def w_admit(src: Any, nd: Any, i: int, cb: Any) -> None:
        before = src.uploads
        admit(src, nd, i, cb)
        if src.uploads == before and not sim._cancelled(nd, i):
            busy[(nd.id, i)] += 1

    def w_transfer(src: Any, nd: Any, i: int, cb: Any) -> None:
        start[(nd.id, i)] = (sim.env.now, src.id)
        transfer(src, nd, i, cb)

    def w_announce(nd: Any, i: int, f: Any) -> None:
        announced.setdefault((nd.id, i), sim.env.now)
        announce(nd, i, f)

    sim.request, sim.admit, sim.transfer, sim._announce = w_request, w_admit, w_transfer, w_announce  # type: ignore[method-assign]
    r = sim.run()
    arr = {(n, i): (t, s) for t, n, i, s in sim.arrivals}
    reads = Counter(n for _t, n, _i, s in sim.arrivals if s == "bucket")
    last_read = max(t for t, _n, _i, s in sim.arrivals if s == "bucket")

    def summary(keys: list[tuple[str, int]]) -> dict[str, Any]:
        return {
            "arrivals": len(keys),
            "ask_to_copy_start_p50_p90_max": _pct([start[k][0] - first[k] for k in keys if k in start and k in first]),
            "copy_s_p50_p90_max": _pct([arr[k][0] - start[k][0] for k in keys if k in start]),
            "busy_answers_mean": round(statistics.mean([busy[k] for k in keys]), 2) if keys else None,
            "queued_frac": round(sum(1 for k in keys if k in queued) / len(keys), 2) if keys else None,
        }

    peer = [k for k, (_t, s) in arr.items() if s != "bucket"]
    out: dict[str, Any] = {
        "n": args.n,
        "chunks": args.chunks,
        "seed": args.seed,
        "set": over,
        "x_floor": r["x_floor"],
        "seconds": r["seconds"],
        "last_bucket_read_s": round(last_read, 3),
        "reads_per_reader": dict(reads),
        "all": summary(peer),
        "after_last_read": summary([k for k in peer if arr[k][0] > last_read]),
        "joiners": summary([k for k in peer if sim.nodes[k[0]].joined_at > 0]),
        "last": [],
    }
    done = sorted((x.done_at, x.id) for x in sim.nodes.values() if x.alive and x.done_at is not None)
    for t, nid in done[-args.last :]:
        i = max((arr[(nid, j)][0], j) for j in range(sc.chunks) if (nid, j) in arr)[1]
        chain, node = [], nid
        seen: defaultdict[str, int] = defaultdict(int)
        while seen[node] == 0:
            seen[node] += 1
            ta, s = arr[(node, i)]
            st = start.get((node, i))
            chain.append(
                {
                    "node": node,
                    "first_ask": round(first[(node, i)], 4) if (node, i) in first else None,
                    "copy_start": round(st[0], 4) if st else None,
                    "announced": round(announced[(node, i)], 4) if (node, i) in announced else None,
                    "arrived": round(ta, 4),
                    "source": s,
                    "busy": busy[(node, i)],
                    "queued": (node, i) in queued,
                }
            )
            if s == "bucket":
                break
            node = s
        out["last"].append({"node": nid, "done": round(t, 4), "chunk": i, "chain": chain})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
