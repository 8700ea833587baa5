"""Hand-off: time from READY to the engine holding arrays, against memcpy in the same run.

    .venv/bin/python -m bench.handoff [--quick] [--size-gb 1] [--runs 3]

Publishes a bf16 synthetic checkpoint (``--size-gb``, 0.2 with ``--quick``) as a full snapshot to a
``file://`` bucket, starts one real ``bdnd`` on loopback, prefetches it to READY, then measures ``--runs``
times per method the seconds until every tensor is an array in the engine:

* ``zero-copy open``: ``DaemonClient.open`` + ``Snapshot.tensor`` for every tensor (read-only views
  of the /dev/shm files: no byte is copied);
* ``zero-copy open + touch``: the same, then every page read once (a reduction over each view),
  the cost an engine pays when it first uses the weights;
* ``zero-copy open + copy``: the views copied into fresh engine-owned arrays;
* ``http pull (tensors)``: ``DaemonClient.read_tensor`` of every tensor from the local API;
* ``http pull (files, 4 ranges)``: ``DaemonClient.read_file`` of each file in 4 parallel ranges;
* ``http pull into a reused buffer (...)``: ``DaemonClient.read_tensor_into`` of every tensor, or
  ``read_file_into`` of each file with 1 or 4 connections, into one buffer the process allocated
  and wrote once before the clock (what a serving process with a staging buffer does), over TCP
  and over the daemon's unix socket;
* ``safetensors load_file``: ``safetensors.numpy.load_file`` of each ``*.safetensors`` file of the
  snapshot directory (it copies into new arrays);
* ``memcpy``: ``np.copyto`` of one buffer of the same size into another (both pre-faulted);
* ``memcpy into fresh memory``: the same into a new array each run (its pages faulted in and
  zeroed as the copy lands: the bound of every method that returns new arrays).

Writes bench/results/handoff.json (``--quick``: handoff.quick.json); rows: ``method, bytes,
seconds, gbps, memcpy_gbps`` (``seconds`` the median of the runs, ``gbps`` and ``memcpy_gbps``
from medians) plus ``runs``, ``median``, ``min``, ``max`` of ``seconds`` (``bench/runs.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from bdn.client import DaemonClient
from bdn.fileops import save
from bdn.publish import publish_full
from bench import runs
from bench.delta import inputs

RESULTS = Path("bench/results")
IDENT = "step000001"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


HZ = os.sysconf("SC_CLK_TCK")
DAEMON_PID: list[int] = []  # the bdnd whose CPU counts with ours


def cpu_s() -> float:
    """User + system CPU seconds of this process (all threads) and the daemon: on a shared
    machine the wall seconds move with other people's load, the CPU per GB much less."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    tot = ru.ru_utime + ru.ru_stime
    for pid in DAEMON_PID:
        with open(f"/proc/{pid}/stat") as f:
            st = f.read().rsplit(")", 1)[1].split()
        tot += (int(st[11]) + int(st[12])) / HZ
    return tot


def timed(fn, n_runs: int) -> dict:
    """``fn`` run ``n_runs`` times: ``runs``/``median``/``min``/``max`` of its wall seconds and
    of the CPU seconds (this process + the daemon) it took."""
    out, cpu = [], []
    for _ in range(n_runs):
        c0, t0 = cpu_s(), time.perf_counter()
        fn()
        out.append(round(time.perf_counter() - t0, 6))
        cpu.append(round(cpu_s() - c0, 4))
    return runs.summarize({"seconds": out, "cpu_seconds": cpu})


def memcpy_stats(nbytes: int, n_runs: int) -> dict:
    """The memcpy baseline: ``np.copyto`` between two pre-faulted buffers of ``nbytes``."""
    a = np.ones(nbytes, dtype=np.uint8)
    b = np.zeros(nbytes, dtype=np.uint8)
    np.copyto(b, a)  # fault both in before timing
    return timed(lambda: np.copyto(b, a), n_runs)


def main() -> None:
    ap = argparse.ArgumentParser(description="hand-off benchmark")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--shards", type=int, default=2)
    runs.add_runs_arg(ap)
    ap.add_argument("--repeat", type=int, dest="runs", help=argparse.SUPPRESS)  # the old name of --runs
    ap.add_argument(
        "--shm-root", default="/dev/shm", help="where the daemon's shm_dir goes (e.g. a tmpfs mounted huge=within_size)"
    )
    ap.add_argument(
        "--only",
        default="",
        help="comma list: run only the methods whose name contains one (memcpy always runs: the baseline)",
    )
    ap.add_argument("--out", default="", help="result file (default bench/results/handoff[.quick].json)")
    args = ap.parse_args()
    load0 = os.getloadavg()
    size = 0.2 if args.quick else args.size_gb
    work = Path(tempfile.mkdtemp(prefix="bdn-bench-handoff-"))
    shm = Path(args.shm_root) / f"bdn-bench-handoff-{os.getpid()}"
    proc = None
    cores = os.cpu_count() or 1
    print(f"hand-off benchmark on {cores} cores, {size:g} GB bf16 in {args.shards} shards", flush=True)
    try:
        state = inputs.synthetic_base(size)
        names = sorted(state)
        per = -(-len(names) // args.shards)
        # bdn publishes a state dict as one file; for shards, write an HF directory and publish it
        ck = work / "ckpt"
        ck.mkdir()
        index = {}
        for s in range(args.shards):
            fn = f"model-{s + 1:05d}-of-{args.shards:05d}.safetensors"
            part = {k: state[k] for k in names[s * per : (s + 1) * per]}
            save(ck / fn, part, {"format": "pt"})
            index.update({k: fn for k in part})
        (ck / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
        (ck / "config.json").write_text("{}")
        nbytes = sum(v.nbytes for v in state.values())
        del state
        bucket = f"file://{work / 'bucket'}"
        publish_full(bucket, IDENT, 1, dir=ck)
        shutil.rmtree(ck)
        secret = work / "secret"
        secret.write_text(os.urandom(32).hex() + "\n")
        secret.chmod(0o600)
        local, peer = free_port(), free_port()
        env = dict(
            os.environ,
            BDN_BUCKET=bucket,
            BDN_NODE_ID="bench",
            BDN_PEER_LISTEN=f"127.0.0.1:{peer}",
            BDN_ADVERTISE_URL=f"http://127.0.0.1:{peer}",
            BDN_LOCAL_LISTEN=f"127.0.0.1:{local}",
            BDN_SHM_DIR=str(shm),
            BDN_PARTITION_SECRET_FILE=str(secret),
            BDN_LOAD_STARTUP="false",
            BDN_STARTUP_SETTLE_S="0",
            BDN_LOCAL_SOCKET=str(work / "local.sock"),
        )
        log = open(work / "bdnd.log", "wb")
        proc = subprocess.Popen([Path(sys.executable).parent / "bdnd"], env=env, stdout=log, stderr=subprocess.STDOUT)
        DAEMON_PID.append(proc.pid)
        url = f"http://127.0.0.1:{local}"
        with DaemonClient(url) as c:
            for _ in range(400):
                try:
                    c.health()
                    break
                except Exception:
                    if proc.poll() is not None:
                        sys.exit(f"bdnd exited; see {work / 'bdnd.log'}")
                    time.sleep(0.05)
            c.prefetch(IDENT)
            c.wait(IDENT, "ready", 600)
            rows: list[dict] = []
            mstats = memcpy_stats(nbytes, args.runs)
            mc = nbytes / mstats["median"]["seconds"] / 1e9
            print(f"memcpy {mc:.2f} GB/s ({nbytes / 1e9:.2f} GB, median of {args.runs})", flush=True)

            def open_views():
                with c.open(IDENT) as snap:
                    views = [snap.tensor(n) for n in snap.tensor_names()]
                    del views

            def open_touch():
                with c.open(IDENT) as snap:
                    for n in snap.tensor_names():
                        snap.tensor(n).view(np.uint16).max()

            def open_copy():
                with c.open(IDENT) as snap:
                    arrays = [np.array(snap.tensor(n)) for n in snap.tensor_names()]
                    del arrays

            def http_tensors():
                with c.open(IDENT) as snap:
                    tn = snap.tensor_names()
                arrays = [c.read_tensor(IDENT, n) for n in tn]
                del arrays

            def http_files():
                files = [f for f in c.list_files(IDENT) if f["path"].endswith(".safetensors")]

                def rng(a):
                    f, off, ln = a
                    with DaemonClient(url) as cc:
                        return len(cc.read_file(IDENT, f, off, ln))

                jobs = []
                for f in files:
                    step = -(-f["size"] // 4)
                    jobs += [(f["path"], o, min(step, f["size"] - o)) for o in range(0, f["size"], step)]
                with ThreadPoolExecutor(4) as pool:
                    assert sum(pool.map(rng, jobs)) == sum(f["size"] for f in files)

            with c.open(IDENT) as snap:
                tinfo = [(n, snap.tensor(n).nbytes) for n in snap.tensor_names()]
            finfo = [(f["path"], f["size"]) for f in c.list_files(IDENT) if f["path"].endswith(".safetensors")]
            arena = np.ones(max(sum(b for _, b in tinfo), sum(b for _, b in finfo)), dtype=np.uint8)  # written once
            uds = DaemonClient(f"unix://{work / 'local.sock'}")

            def tensors_into(cl):
                def run():
                    pos = 0
                    for n, nb in tinfo:
                        cl.read_tensor_into(IDENT, n, arena[pos : pos + nb])
                        pos += nb

                return run

            def files_into(cl, conns):
                def run():
                    pos = 0
                    for f, size in finfo:
                        assert cl.read_file_into(IDENT, f, arena[pos : pos + size], connections=conns) == size
                        pos += size

                return run

            def fresh_copy():
                out = np.empty(nbytes, dtype=np.uint8)
                np.copyto(out, arena[:nbytes])
                del out

            with c.open(IDENT) as snap:
                sdir = Path(snap.path)

            def pread_files(threads):
                # the floor of any copy out of the daemon's shm pages into the reused buffer (no
                # socket, no daemon): the tmpfs page lookups + copy_to_user of os.preadv
                def piece(fd, view, off):
                    pos = 0
                    while pos < len(view):
                        pos += os.preadv(fd, [view[pos:]], off + pos)

                def run():
                    pos = 0
                    with ThreadPoolExecutor(threads) as pool:
                        for f, size in finfo:
                            fd = os.open(sdir / f, os.O_RDONLY)
                            try:
                                step = -(-size // threads)
                                view = memoryview(arena)[pos : pos + size]
                                list(
                                    pool.map(
                                        lambda a, fd=fd, view=view, step=step: piece(fd, view[a : a + step], a),
                                        range(0, size, step),
                                    )
                                )
                            finally:
                                os.close(fd)
                            pos += size

                return run

            def st_load():
                with c.open(IDENT) as snap:
                    d = Path(snap.path)
                arrays = [load_file(str(p)) for p in sorted(d.glob("*.safetensors"))]
                del arrays

            for method, fn in (
                ("zero-copy open", open_views),
                ("zero-copy open + touch", open_touch),
                ("zero-copy open + copy", open_copy),
                ("http pull (tensors)", http_tensors),
                ("http pull (files, 4 ranges)", http_files),
                ("http pull into a reused buffer (tensors)", tensors_into(c)),
                ("http pull into a reused buffer (files, 1 connection)", files_into(c, 1)),
                ("http pull into a reused buffer (files, 4 connections)", files_into(c, 4)),
                ("http pull into a reused buffer (tensors, unix socket)", tensors_into(uds)),
                ("http pull into a reused buffer (files, 2 connections, unix socket)", files_into(uds, 2)),
                ("http pull into a reused buffer (files, 4 connections, unix socket)", files_into(uds, 4)),
                ("http pull into a reused buffer (files, 8 connections, unix socket)", files_into(uds, 8)),
                ("pread from the shm files into a reused buffer (1 thread)", pread_files(1)),
                ("pread from the shm files into a reused buffer (2 threads)", pread_files(2)),
                ("memcpy into fresh memory", fresh_copy),
                ("safetensors load_file", st_load),
            ):
                if args.only and not any(w in method for w in args.only.split(",")):
                    continue
                st = timed(fn, args.runs)
                s = st["median"]["seconds"]
                rows.append(
                    {
                        "method": method,
                        "bytes": nbytes,
                        "seconds": round(s, 5),
                        "gbps": round(nbytes / s / 1e9, 3),
                        "memcpy_gbps": round(mc, 3),
                        **st,
                    }
                )
                rows[-1]["cpu_s_per_GB"] = round(st["median"]["cpu_seconds"] / (nbytes / 1e9), 3)
                print(
                    f"  {method:30s} {runs.spread(rows[-1], 'seconds', 1, 1e3)} ms  {nbytes / s / 1e9:7.2f} GB/s  "
                    f"({nbytes / s / 1e9 / mc:5.2f}x memcpy, {s / (nbytes / 1e9) * 1e3:7.1f} ms/GB, "
                    f"{rows[-1]['cpu_s_per_GB']:.3f} CPU-s/GB)",
                    flush=True,
                )
            uds.close()
            rows.append(
                {
                    "method": "memcpy",
                    "bytes": nbytes,
                    "seconds": round(mstats["median"]["seconds"], 5),
                    "gbps": round(mc, 3),
                    "memcpy_gbps": round(mc, 3),
                    **mstats,
                    "cpu_s_per_GB": round(mstats["median"]["cpu_seconds"] / (nbytes / 1e9), 3),
                }
            )
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = Path(args.out) if args.out else RESULTS / ("handoff.quick.json" if args.quick else "handoff.json")
    out.write_text(
        json.dumps(
            {
                "machine": {
                    "cores": cores,
                    "when": time.strftime("%Y-%m-%d"),
                    "loadavg_before": load0,
                    "loadavg_after": os.getloadavg(),
                },
                "runs": args.runs,
                "rows": rows,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
