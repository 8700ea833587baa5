"""Transfer-layer ceiling: 1 GiB from one process's /dev/shm file into another's mapping over
unshaped loopback, with iperf3 on the same loopback as the baseline, interleaved in one run.

    .venv/bin/python -m bench.transfer [--size-gib 1] [--runs 3] [--workers 1,2] [--chunk-mib 16]

Each run does, in this order: iperf3 (``-n`` the same bytes, one stream), then bdn with each
``--workers`` value W. A bdn point is two processes: a server (``bdn.transfer.TransferServer``
over the source file, sendfile from cached descriptors; one thread per connection) and a client
(``TransferClient`` with W streams to the server and W threads, each ``fetch_into`` the target
file at the chunk's offset, hashed in place with xxh3-128; a chunk counts only once its digest
matched). ``--into mapping`` receives straight into the target's mmap (``recv_into``);
``--into fd`` receives into each stream's 1 MiB buffer and ``pwrite``s it to the file. The target file is created and ``posix_fallocate``d before the clock
starts (the daemon's store reserves a snapshot's shm the same way); mapping it and populating
its page tables (bdn.transfer.target) is inside the timed part. After each point the whole
target is compared with the source.

MB/s = bytes / wall seconds of the client's fetch loop. MB per CPU-second = bytes / (user+system
CPU seconds of both processes over that loop: the client's ``getrusage``, the server's
``/proc/PID/stat``). iperf3's CPU is its own ``cpu_utilization_percent`` (host + remote, percent
of one core over the test) times its seconds. Each row gives the median of the runs and the
min-max. The machine's load average before and after is recorded: on a shared machine the
numbers are noisy, so compare bdn with the iperf3 of the same run.

A third row, ``copy-floor``, runs in the same run too: one ``memcpy`` of the source's mapping
into a fresh reserved and populated target mapping plus one xxh3 pass, in one process with no
network. iperf3 receives into a 128 KiB buffer that stays in cache and never writes the bytes
anywhere; bdn must land every byte in the target file and hash it, and this row measures what
that alone costs on this machine.

``--reuse-target`` receives every point into one target file that stays allocated (overwritten
in place; the first and last 4 KiB of each chunk are zeroed before each point so the compare
still proves the point wrote them). This machine is a Firecracker VM with free page reporting
(``page_reporting.page_reporting_order=11`` on the kernel command line): a freed target's pages
go back to the host, and the next fresh target pays host faults on top of the kernel's zeroing,
which is noise no real node has. The default (a fresh target per point) keeps that cost in.

Writes bench/results/transfer.json (``--out``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import mmap
import os
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

RESULTS = Path("bench/results")
WORK = Path(os.environ.get("BDN_BENCH_TRANSFER_DIR", "/dev/shm/bdn-bench-transfer"))
SECRET = "bench-transfer-secret-0123456789abcdef"
HZ = os.sysconf("SC_CLK_TCK")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads), from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / HZ


def self_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def table(path: Path, chunk: int) -> tuple[list[str], list[tuple[int, int]]]:
    """Digests and (offset, length) of every chunk of ``path``."""
    from bdn.proto.chunks import digest

    size = path.stat().st_size
    out, ranges = [], []
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m, memoryview(m) as v:
        for off in range(0, size, chunk):
            n = min(chunk, size - off)
            with v[off : off + n] as piece:
                out.append(digest(piece))
            ranges.append((off, n))
    return out, ranges


# ---- the two bdn processes -------------------------------------------------------------------


def serve(path: Path, chunk: int) -> None:
    from bdn.proto.keys import derive_keys
    from bdn.transfer import TransferServer

    keys = derive_keys(SECRET)
    digests, ranges = table(path, chunk)
    index = {keys.address(d): (str(path), off, n) for d, (off, n) in zip(digests, ranges)}
    srv = TransferServer(keys, "bench-server", index.get)
    _, port = srv.start()
    print(json.dumps({"port": port}), flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    srv.close()


def fetch(src: Path, dst: Path, chunk: int, port: int, workers: int, rcvbuf: int, into: str) -> None:
    from bdn.proto.keys import derive_keys
    from bdn.transfer import Peer, TransferClient
    from bdn.transfer.target import map_target, reserve

    keys = derive_keys(SECRET)
    digests, ranges = table(src, chunk)  # the manifest's digests (read before the clock starts)
    size = src.stat().st_size
    populate = os.environ.get("BDN_BENCH_POPULATE", "1") == "1"
    reuse = os.environ.get("BDN_BENCH_REUSE_TARGET") == "1"
    fd = os.open(dst, os.O_RDWR | os.O_CREAT | (0 if reuse else os.O_TRUNC), 0o600)
    reserve(fd, size)
    client = TransferClient(keys, "bench-client", streams_per_peer=workers, rcvbuf=rcvbuf or None)
    peer = Peer("bench-server", "127.0.0.1", port)
    addresses = [keys.address(d) for d in digests]
    nxt = itertools.count()
    failures: list[str] = []

    def worker() -> None:
        while True:
            i = next(nxt)
            if i >= len(ranges):
                return
            off, n = ranges[i]
            r = client.fetch_into(peer, addresses[i], dest, off, n, digests[i])
            if not r.ok:
                failures.append(f"chunk {i}: {r.outcome.value} {r.error}")
                return

    threads = [threading.Thread(target=worker) for _ in range(workers)]
    c0, t0 = self_cpu_s(), time.perf_counter()
    # timed: mapping and populating the page tables is receiving work
    m = map_target(fd, size, populate=populate) if into == "mapping" else None
    dest = m if m is not None else fd
    setup_s = time.perf_counter() - t0
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    secs, cpu = time.perf_counter() - t0, self_cpu_s() - c0
    client.close()
    if m is not None:
        m.close()
    os.close(fd)
    print(
        json.dumps({"seconds": secs, "cpu_s": cpu, "bytes": size, "map_s": setup_s, "failures": failures}), flush=True
    )


def reuse_target() -> bool:
    return os.environ.get("BDN_BENCH_REUSE_TARGET") == "1"


def scribble(dst: Path, chunk: int) -> None:
    """Zero the first and last 4 KiB of every chunk of a reused target, so the final compare
    still proves every chunk was written by this point."""
    if not dst.exists():
        return
    size = dst.stat().st_size
    with open(dst, "r+b") as f:
        for off in range(0, size, chunk):
            for o in (off, min(off + chunk, size) - 4096):
                os.pwrite(f.fileno(), bytes(4096), max(o, 0))


def bdn_point(src: Path, chunk: int, workers: int, rcvbuf: int, into: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    srv = subprocess.Popen(
        [sys.executable, "-m", "bench.transfer", "_serve", str(src), str(chunk)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        port = json.loads(srv.stdout.readline())["port"]  # type: ignore[union-attr]
        dst = WORK / ("dst-reused" if reuse_target() else "dst")
        if reuse_target():
            scribble(dst, chunk)
        s0 = proc_cpu_s(srv.pid)
        cli = subprocess.run(
            [
                sys.executable,
                "-m",
                "bench.transfer",
                "_fetch",
                str(src),
                str(dst),
                str(chunk),
                str(port),
                str(workers),
                str(rcvbuf),
                into,
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
            check=False,
        )
        s1 = proc_cpu_s(srv.pid)
        if cli.returncode != 0:
            raise RuntimeError(f"fetch process failed: {cli.stderr.strip().splitlines()[-1:]}")
        r = json.loads(cli.stdout.strip().splitlines()[-1])
    finally:
        srv.stdin.close()  # type: ignore[union-attr]
        srv.wait(30)
    same = not r["failures"] and subprocess.run(["cmp", "-s", str(src), str(dst)], check=False).returncode == 0
    if not reuse_target():
        os.unlink(dst)
    server_cpu = s1 - s0
    cpu = r["cpu_s"] + server_cpu
    return {
        "seconds": round(r["seconds"], 4),
        "MB_per_s": round(r["bytes"] / r["seconds"] / 1e6, 1),
        "MB_per_cpu_s": round(r["bytes"] / cpu / 1e6, 1),
        "cpu_s": {"client": round(r["cpu_s"], 3), "server": round(server_cpu, 3)},
        "map_populate_s": round(r["map_s"], 4),
        "verified": same,
        "failures": r["failures"][:3],
    }


def copy_floor(src: Path, dst: Path) -> None:
    """One memcpy of the source's mapping into a fresh reserved, populated target mapping, and
    one xxh3 pass over it: what landing and verifying the bytes costs with no network at all."""
    import numpy as np
    import xxhash

    from bdn.transfer.target import map_target, reserve

    size = src.stat().st_size
    with open(src, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as sm:
        a = np.frombuffer(sm, dtype=np.uint8)
        a.sum(dtype=np.uint64)  # fault the source in before the clock, as the server's pages are
        fd = os.open(dst, os.O_RDWR | os.O_CREAT | (0 if reuse_target() else os.O_TRUNC), 0o600)
        reserve(fd, size)
        c0, t0 = self_cpu_s(), time.perf_counter()
        dm = map_target(fd, size)
        b = np.frombuffer(dm, dtype=np.uint8)
        np.copyto(b, a)
        t_copy = time.perf_counter() - t0
        xxhash.xxh3_128_hexdigest(dm)
        secs, cpu = time.perf_counter() - t0, self_cpu_s() - c0
        del a, b
        dm.close()
        os.close(fd)
    print(json.dumps({"seconds": secs, "copy_s": t_copy, "cpu_s": cpu, "bytes": size}), flush=True)


def copy_point(src: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    dst = WORK / ("dst-copy-reused" if reuse_target() else "dst")
    r = subprocess.run(
        [sys.executable, "-m", "bench.transfer", "_copy", str(src), str(dst)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    if not reuse_target():
        os.unlink(dst)
    j = json.loads(r.stdout.strip().splitlines()[-1])
    return {
        "seconds": round(j["seconds"], 4),
        "MB_per_s": round(j["bytes"] / j["seconds"] / 1e6, 1),
        "MB_per_cpu_s": round(j["bytes"] / j["cpu_s"] / 1e6, 1),
        "cpu_s": round(j["cpu_s"], 3),
        "copy_only_s": round(j["copy_s"], 4),
    }


# ---- iperf3 ------------------------------------------------------------------------------------


def iperf_point(nbytes: int, port: int = 5231) -> dict:
    srv = subprocess.Popen(
        ["iperf3", "-s", "-1", "-B", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 30
        while True:  # wait for the listener (iperf3 has no ready signal)
            r = subprocess.run(
                ["iperf3", "-c", "127.0.0.1", "-p", str(port), "-n", str(nbytes), "-J"],
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            j = json.loads(r.stdout) if r.stdout.strip() else {}
            if "end" in j and "sum_received" in j["end"]:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"iperf3 failed: {j.get('error') or r.stderr.strip()}")
            time.sleep(0.2)
    finally:
        srv.wait(30)
    s = j["end"]["sum_received"]
    u = j["end"]["cpu_utilization_percent"]
    cpu_s = (u["host_total"] + u["remote_total"]) / 100 * s["seconds"]
    return {
        "seconds": round(s["seconds"], 4),
        "MB_per_s": round(s["bytes"] / s["seconds"] / 1e6, 1),
        "MB_per_cpu_s": round(s["bytes"] / cpu_s / 1e6, 1) if cpu_s else None,
        "cpu_utilization_percent": {k: round(u[k], 1) for k in ("host_total", "remote_total")},
        "bytes": s["bytes"],
    }


def summarise(name: str, runs: list[dict], extra: dict) -> dict:
    row = {"system": name, **extra, "runs": runs}
    for key in ("MB_per_s", "MB_per_cpu_s"):
        vals = [r[key] for r in runs if r.get(key) is not None]
        if vals:
            row[key] = round(statistics.median(vals), 1)
            row[key + "_min_max"] = [min(vals), max(vals)]
    return row


def main() -> int:
    global WORK
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--chunk-mib", type=int, default=16)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workers", default="1,2", help="comma list: streams = threads on the client")
    ap.add_argument(
        "--into",
        default="mapping,fd",
        help="comma list: mapping (recv_into the target's mmap) and/or fd (stream buffer + pwrite)",
    )
    ap.add_argument("--rcvbuf", type=int, default=4 << 20, help="client SO_RCVBUF in bytes (0: autotuning)")
    ap.add_argument("--out", default=str(RESULTS / "transfer.json"))
    ap.add_argument(
        "--dir",
        default=str(WORK),
        help="work directory on a tmpfs (both files live there); e.g. one mounted huge=within_size",
    )
    ap.add_argument(
        "--reuse-target",
        action="store_true",
        help="receive every point into one target file that stays allocated (overwritten in "
        "place): the transport's cost without fresh-page allocation and zeroing",
    )
    ap.add_argument("--note", default="", help="recorded with the results (e.g. that the machine was shared)")
    a = ap.parse_args()
    WORK = Path(a.dir)
    os.environ["BDN_BENCH_TRANSFER_DIR"] = str(WORK)  # the child processes' WORK too
    if a.reuse_target:
        os.environ["BDN_BENCH_REUSE_TARGET"] = "1"
    if not shutil.which("iperf3"):
        print("iperf3 is not installed (apt-get install -y iperf3)", file=sys.stderr)
        return 2
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    size, chunk = int(a.size_gib * (1 << 30)), a.chunk_mib << 20
    workers = [int(w) for w in a.workers.split(",")]
    intos = a.into.split(",")
    kinds = [(w, i) for i in intos for w in workers]
    src = WORK / "src"
    log(f"writing {size} random bytes to {src}")
    with open(src, "wb") as f:
        f.writelines(os.urandom(min(64 << 20, size - f.tell())) for _ in range(0, size, 64 << 20))
    # This machine is a VM: the first touch of guest memory the host has not backed yet costs
    # far more than the kernel's page zeroing (measured: populating a fresh 1 GiB mapping took
    # 2 s the first time, 0.25 s on reused memory). Touch 2x the target size once, so every point
    # (and iperf3) runs on backed memory; the zeroing of the target's pages is still measured.
    warm = WORK / "warm"
    with open(warm, "wb") as f:
        f.writelines(bytes(64 << 20) for _ in range(0, 2 * size, 64 << 20))
    warm.unlink()
    load0 = os.getloadavg()
    points: dict[str, list[dict]] = {"iperf3": [], "copy-floor": [], **{f"bdn-transfer-{i}-w{w}": [] for w, i in kinds}}
    try:
        for run in range(a.runs):
            r = iperf_point(size)
            points["iperf3"].append(r)
            log(f"run {run + 1}: iperf3 {r['MB_per_s']} MB/s, {r['MB_per_cpu_s']} MB/CPU-s")
            r = copy_point(src)
            points["copy-floor"].append(r)
            log(f"run {run + 1}: copy floor {r['MB_per_s']} MB/s, {r['MB_per_cpu_s']} MB/CPU-s")
            for w, into in kinds:
                r = bdn_point(src, chunk, w, a.rcvbuf, into)
                points[f"bdn-transfer-{into}-w{w}"].append(r)
                log(
                    f"run {run + 1}: bdn {into} w={w} {r['MB_per_s']} MB/s, {r['MB_per_cpu_s']} MB/CPU-s "
                    f"cpu {r['cpu_s']} verified={r['verified']}"
                )
    finally:
        shutil.rmtree(WORK, ignore_errors=True)
    load1 = os.getloadavg()
    rev = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    rows = [
        summarise("iperf3", points["iperf3"], {"streams": 1}),
        summarise(
            "copy-floor",
            points["copy-floor"],
            {"what": "memcpy shm mapping -> fresh populated shm mapping + one xxh3 pass, one thread, no network"},
        ),
    ]
    for w, into in kinds:
        rows.append(
            summarise(
                f"bdn-transfer-{into}-w{w}",
                points[f"bdn-transfer-{into}-w{w}"],
                {"workers": w, "streams": w, "into": into, "chunk_bytes": chunk, "rcvbuf": a.rcvbuf},
            )
        )
    base = rows[0]
    for row in rows[2:]:
        for key in ("MB_per_s", "MB_per_cpu_s"):
            if row.get(key) and base.get(key):
                row[f"{key}_vs_iperf3"] = round(row[key] / base[key], 3)
    fs = next(
        (ln.split() for ln in Path("/proc/mounts").read_text().splitlines() if ln.split()[1] == str(WORK.parent)), []
    )
    out = {
        "bench": "transfer",
        "commit": rev,
        "bytes": size,
        "dir": str(WORK),
        "reuse_target": a.reuse_target,
        "dir_mount": " ".join(fs[2:4]) if fs else "",
        "machine": {
            "cores": os.cpu_count(),
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "loadavg_before": [round(x, 2) for x in load0],
            "loadavg_after": [round(x, 2) for x in load1],
            "note": a.note,
        },
        "targets": {"MB_per_s_vs_iperf3": 0.60, "MB_per_cpu_s_vs_iperf3": 0.50},
        "rows": rows,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    for row in rows:
        log(
            f"{row['system']}: {row.get('MB_per_s')} MB/s {row.get('MB_per_s_min_max')}, "
            f"{row.get('MB_per_cpu_s')} MB/CPU-s {row.get('MB_per_cpu_s_min_max')} "
            f"vs iperf3 {row.get('MB_per_s_vs_iperf3', '-')} / {row.get('MB_per_cpu_s_vs_iperf3', '-')}"
        )
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_serve":
        serve(Path(sys.argv[2]), int(sys.argv[3]))
    elif len(sys.argv) > 1 and sys.argv[1] == "_copy":
        copy_floor(Path(sys.argv[2]), Path(sys.argv[3]))
    elif len(sys.argv) > 1 and sys.argv[1] == "_fetch":
        fetch(
            Path(sys.argv[2]),
            Path(sys.argv[3]),
            int(sys.argv[4]),
            int(sys.argv[5]),
            int(sys.argv[6]),
            int(sys.argv[7]),
            sys.argv[8],
        )
    else:
        sys.exit(main())
