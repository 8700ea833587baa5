"""SIGTERM mid-download, on a real swarm (issue 12, item 2): how long each bdnd takes to be gone.

N daemons on loopback load a fresh anchor from a file:// bucket read at ``--mbit`` (``bucket_mbit``,
so the download is in flight), each with a ``/v1/snapshots/{id}/wait`` long-poll open (what
``bdnctl prefetch --wait`` and engines hold); once every daemon has chunks on disk, ``--after``
seconds later every daemon gets SIGTERM; the time from the signal to the process's exit and its status are recorded.
``--code DIR`` runs the daemons from another checkout (the baseline: PYTHONPATH=DIR).

    PYTHONPATH=$PWD nice -n 19 .venv/bin/python -m bench.shutdown --runs 3 --out bench/results/shutdown.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

from support.checkpoints import publish_state  # noqa: E402
from support.swarm import Swarm  # noqa: E402

IDENT = "step000001"


def one_run(root: Path, a: argparse.Namespace, code: str) -> dict[str, Any]:
    bucket = root / "bucket"
    m, _ = publish_state(root, f"file://{bucket}", IDENT, 1, scale=a.scale, chunk_size=16 << 20)
    env = {"BDN_BUCKET_MBIT": str(a.mbit), "BDN_LOG_LEVEL": "info"}
    if code:
        env["PYTHONPATH"] = code
    sw = Swarm(root, a.nodes, f"file://{bucket}", extra_env=env).start()
    try:
        polls = []
        for d in sw.daemons:
            d.prefetch(IDENT)
        for d in sw.daemons:
            c = http.client.HTTPConnection("127.0.0.1", d.local_port, timeout=300)
            c.request("GET", f"/v1/snapshots/{IDENT}/wait?state=ready&timeout=250")
            polls.append(c)
        posted = time.monotonic()
        # every daemon has chunks on disk (the download is in flight, not still starting), then --after
        while time.monotonic() - posted < 180 and not all(
            d.get(f"/v1/snapshots/{IDENT}")["bytes_done"] > 0 for d in sw.daemons
        ):
            time.sleep(0.1)
        time.sleep(a.after)
        done = {d.node_id: d.get(f"/v1/snapshots/{IDENT}")["bytes_done"] for d in sw.daemons}
        t0 = {}
        for d in sw.daemons:
            assert d.proc is not None
            d.proc.send_signal(signal.SIGTERM)
            t0[d.node_id] = time.monotonic()
        out: dict[str, Any] = {}
        deadline = time.monotonic() + a.wait
        while len(out) < len(sw.daemons) and time.monotonic() < deadline:
            for d in sw.daemons:
                if d.node_id not in out and d.proc is not None and d.proc.poll() is not None:
                    out[d.node_id] = {"exit": d.proc.returncode, "s": round(time.monotonic() - t0[d.node_id], 2)}
            time.sleep(0.02)
        for d in sw.daemons:
            if d.node_id not in out:
                out[d.node_id] = {"exit": None, "s": None}  # still alive after --wait: killed
            out[d.node_id]["bytes_done_at_sigterm"] = done[d.node_id]
            r = out[d.node_id]
            if r["exit"] != 0 or r["s"] is None or r["s"] > 5:  # what it did after "stopping"
                text = d.log_path.read_text(errors="replace")
                tail = text[text.rfind(" stopping") :].splitlines() if " stopping" in text else text.splitlines()[-20:]
                r["log_after_stopping"] = [line[:300] for line in tail if "DEBUG" not in line][:40]
        return {"stored_bytes": m.stored_bytes, "daemons": out}
    finally:
        sw.stop()
        for d in sw.daemons:
            d.kill()


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.shutdown")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--scale", type=int, default=40, help="anchor size (40: 239 MB)")
    p.add_argument("--mbit", type=float, default=400.0, help="bucket_mbit of every daemon")
    p.add_argument(
        "--after", type=float, default=2.0, help="seconds between the first chunks on every daemon and the SIGTERMs"
    )
    p.add_argument("--wait", type=float, default=120.0, help="seconds a daemon gets to exit before it is killed")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--code", default="", help="run the daemons from this checkout (baseline)")
    p.add_argument("--out", default="")
    a = p.parse_args()
    runs = []
    for _ in range(a.runs):
        root = Path(tempfile.mkdtemp(prefix="bdn-shutdown-"))
        try:
            r = one_run(root, a, a.code)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        runs.append(r)
        print(json.dumps(r), flush=True)
    times = [d["s"] for r in runs for d in r["daemons"].values() if d["s"] is not None]
    hung = sum(1 for r in runs for d in r["daemons"].values() if d["s"] is None)
    codes = sorted({str(d["exit"]) for r in runs for d in r["daemons"].values()})
    summary = {
        "code": a.code or str(REPO),
        "nodes": a.nodes,
        "mbit": a.mbit,
        "after_s": a.after,
        "runs": a.runs,
        "exit_s_median": statistics.median(times) if times else None,
        "exit_s_min": min(times) if times else None,
        "exit_s_max": max(times) if times else None,
        "still_alive_after_wait": hung,
        "exit_codes": codes,
        "load_1min_before": os.getloadavg()[0],
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    print(json.dumps(summary), flush=True)
    if a.out:
        path = Path(a.out)
        prev = json.loads(path.read_text()) if path.exists() else []
        path.write_text(json.dumps(prev + [{"summary": summary, "runs": runs}], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
