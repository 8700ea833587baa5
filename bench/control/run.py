"""The real check of the control plane: N real bdnd processes on loopback against the fleet
simulator's prediction for the same N and the same policy parameters.

    .venv/bin/python -m bench.control.run [--n 16] [--runs 3] [--window 30] [--out bench/results/control.json]

N daemons (every one lists every other as a static peer: the seeds) come up and settle; then,
per run, a small full snapshot is published and hot-loaded through one daemon, and for
``--window`` seconds of wall time every daemon's own counters are read (``GET /v1/status``:
``control_requests`` by kind, ``membership.periods``). Per node per second:

- ``msgs``: SWIM messages sent plus received (an ack inside a ping's HTTP response counts as one
  message, as the simulator counts them) plus hot-load pushes sent plus received: the unit of
  bench/fleetsim's ``control_msgs_per_node_s``;
- ``requests``: signed HTTP requests sent plus received, every kind (SWIM, hot_load pushes,
  fleet status reports and reads): what the daemon's control port carries.

The prediction is ``bench.fleetsim.sim.FleetSim`` run as it is, the control plane alone
(``data=False``, the simulator's ``control-nN`` scenario without deaths or joiners, the
daemon's ``swim_period_s`` and ``swim_suspect_mult``), one seed per run. Chunk signalling (have
bitfields) belongs to the data plane and is in neither number. The all-to-all baseline the
daemons ran before is given by its formula: a POST to every member every 2.5 s on average and
its answer, ``2 (N - 1) / 2.5`` messages per node per second.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bdn.publish import publish_full  # noqa: E402
from bench.fleetsim.sim import FleetSim, Scenario  # noqa: E402
from tests.support.checkpoints import make_state, write_hf_dir  # noqa: E402
from tests.support.swarm import Daemon  # noqa: E402

HOT = "/hot_load/v1/models/hot_load"
SWIM_PERIOD_S = 1.0
SUSPECT_MULT = 5.0


def counts(d: Daemon) -> dict[str, Any]:
    st = d.status()
    return {"t": time.monotonic(), "ctl": st["control_requests"], "periods": st["membership"].get("periods", 0)}


def _sum(dct: dict[str, int], kinds: tuple[str, ...] | None = None) -> int:
    return sum(v for k, v in dct.items() if kinds is None or k in kinds)


def rates(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    dt = b["t"] - a["t"]

    def delta(group: str, kinds: tuple[str, ...] | None = None) -> int:
        return _sum(b["ctl"].get(group, {}), kinds) - _sum(a["ctl"].get(group, {}), kinds)

    swim_msgs = delta("messages_sent") + delta("messages_received")
    pushes = delta("sent", ("hot_load",)) + delta("received", ("hot_load",))
    return {
        "msgs_per_s": (swim_msgs + pushes) / dt,
        "swim_msgs_per_s": swim_msgs / dt,
        "requests_per_s": (delta("sent") + delta("received")) / dt,
        "requests_sent_per_s": delta("sent") / dt,
        "periods_per_s": (b["periods"] - a["periods"]) / dt,
        "ping_req_per_s": (delta("sent", ("ping_req",))) / dt,
    }


def http(method: str, url: str, body: dict | None = None) -> tuple[int, Any]:
    req = urllib.request.Request(
        url,
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def wait_members(daemons: list[Daemon], timeout: float = 300.0) -> float:
    t0 = time.monotonic()
    while True:
        if all(len([p for p in d.status()["peers"] if p["alive"]]) >= len(daemons) - 1 for d in daemons):
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise TimeoutError("members did not converge")
        time.sleep(0.5)


def predict(n: int, window: float, seed: int) -> dict[str, Any]:
    sc = Scenario(
        f"control-n{n}",
        n,
        4e6,
        1,
        100e9 / 8,
        10e9,
        100e6,
        rtt_s=0.0002,
        jitter_s=0.0002,
        policy="fleet",
        data=False,
        min_sim_s=window,
        seed=seed,
        swim_period_s=SWIM_PERIOD_S,
        suspect_mult=SUSPECT_MULT,
    )
    r = FleetSim(sc).run()
    return {
        "msgs_per_s_mean": r["control_msgs_per_node_s_mean"],
        "msgs_per_s_max": r["control_msgs_per_node_s_max"],
        "target_spread_s": r["hotload_target_spread_s"],
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--window", type=float, default=30.0)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "control.json"))
    args = ap.parse_args()
    os.environ["PYTHONPATH"] = str(REPO)  # the daemons run this checkout's code
    work = Path(tempfile.mkdtemp(prefix="bdn-control-bench-"))
    bucket_dir = work / "bucket"
    bucket_dir.mkdir()
    bucket = f"file://{bucket_dir}"
    env = {
        "BDN_LOG_LEVEL": "info",
        "BDN_SWIM_PERIOD_S": str(SWIM_PERIOD_S),
        "BDN_SWIM_SUSPECT_MULT": str(SUSPECT_MULT),
        "BDN_STARTUP_SETTLE_S": "30",
    }
    daemons = [Daemon(work / "nodes", f"node{i:02d}", bucket, extra_env=env) for i in range(args.n)]
    load_before = os.getloadavg()
    rows = []
    try:
        for d in daemons:
            d.start([o.peer_url for o in daemons])
        for d in daemons:
            d.wait_healthy(timeout=300)
        settle_s = wait_members(daemons)
        time.sleep(5)  # out of the startup syncs
        for run in range(1, args.runs + 1):
            ident = f"step{run:06d}"
            ck = write_hf_dir(work / f"ck{run}", make_state(run, scale=1), run)
            publish_full(bucket, ident, run, dir=ck, chunk_size=1 << 20)
            before = [counts(d) for d in daemons]
            entry = daemons[run % len(daemons)]
            t_post = time.monotonic()
            st, ans = http("POST", entry.url + HOT, {"identity": ident})
            assert st == 200, ans
            # the fleet done, asked through another daemon's aggregated GET (3 requests a poll)
            done_s = None
            while time.monotonic() - t_post < args.window:
                st, fl = http("GET", daemons[0].url + HOT)
                if (
                    done_s is None
                    and st == 200
                    and fl.get("stages", {}).get("done") == len(daemons)
                    and all(r.get("current_snapshot_identity") == ident for r in fl["replicas"])
                ):
                    done_s = time.monotonic() - t_post
                time.sleep(1.0)
            after = [counts(d) for d in daemons]
            per = [rates(a, b) for a, b in zip(before, after)]
            pred = predict(args.n, args.window, run)
            mean = statistics.mean(p["msgs_per_s"] for p in per)
            rows.append(
                {
                    "run": run,
                    "identity": ident,
                    "window_s": round(after[0]["t"] - before[0]["t"], 2),
                    "fleet_done_s": None if done_s is None else round(done_s, 2),
                    "measured_msgs_per_node_s_mean": round(mean, 3),
                    "measured_msgs_per_node_s_max": round(max(p["msgs_per_s"] for p in per), 3),
                    "measured_swim_msgs_per_node_s_mean": round(statistics.mean(p["swim_msgs_per_s"] for p in per), 3),
                    "measured_requests_per_node_s_mean": round(statistics.mean(p["requests_per_s"] for p in per), 3),
                    "measured_requests_sent_per_node_s_max": round(max(p["requests_sent_per_s"] for p in per), 3),
                    "measured_periods_per_s_mean": round(statistics.mean(p["periods_per_s"] for p in per), 3),
                    "measured_ping_req_per_node_s_mean": round(statistics.mean(p["ping_req_per_s"] for p in per), 4),
                    "predicted_msgs_per_node_s_mean": pred["msgs_per_s_mean"],
                    "predicted_msgs_per_node_s_max": pred["msgs_per_s_max"],
                    "predicted_target_spread_s": pred["target_spread_s"],
                    "error": round(mean / pred["msgs_per_s_mean"] - 1, 4),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    finally:
        for d in daemons:
            if d.proc is not None:
                d.stop()
    errs = [r["error"] for r in rows]
    meas = [r["measured_msgs_per_node_s_mean"] for r in rows]
    out = {
        "command": "python -m bench.control.run " + " ".join(sys.argv[1:]),
        "n": args.n,
        "runs": rows,
        "settle_s": round(settle_s, 2),
        "median_measured_msgs_per_node_s": statistics.median(meas),
        "spread_measured_msgs_per_node_s": [min(meas), max(meas)],
        "median_predicted_msgs_per_node_s": statistics.median(r["predicted_msgs_per_node_s_mean"] for r in rows),
        "median_error": statistics.median(errs),
        "spread_error": [min(errs), max(errs)],
        "median_requests_per_node_s": statistics.median(r["measured_requests_per_node_s_mean"] for r in rows),
        "all_to_all_baseline_msgs_per_node_s": round(2 * (args.n - 1) / 2.5, 3),
        "within_25pct": all(abs(e) <= 0.25 for e in errs),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "cpus": os.cpu_count(),
        "swim_period_s": SWIM_PERIOD_S,
        "swim_suspect_mult": SUSPECT_MULT,
    }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "runs"}, indent=1))
    return 0 if out["within_25pct"] else 1


if __name__ == "__main__":
    sys.exit(main())
