"""Hot-load: POST to every replica ``done``, and the swap pause, for the transformers engine.

    .venv/bin/python -m bench.hotload [--hidden 2048 --layers 7] [--frac 0.02] [--tensors all] [--runs 3]

A LlamaForCausalLM in bf16 (``examples/engine/tiny_llama.py``; the defaults make 0.57 GB) is
published to a ``file://`` bucket as an anchor; every step after it changes ``--frac`` of the
values of ``--tensors`` of its matrices (``all`` by default: 2 % of every matrix, as hosted RL
services report per step) and is published as an ``arc_v2`` delta. One real ``bdnd`` serves it
on loopback with one ``HFEngine`` (``bdn.engines.service.HFService``: its chat server and the
hot-swap driver, in this process) registered. Each run is one hot-load POST of the next delta,
timed until the replica reports ``done`` serving it (the harness waits for the engine's ack to be
answered, an event, then polls the GET every 10 ms; it does not poll while the daemon and the
engine work); ``--runs`` runs per mode:

* ``changed tensors only, rebound`` (``--modes partial``, the engine's default): the engine
  stages the tensors the daemon's offer names (``changed_tensors``) and the pause points the
  parameters at them (``HFEngine(swap_method="rebind")``);
* ``changed tensors only, copied in place`` (``partial-copy``): the same tensors, copied into the
  parameters' own storage in the pause (``swap_method="copy"``, pointer-stable);
* ``full reload, copied in place`` (``full``): ``HFEngine(partial=False)``: every tensor is staged
  and copied on every swap.

Measured in the same run, for the targets of issue 10:

* ``memcpy_changed_s``: copying the changed tensors' bytes once from tensors in memory into
  preallocated ones, what the pause must do at least: the best of three ``torch`` ``copy_`` passes
  and of three single-threaded ``np.copyto`` passes (``memcpy_torch_s`` / ``memcpy_numpy_s``,
  measured right after the run): the pause should not exceed it;
* ``transfer_floor_s``: reading the delta's stored objects from the bucket into ``/dev/shm`` with
  one plain copy each; ``apply_s``: the daemon's ``applying`` + ``verifying`` seconds (its record's
  ``stages``) plus the engine's prepare and pause (report ``prepare_ms`` + ``pause_ms``).
  POST to done should be within 1.2 x (transfer floor + apply);
* ``recycled_bytes`` of ``reserved_bytes``: the target's files built in the page pool's recycled
  pages rather than ``posix_fallocate``d (the daemon's ``reserved`` log line);
* ``daemon_cpu_s``: bdnd's user + system CPU seconds from the POST to done (``/proc/<pid>/stat``):
  on a loaded machine the wall times are mostly the scheduler's, this is the daemon's own work;
  ``prepare_cpu_ms``: the same for the engine (this process, every thread) while it prepared.

``--words pingpong|inplace|off`` (default ``pingpong``, the engine's; a comma list runs each in turn, a new
engine each, on the same daemon and deltas): with a ``bdn_planes_v1`` delta the daemon's offer
names its diff files and the engine XORs the changed words into its parameters in the pause
(``inplace``), into spare buffers kept one step behind while it serves (``pingpong``; the pause
then rebinds them), or stages the changed tensors from the snapshot (``off``, the path before
word-level swaps); each row says which (``changed_source``: ``words``, ``words-pingpong``,
``offer``). Each run's ``engine_bytes`` is the engine's weight memory after the swap
(``HFEngine.weight_bytes``: parameters, ping-pong spare buffers, staging buffers); ``bytes_copied``
the bytes its prepare and pause wrote (staging: read from the snapshot).

``--step-interval S`` waits S seconds after each done (the anchor's too) before the next POST (a
trainer's step: the daemon brings the spare the engine freed forward meanwhile, or seeds the
anchor's, DESIGN.md "Sparse apply").

Writes bench/results/hotload.json: one row per mode with ``runs``/``median``/``min``/``max`` of
``post_to_done_s, pause_ms, prepare_ms, memcpy_changed_s, transfer_floor_s, apply_s`` (bench/runs.py),
and the machine's load average at the start and the end (the machine may be shared).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "engine"))

from bench import runs  # noqa: E402
from bench.hotload import timeline  # noqa: E402

RESULTS = ROOT / "bench" / "results"
MODES = (
    ("partial", "changed tensors only, rebound", True, "rebind"),
    ("partial-copy", "changed tensors only, copied in place", True, "copy"),
    ("full", "full reload, copied in place", False, "copy"),
)
METRICS = (
    "post_to_done_s",
    "pause_ms",
    "prepare_ms",
    "prepare_cpu_ms",
    "memcpy_changed_s",
    "transfer_floor_s",
    "apply_s",
    "sparse_floor_s",
    "daemon_cpu_s",
    "recycled_bytes",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ident(i: int) -> str:
    return f"step{i:06d}"


def memcpy_changed_s(state: dict, names: list[str], repeat: int = 3) -> dict[str, float]:
    """Seconds to copy the ``names`` tensors of ``state`` once into preallocated (pre-faulted)
    tensors, two ways, each the best of ``repeat``: ``torch`` (``Tensor.copy_``, torch's intra-op
    threads) and ``memcpy`` (one ``np.copyto`` per tensor, one thread); ``best`` is the lower."""
    import numpy as np
    import torch

    src = [state[n].contiguous() for n in names]
    dst = [torch.empty_like(t) for t in src]
    for d, s in zip(dst, src):
        d.copy_(s)  # fault both in first
    views = [(d.view(-1).view(torch.uint8).numpy(), s.view(-1).view(torch.uint8).numpy()) for d, s in zip(dst, src)]

    def best(fn) -> float:
        out = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return min(out)

    t_torch = best(lambda: [d.copy_(s) for d, s in zip(dst, src)])
    t_np = best(lambda: [np.copyto(d, s) for d, s in views])
    return {"torch": t_torch, "memcpy": t_np, "best": min(t_torch, t_np)}


def transfer_floor_s(bucket_dir: Path, identity: str, shm: Path) -> float:
    """Seconds to copy the delta's stored objects from the bucket into /dev/shm (one plain copy each)."""
    out = shm / f".floor-{identity}"
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    for f in sorted((bucket_dir / identity).rglob("*")):
        if f.is_file():
            shutil.copyfile(f, out / f.name)
    dt = time.perf_counter() - t0
    shutil.rmtree(out)
    return dt


FLOOR_REPEATS = 3


def sparse_floor_s(prev: dict, new: dict, names: list[str]) -> float:
    """Seconds of the in-place XOR of exactly the changed bytes of ``names`` (positions and XOR
    values precomputed) into copies of the previous tensors' bytes: the sparse floor's write part
    (reading the delta is ``transfer_floor_s``). The best of ``FLOOR_REPEATS`` passes, as the
    memcpy baseline is (a floor is what the machine can do; one pass varied 0.12-0.22 s)."""
    import numpy as np
    import torch

    work = []
    for n in names:
        a = prev[n].contiguous().view(-1).view(torch.uint8).numpy()
        b = new[n].contiguous().view(-1).view(torch.uint8).numpy()
        idx = np.flatnonzero(a != b)
        work.append((a.copy(), idx, a[idx] ^ b[idx]))
    best = float("inf")
    for _ in range(FLOOR_REPEATS):  # (each pass XORs the buffers back and forth: same work)
        t0 = time.perf_counter()
        for buf, idx, x in work:
            buf[idx] ^= x
        best = min(best, time.perf_counter() - t0)
    return best


class Peaks:
    """Samples, every ``every`` s on a thread, the bytes of the files under ``shm`` (allocated
    blocks, each inode once) and the daemon's resident memory (``/proc/<pid>/status``: RssAnon, RssShmem); the
    daemon's VmHWM (peak RSS) is read at :meth:`stop`."""

    def __init__(self, shm: Path, pid: int, every: float = 0.05) -> None:
        self.shm, self.pid, self.every = shm, pid, every
        self.shm_peak = self.anon_peak = self.shmem_peak = self.hwm = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _status(self) -> dict[str, int]:
        try:
            text = Path(f"/proc/{self.pid}/status").read_text()
        except OSError:
            return {}
        return {k: int(v) * 1024 for k, v in re.findall(r"^(\w+):\s+(\d+) kB", text, re.MULTILINE)}

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            seen: dict[int, int] = {}  # by inode: a file renamed during the walk (a spare taken into
            for d, _, files in os.walk(self.shm):  # staging) is listed under both names
                for f in files:
                    try:
                        st = os.lstat(os.path.join(d, f))
                    except OSError:
                        continue
                    seen[st.st_ino] = st.st_blocks * 512
            total = sum(seen.values())
            st = self._status()
            self.shm_peak = max(self.shm_peak, total)
            self.anon_peak = max(self.anon_peak, st.get("RssAnon", 0))
            self.shmem_peak = max(self.shmem_peak, st.get("RssShmem", 0))

    def stop(self) -> None:
        self.hwm = self._status().get("VmHWM", 0)
        self._stop.set()
        self._t.join()


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sparse_counters(url: str) -> dict[str, float]:
    """The daemon's ``bdn_sparse_total`` counters (applies, bytes_written, fallbacks, chunks_bad)."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(r'^bdn_sparse_total\{what="(\w+)"\} (\S+)$', text, re.MULTILINE)
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=7)
    ap.add_argument("--frac", type=float, default=0.02, help="fraction of the values of a changed matrix per step")
    ap.add_argument("--tensors", default="all", help="matrices a step changes: all, or a count")
    ap.add_argument("--out", default=str(RESULTS / "hotload.json"))
    ap.add_argument(
        "--timeline", action="store_true", help="print and store each run's timeline (daemon log events, engine calls)"
    )
    ap.add_argument(
        "--modes",
        default="partial,partial-copy,full",
        help="rows to measure (comma-separated): partial (changed tensors, rebound), partial-copy "
        "(changed tensors, copied in place), full (every tensor, copied in place)",
    )
    ap.add_argument(
        "--codec",
        default="arc_v2",
        choices=("arc_v2", "bdn_planes_v1"),
        help="the deltas' compression format (bdn_planes_v1: bdnd applies it sparsely)",
    )
    ap.add_argument(
        "--keep-ready",
        type=int,
        default=None,
        help="bdnd's keep_ready (1: the served snapshot plus one buffer, DESIGN.md 'Sparse apply')",
    )
    ap.add_argument(
        "--step-interval",
        type=float,
        default=0.0,
        help="seconds between one step's done and the next POST (a trainer's step; the daemon "
        "brings the freed spare forward meanwhile, DESIGN.md 'Sparse apply')",
    )
    ap.add_argument("--keep-log", default="", help="copy bdnd's log (JSON lines) to this path at the end")
    ap.add_argument(
        "--words",
        default="pingpong",
        help="the engine's word-level swaps of a bdn_planes_v1 delta (HFEngine words=; a comma list runs "
        "each in turn): inplace (in the pause), pingpong (onto spare buffers one step behind, while "
        "serving), or off (staging only)",
    )
    ap.add_argument(
        "--background-nice",
        type=int,
        default=None,
        help="nice increment of the daemon's and the engine's background threads (BDN_BACKGROUND_NICE, "
        "HFEngine background_nice; bdn/priority.py); default: theirs (10); 0: an A/B without it",
    )
    runs.add_runs_arg(ap)
    a = ap.parse_args()
    words_modes = a.words.split(",")
    if any(w not in ("inplace", "pingpong", "off") for w in words_modes):
        ap.error("--words: a comma list of inplace, pingpong, off")

    import tiny_llama
    import torch

    from bdn.client import DaemonClient, hot_load, hot_load_status
    from bdn.engines.service import HFService
    from bdn.publish import publish_delta, publish_full

    load0 = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="bdn-bench-hotload-"))
    shm = Path("/dev/shm") / f"bdn-bench-hotload-{os.getpid()}"
    bucket_dir = work / "bucket"
    bucket = f"file://{bucket_dir}"
    proc = None
    rows: list[dict] = []
    try:
        _m, state = tiny_llama.make_tiny_llama(work / "ck1", hidden=a.hidden, layers=a.layers, heads=a.hidden // 128)
        del _m
        model_bytes = sum(v.numel() * v.element_size() for v in state.values())
        matrices = sum(1 for v in state.values() if v.dim() == 2)
        n_tensors = matrices if a.tensors == "all" else int(a.tensors)
        print(
            f"hot-load benchmark: {model_bytes / 1e9:.2f} GB bf16, {len(state)} tensors; each step changes "
            f"{a.frac:.0%} of the values of {n_tensors} of {matrices} matrices; {os.cpu_count()} cores, "
            f"load average {load0[0]:.1f}",
            flush=True,
        )
        publish_full(bucket, ident(1), 1, dir=work / "ck1")
        # every delta the runs will need, published before anything is timed
        steps = len([m for m in MODES if m[0] in a.modes.split(",")]) * a.runs * len(words_modes)
        changed_names: dict[str, list[str]] = {}
        sfloor: dict[str, float] = {}
        prev_dir = work / "ck1"
        for i in range(2, steps + 2):
            new = tiny_llama.optimizer_step(state, a.frac, seed=i, tensors=n_tensors)
            names = [k for k in new if not torch.equal(new[k].view(torch.int16), state[k].view(torch.int16))]
            d = tiny_llama.save_state(work / f"ck{i}", work / "ck1", new)
            publish_delta(bucket, ident(i), i, ident(i - 1), dir=d, base_dir=prev_dir, compression_format=a.codec)
            if prev_dir != work / "ck1":
                shutil.rmtree(prev_dir)
            changed_names[ident(i)] = names
            sfloor[ident(i)] = sparse_floor_s(state, new, names)
            prev_dir, state = d, new
            print(f"published {ident(i)}: {len(names)} tensors changed", flush=True)
        (work / "secret").write_text(os.urandom(32).hex() + "\n")
        local, peer = free_port(), free_port()
        env = dict(
            os.environ,
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
            BDN_ENGINE_TTL_S="120",
            BDN_LOG_JSON="true",
        )
        if a.keep_ready is not None:
            env.update(BDN_KEEP_READY=str(a.keep_ready), BDN_GC_GRACE_S="0")
        if a.background_nice is not None:
            env.update(BDN_BACKGROUND_NICE=str(a.background_nice))
        log = open(work / "bdnd.log", "wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "bdn.daemon.main"], env=env, stdout=log, stderr=subprocess.STDOUT
        )
        url = f"http://127.0.0.1:{local}"
        peaks = Peaks(shm, proc.pid)
        with DaemonClient(url) as c:
            for _ in range(600):
                try:
                    c.health()
                    break
                except Exception:  # noqa: BLE001 - not listening yet
                    if proc.poll() is not None:
                        sys.exit(f"bdnd exited; see {work / 'bdnd.log'}")
                    time.sleep(0.05)
            hot_load(c, ident(1))
            c.wait(ident(1), "ready", 900)

            def done(identity: str) -> bool:
                reps = hot_load_status(c)
                errs = [r for r in reps if r["loading_state"]["stage"] == "error"]
                if errs:
                    raise SystemExit(f"replica error: {errs[0]['loading_state']['reason']}")
                return all(
                    r["current_snapshot_identity"] == identity and r["loading_state"]["stage"] == "done" for r in reps
                )

            step = 2
            modes = [(*m, w) for w in words_modes for m in MODES if m[0] in a.modes.split(",")]
            for _key, mode, partial, method, words in modes:
                with HFService(
                    url,
                    "127.0.0.1",
                    free_port(),
                    replica_id="bench",
                    partial=partial,
                    poll_timeout=5.0,
                    swap_method=method,
                    words=words,
                    background_nice=a.background_nice,
                ) as svc:
                    marks = timeline.instrument(svc)
                    current = ident(step - 1)
                    while not done(current):
                        time.sleep(0.05)
                    if a.step_interval > 0:  # the trainer's next step comes a step after the anchor too
                        time.sleep(a.step_interval)
                    per_run: list[dict] = []
                    for _ in range(a.runs):
                        target = ident(step)
                        marks.acked.clear()
                        wall0 = time.time()
                        cpu0 = cpu_s(proc.pid)
                        t0 = time.perf_counter()
                        hot_load(c, target, previous=current)
                        wall_posted = time.time()
                        # No GET every 10 ms while the daemon applies and the engine prepares and
                        # pauses (that polling shared the 2 cores with them): wait for the engine's
                        # ack to be answered (an event), then the GET that sees done ends the time.
                        while not marks.acked.wait(1.0) and not done(target):
                            pass  # (once a second: a daemon-side error ends the run too)
                        gets: list[tuple[float, float]] = []  # (wall start, seconds) of each GET after the ack
                        while True:
                            g0 = time.time()
                            seen = done(target)
                            gets.append((g0, time.time() - g0))
                            if seen:
                                break
                            time.sleep(0.01)
                        post_to_done = time.perf_counter() - t0
                        daemon_cpu = cpu_s(proc.pid) - cpu0
                        wall_done = time.time()
                        rep = svc.engine.last_swap
                        rec = c.snapshot(target)
                        counters = sparse_counters(url)
                        stages = rec.get("stages") or {}
                        daemon_apply = float(stages.get("applying", 0.0)) + float(stages.get("verifying", 0.0))
                        log.flush()
                        res = timeline.reserved(work / "bdnd.log", target) or (0, 0)
                        floor = transfer_floor_s(bucket_dir, target, shm)
                        mcs = memcpy_changed_s(state, changed_names[target])  # same names, same sizes
                        mc = mcs["best"]
                        row = {
                            "post_to_done_s": round(post_to_done, 4),
                            "pause_ms": rep["pause_ms"],
                            "prepare_ms": rep["prepare_ms"],
                            "prepare_cpu_ms": rep.get("prepare_cpu_ms"),
                            "memcpy_changed_s": round(mc, 5),
                            "memcpy_torch_s": round(mcs["torch"], 5),
                            "memcpy_numpy_s": round(mcs["memcpy"], 5),
                            "transfer_floor_s": round(floor, 4),
                            "sparse_floor_s": round(sfloor[target], 5),
                            "sparse_counters": counters,
                            "apply_s": round(daemon_apply + (rep["prepare_ms"] + rep["pause_ms"]) / 1000, 4),
                            "daemon_apply_s": round(daemon_apply, 4),
                            "daemon_cpu_s": round(daemon_cpu, 3),
                            "swap_mode": rep["mode"],
                            "changed_source": rep["changed_source"],
                            "words_fallback": rep.get("words_fallback"),
                            "words_kernel": rep.get("words_kernel"),
                            "swap_method": rep.get("swap_method"),
                            "tensors_copied": rep["tensors_copied"],
                            "bytes_copied": rep["bytes_copied"],
                            "pingpong": rep.get("pingpong"),
                            "engine_bytes": svc.engine.weight_bytes(),
                            "stored_bytes": rec.get("stored_bytes"),
                            "reserved_bytes": res[0],
                            "recycled_bytes": res[1],
                            "stages": stages,
                        }
                        if a.timeline:
                            log.flush()
                            tl = timeline.build(
                                wall0,
                                work / "bdnd.log",
                                target,
                                marks,
                                [
                                    (wall_posted, "bench: POST answered"),
                                    *[
                                        (g0, f"bench: GET after the ack sent ({dt * 1000:.1f} ms to answer)")
                                        for g0, dt in gets
                                    ],
                                    (wall_done, "bench: GET sees done"),
                                    *timeline.stage_events(rec),
                                ],
                            )
                            row["timeline"] = tl
                            for at, what in tl:
                                print(f"  {at:8.3f} s  {what}", flush=True)
                        print(f"{mode} words {words}: {target} {json.dumps(row)}", flush=True)
                        if a.step_interval > 0:
                            time.sleep(a.step_interval)
                        per_run.append(row)
                        current, step = target, step + 1
                    row = runs.collapse(per_run, METRICS, by="post_to_done_s")
                    med = row.get("median", row)
                    row.update(
                        mode=mode,
                        words=words,
                        bytes_copied_median=sorted(r["bytes_copied"] for r in per_run)[len(per_run) // 2],
                        engine_bytes_max=max(sum(r["engine_bytes"].values()) for r in per_run),
                        model_bytes=model_bytes,
                        changed_tensors=len(changed_names[ident(step - 1)]),
                        frac=a.frac,
                        pause_vs_memcpy=round(med["pause_ms"] / 1000 / med["memcpy_changed_s"], 3),
                        done_vs_floor=round(med["post_to_done_s"] / (med["transfer_floor_s"] + med["apply_s"]), 3),
                        done_vs_sparse_floor=round(
                            med["post_to_done_s"]
                            / (med["transfer_floor_s"] + med["sparse_floor_s"] + med["pause_ms"] / 1000),
                            3,
                        ),
                    )
                    rows.append(row)
        peaks.stop()
        load1 = os.getloadavg()
        mem = {
            "model_bytes": model_bytes,
            "shm_peak_bytes": peaks.shm_peak,
            "daemon_rss_hwm_bytes": peaks.hwm,
            "daemon_rss_anon_peak_bytes": peaks.anon_peak,
            "daemon_rss_shmem_peak_bytes": peaks.shmem_peak,
        }
        print(
            "memory (model sizes): "
            + ", ".join(f"{k[:-6]} {v / model_bytes:.2f}" for k, v in mem.items() if k != "model_bytes"),
            flush=True,
        )
        out = {
            "benchmark": "hotload",
            "cores": os.cpu_count(),
            "load_average_start": load0[0],
            "load_average_end": load1[0],
            "hidden": a.hidden,
            "layers": a.layers,
            "tensors": a.tensors,
            "codec": a.codec,
            "keep_ready": a.keep_ready,
            "step_interval_s": a.step_interval,
            "background_nice": a.background_nice,
            "words": a.words,
            "memory": mem,
            "rows": rows,
        }
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {a.out} (load average {load0[0]:.1f} -> {load1[0]:.1f})")
        for r in rows:
            m = r.get("median", r)
            print(
                f"{r['mode']:>22} words {r['words']:>8}: POST->done {m['post_to_done_s']:.2f} s, pause {m['pause_ms']:.1f} ms "
                f"(memcpy of changed {m['memcpy_changed_s'] * 1000:.1f} ms, x{r['pause_vs_memcpy']}), "
                f"floor+apply {m['transfer_floor_s'] + m['apply_s']:.2f} s (x{r['done_vs_floor']}), "
                f"transfer + sparse floor + pause x{r['done_vs_sparse_floor']}"
            )
    finally:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            proc.wait(60)
        if a.keep_log and (work / "bdnd.log").is_file():
            shutil.copyfile(work / "bdnd.log", a.keep_log)
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
