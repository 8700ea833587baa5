#!/usr/bin/env python3
"""Measure the swap pause of bdn's transformers engine: changed tensors only vs a full reload.

    python examples/engine/measure_swap.py [--hidden 1024 --layers 4 --tensors 4 --runs 3]

Makes a LlamaForCausalLM (examples/engine/tiny_llama.py), publishes it as an anchor and a delta
that changes 2 % of the values of ``--tensors`` tensors, starts one real bdnd on a file:// bucket
under a temporary directory, lets it rebuild both snapshots, and swaps an ``HFEngine`` between
them ``--runs`` times each way with ``partial=True`` (only the changed tensors are staged and
copied) and ``partial=False`` (every tensor is copied in place). Prints one JSON object: model
bytes, changed bytes, the median pause (ms) and prepare time (ms) of each mode.
Not a test and not a benchmark of record (bench/hotload is); a quick, honest number.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import tiny_llama  # noqa: E402
from fleet import free_port  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tensors", type=int, default=4, help="tensors the simulated step changes")
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()

    from bdn.client import open_snapshot
    from bdn.engines.hf import HFEngine
    from bdn.engines.options import HotLoadOptions
    from bdn.publish import publish_delta, publish_full

    with tempfile.TemporaryDirectory(prefix="bdn-swap-") as tmp:
        root = Path(tmp)
        _m, s1 = tiny_llama.make_tiny_llama(root / "ck1", hidden=a.hidden, layers=a.layers, heads=a.hidden // 64)
        s2 = tiny_llama.optimizer_step(s1, 0.02, seed=1, tensors=a.tensors)
        tiny_llama.save_state(root / "ck2", root / "ck1", s2)
        bucket = f"file://{root}/bucket"
        publish_full(bucket, "step000001", 1, dir=root / "ck1")
        publish_delta(bucket, "step000002", 2, "step000001", dir=root / "ck2", base_dir=root / "ck1")
        (root / "secret").write_text(os.urandom(32).hex())
        port = free_port()
        env = dict(
            os.environ,
            BDN_BUCKET=bucket,
            BDN_PARTITION_SECRET_FILE=str(root / "secret"),
            BDN_PEER_LISTEN=f"127.0.0.1:{free_port()}",
            BDN_LOCAL_LISTEN=f"127.0.0.1:{port}",
            BDN_SHM_DIR=str(root / "shm"),
            BDN_LOAD_STARTUP="false",
        )
        d = subprocess.Popen(
            [sys.executable, "-m", "bdn.daemon.main"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            url = f"http://127.0.0.1:{port}"
            paths = {}
            for ident in ("step000001", "step000002"):
                for _ in range(600):
                    try:
                        urllib.request.urlopen(
                            urllib.request.Request(url + f"/v1/snapshots/{ident}/prefetch", method="POST"), timeout=5
                        ).read()
                        break
                    except OSError:
                        time.sleep(0.1)
                with urllib.request.urlopen(
                    url + f"/v1/snapshots/{ident}/wait?state=ready&timeout=300", timeout=310
                ) as r:
                    paths[ident] = json.loads(r.read())["path"]
            snaps = [open_snapshot(paths["step000001"]), open_snapshot(paths["step000002"])]
            out: dict = {"model_bytes": sum(v.numel() * 2 for v in s1.values()), "tensors": len(s1)}
            for mode in ("partial", "full"):
                eng = HFEngine(partial=mode == "partial")
                eng.swap(eng.prepare(snaps[0], {}, HotLoadOptions()))
                pauses, prepares, copied = [], [], 0
                for i in range(2 * a.runs):
                    rep = eng.swap(eng.prepare(snaps[(i + 1) % 2], {}, HotLoadOptions()))
                    pauses.append(rep["pause_ms"])
                    prepares.append(rep["prepare_ms"])
                    copied = rep["bytes_copied"]
                out[mode] = {
                    "pause_ms_median": round(statistics.median(pauses), 3),
                    "prepare_ms_median": round(statistics.median(prepares), 1),
                    "bytes_copied": copied,
                    "tensors_copied": rep["tensors_copied"],
                    "swaps": len(pauses),
                }
                del eng
            for s in snaps:
                s.close()
            print(json.dumps(out, indent=2))
        finally:
            d.terminate()
            d.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
