"""bench/swarm: N emulated nodes fetch one snapshot through bdn, boto3 and libtorrent.

Needs root (network namespaces, veth, tc). One command reproduces everything:

    sudo .venv/bin/python -m bench.swarm.run --nodes 2,4,8 --nic-mbit 200 --bucket-mbit 200 \
        --snapshot-gb 1 --systems bdn,boto3,libtorrent --fault kill50 --bucket-fast-x 4 --ceiling --runs 3

``--runs N`` (default 3) measures every point N times; its row keeps the fields of the median run
and ``runs``/``median``/``min``/``max`` of seconds and bucket egress (of MB/s and MB per CPU-second
for the ceiling), see bench/runs.py.

The emulated cluster: a bridge ``br-bdnbench`` in the root namespace (10.77.0.1/24), one network
namespace for the bucket (a moto S3 server at 10.77.0.2:9000) and one per node (10.77.0.11, ...),
each joined to the bridge by a veth pair. ``tc tbf`` shapes every node's NIC both ways (its own
veth end for what it sends, the bridge end for what it receives) and the bucket's egress.

Measured per run: wall time from the trigger until the last node holds the verified snapshot,
bucket egress (HTTP body bytes, and the bucket veth's wire bytes as a cross-check), wire bytes
each node sent and received (its bridge-side veth counters), CPU seconds of every process and the
machine's CPU use. Rows go to bench/results/swarm.json; ``bench.swarm.report`` draws the plot and
the table. ``--cleanup`` removes namespaces, bridge, processes and files left by a killed run.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
PY = str(REPO / ".venv" / "bin" / "python")
BIN = REPO / ".venv" / "bin"
WORK = Path("/tmp/bdnbench")
SHM = Path("/dev/shm/bdnbench")
CACHE = Path("/var/tmp/bdnbench")
BRIDGE = "br-bdnbench"
NET = "10.77.0"  # only this /24, inside namespaces this script creates
ROOT_IP = f"{NET}.1"
BUCKET_IP = f"{NET}.2"
BUCKET_NS = "bdnb-bucket"
LO_NS = "bdnb-lo"
S3_PORT = 9000
BUCKET = "bench"
PREFIX = "run"
IDENTITY = "step000001"
AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
CLK = os.sysconf("SC_CLK_TCK")
#: What a point's repeated runs keep raw values and a median of (bench/runs.py).
RUN_METRICS = ("seconds", "bucket_egress_bytes")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sh(cmd: str | list[str], check: bool = True, quiet: bool = False) -> str:
    """Run a command (string: through sh) and return stdout; raise with stderr on failure."""
    r = subprocess.run(cmd, shell=isinstance(cmd, str), capture_output=True, text=True, timeout=120)
    if check and r.returncode != 0:
        raise RuntimeError(f"{cmd!r} failed ({r.returncode}): {r.stderr.strip()}")
    if not quiet and r.returncode != 0:
        log(f"(ignored) {cmd!r}: {r.stderr.strip()}")
    return r.stdout


def row_key(r: dict[str, Any]) -> tuple[Any, ...]:
    """The point a row measures: two rows with the same key are the same measurement."""
    return (r["system"], r["nodes"], r.get("bucket_mbit"), r.get("fault"))


def shm_mount() -> str:
    """The tmpfs options of the daemons' shm root when it is a mount of its own (e.g.
    ``huge=within_size``: 2 MiB pages, docs/OPERATIONS.md), else "/dev/shm"."""
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            f = line.split()
            if len(f) > 3 and f[1] == str(SHM):
                return f"{f[2]} {f[3]}"
    except OSError:
        pass
    return "/dev/shm"


def daemon_rev() -> str:
    """The bdn tree a bdnd starts from: HEAD's short sha, "+dirty" if bdn/ has uncommitted edits
    (the package is installed editable, so the working tree is what runs)."""
    head = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "-C", str(REPO), "status", "--porcelain", "--", "bdn"], capture_output=True, text=True
    ).stdout.strip()
    return head + ("+dirty" if dirty else "")


def node_ns(i: int) -> str:
    return f"bdnb-n{i}"


def node_ip(i: int) -> str:
    return f"{NET}.{10 + i}"


def root_veth(name: str) -> str:
    return f"bdnb-v{name}"  # the bridge-side end (<= 15 chars)


# ---------------------------------------------------------------------------------------------
# processes and counters


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[str]
    logfile: Path | None = None
    lines: list[str] = field(default_factory=list)
    cpu0: float = 0.0

    @property
    def pid(self) -> int:
        return self.popen.pid


PROCS: list[Proc] = []


def spawn(
    name: str,
    ns: str | None,
    argv: list[str],
    env: dict[str, str] | None = None,
    logfile: Path | None = None,
    capture: bool = False,
) -> Proc:
    """Start ``argv`` inside namespace ``ns`` (ip netns exec execs it: same pid)."""
    full = (["ip", "netns", "exec", ns] if ns else []) + argv
    e = dict(os.environ, **(env or {}))
    # BENCH_PYTHONPATH (from --bdn-src): a patched copy of bdn/ ahead of the repo's, for experiments
    e["PYTHONPATH"] = os.pathsep.join(x for x in (e.pop("BENCH_PYTHONPATH", ""), str(REPO)) if x)
    out: Any = subprocess.PIPE if capture else (open(logfile, "w") if logfile else subprocess.DEVNULL)
    p = subprocess.Popen(
        full,
        env=e,
        cwd=REPO,
        stdout=out,
        stderr=subprocess.STDOUT if not capture else (open(logfile, "w") if logfile else subprocess.DEVNULL),
        text=True,
        start_new_session=True,
    )
    pr = Proc(name, p, logfile)
    if capture:

        def pump() -> None:
            assert p.stdout is not None
            for line in p.stdout:
                pr.lines.append(line.rstrip("\n"))

        threading.Thread(target=pump, daemon=True).start()
    PROCS.append(pr)
    return pr


def stop(pr: Proc, grace: float = 5.0) -> None:
    if pr.popen.poll() is None:
        try:
            pr.popen.send_signal(signal.SIGTERM)
            pr.popen.wait(grace)
        except subprocess.TimeoutExpired:
            pr.popen.kill()
            pr.popen.wait(5)
        except ProcessLookupError:
            pass
    if pr in PROCS:
        PROCS.remove(pr)


def cpu_seconds(pid: int) -> float:
    """utime + stime of a live process (all its threads), in seconds; -1 if gone."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / CLK
    except (OSError, IndexError):
        return -1.0


def machine_cpu() -> tuple[float, float]:
    """(busy, total) jiffies summed over all cores, from /proc/stat."""
    v = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = v[3] + v[4]
    return sum(v) - idle, sum(v)


def iface_bytes(dev: str) -> tuple[int, int]:
    """(rx_bytes, tx_bytes) of a root-namespace interface."""
    d = Path(f"/sys/class/net/{dev}/statistics")
    return int((d / "rx_bytes").read_text()), int((d / "tx_bytes").read_text())


class Meter:
    """Counters before/after a run: node wire bytes, bucket wire bytes, CPU of processes."""

    def __init__(self, nodes: list[int], procs: list[Proc]) -> None:
        self.nodes, self.procs = nodes, procs
        self.b0 = {i: iface_bytes(root_veth(str(i))) for i in nodes}
        self.k0 = iface_bytes(root_veth("b"))
        self.c0 = {p.name: cpu_seconds(p.pid) for p in procs}
        self.m0 = machine_cpu()
        self.last_cpu = dict(self.c0)
        self.t0 = time.time()

    def sample_cpu(self) -> None:
        for p in self.procs:
            c = cpu_seconds(p.pid)
            if c >= 0:
                self.last_cpu[p.name] = c

    def finish(self) -> dict[str, Any]:
        self.sample_cpu()
        m1 = machine_cpu()
        wall = time.time() - self.t0
        per_node = {}
        for i in self.nodes:
            rx, tx = iface_bytes(root_veth(str(i)))
            # The bridge-side end: what it transmits the node received, and vice versa.
            per_node[f"n{i}"] = {"sent_wire": rx - self.b0[i][0], "received_wire": tx - self.b0[i][1]}
        krx, _ = iface_bytes(root_veth("b"))
        cpu = {k: round(self.last_cpu[k] - self.c0[k], 2) for k in self.c0 if self.c0[k] >= 0}
        busy = (m1[0] - self.m0[0]) / max(1, m1[1] - self.m0[1])
        # The machine is shared (other jobs may run): what our processes used vs the whole box.
        busy_s = (m1[0] - self.m0[0]) / CLK
        return {
            "own_cpu_s": round(sum(cpu.values()), 2),
            "machine_busy_cpu_s": round(busy_s, 2),
            "loadavg_1m": float(Path("/proc/loadavg").read_text().split()[0]),
            "per_node": per_node,
            "bucket_wire_bytes": krx - self.k0[0],
            "cpu_seconds": cpu,
            "machine_cpu_busy": round(busy, 3),
            "cores": os.cpu_count(),
            "meter_wall_s": round(wall, 2),
        }


# ---------------------------------------------------------------------------------------------
# the emulated cluster


def tbf(ns: str | None, dev: str, mbit: float) -> None:
    rate_bps = mbit * 1e6 / 8
    burst = max(64 * 1024, int(rate_bps * 0.002))  # >= one GSO segment, ~2 ms of line rate
    pre = f"ip netns exec {ns} " if ns else ""
    sh(f"{pre}tc qdisc replace dev {dev} root tbf rate {mbit}mbit burst {burst} latency 50ms")


def unshape(ns: str | None, dev: str) -> None:
    pre = f"ip netns exec {ns} " if ns else ""
    sh(f"{pre}tc qdisc del dev {dev} root", check=False, quiet=True)


class Cluster:
    def __init__(self, n_max: int, mtu: int) -> None:
        self.n_max, self.mtu = n_max, mtu

    def _host(self, ns: str, ip: str, tag: str) -> None:
        rv = root_veth(tag)
        sh(f"ip netns add {ns}")
        sh(f"ip link add {rv} mtu {self.mtu} type veth peer name eth0 mtu {self.mtu} netns {ns}")
        sh(f"ip link set {rv} master {BRIDGE} up")
        sh(f"ip netns exec {ns} ip addr add {ip}/24 dev eth0")
        sh(f"ip netns exec {ns} ip link set eth0 up")
        sh(f"ip netns exec {ns} ip link set lo up")

    def setup(self) -> None:
        sh(f"ip link add {BRIDGE} mtu {self.mtu} type bridge")
        sh(f"ip addr add {ROOT_IP}/24 dev {BRIDGE}")
        sh(f"ip link set {BRIDGE} up")
        self._host(BUCKET_NS, BUCKET_IP, "b")
        for i in range(1, self.n_max + 1):
            self._host(node_ns(i), node_ip(i), str(i))

    def shape(self, nic_mbit: float, bucket_mbit: float | None) -> None:
        for i in range(1, self.n_max + 1):
            tbf(node_ns(i), "eth0", nic_mbit)  # what the node sends
            tbf(None, root_veth(str(i)), nic_mbit)  # what the node receives
        if bucket_mbit:
            tbf(BUCKET_NS, "eth0", bucket_mbit)
        else:
            unshape(BUCKET_NS, "eth0")

    def link(self, i: int, up: bool) -> None:
        sh(f"ip link set {root_veth(str(i))} {'up' if up else 'down'}")


def clear_shm(prefix: str = "n") -> None:
    """Remove the shm directories of the daemons named ``prefix``N (``n``: the emulated cluster's
    nodes, ``lo``: the ceiling's), leaving the other kind's: a ``--ceiling-only`` run and a
    swarm run may share the machine."""
    if SHM.exists():
        for d in SHM.iterdir():
            if d.name.startswith(prefix) and d.name[len(prefix) :].isdigit():
                shutil.rmtree(d, ignore_errors=True)


def cleanup(cluster: bool = True, ceiling: bool = False) -> None:
    """Remove what a run of this script may have left: processes, namespaces, bridge, files; of
    the emulated cluster (``cluster``) and of the ceiling's loopback namespace ``LO_NS``
    (``ceiling``) separately, so that a swarm run and another process's ``--ceiling-only`` run
    on the same machine leave each other alone."""
    for pr in list(PROCS):
        stop(pr, 2)
    out = sh("ip netns list", check=False, quiet=True)
    for line in out.splitlines():
        ns = line.split()[0] if line.strip() else ""
        if ns.startswith("bdnb-") and (ceiling if ns == LO_NS else cluster):
            for pid in sh(["ip", "netns", "pids", ns], check=False, quiet=True).split():
                try:
                    os.kill(int(pid), signal.SIGKILL)  # processes inside our own namespaces
                except (ProcessLookupError, ValueError):
                    pass
            time.sleep(0.2)
            sh(["ip", "netns", "del", ns], check=False, quiet=True)
    if cluster:
        for dev in os.listdir("/sys/class/net"):
            if dev.startswith("bdnb-v"):
                sh(["ip", "link", "del", dev], check=False, quiet=True)
        if Path(f"/sys/class/net/{BRIDGE}").exists():
            sh(["ip", "link", "del", BRIDGE], check=False, quiet=True)
        clear_shm("n")
    if ceiling:
        clear_shm("lo")


def cleanup_ceiling() -> None:
    """What ``--ceiling-only`` may have left: its processes, its namespace, its shm directory
    (never the cluster's bridge, bdnb-* namespaces or directories)."""
    for pr in list(PROCS):
        stop(pr, 2)
    if LO_NS in sh("ip netns list", check=False, quiet=True).split():
        for pid in sh(["ip", "netns", "pids", LO_NS], check=False, quiet=True).split():
            try:
                os.kill(int(pid), signal.SIGKILL)  # processes inside our own namespace
            except (ProcessLookupError, ValueError):
                pass
        time.sleep(0.2)
        sh(["ip", "netns", "del", LO_NS], check=False, quiet=True)
    shutil.rmtree(SHM, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# talking to bdnd over its unix socket (filesystem paths cross network namespaces)


class UnixHTTP(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        s.connect(self.path)
        self.sock = s


def api(sock: Path, method: str, path: str, body: Any = None, timeout: float = 10) -> tuple[int, Any]:
    c = UnixHTTP(str(sock), timeout)
    try:
        data = json.dumps(body).encode() if body is not None else None
        c.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
        r = c.getresponse()
        raw = r.read()
        try:
            return r.status, json.loads(raw) if raw else None
        except ValueError:
            return r.status, raw.decode(errors="replace")
    finally:
        c.close()


def mem_available() -> int:
    """The kernel's estimate of memory available without swapping (``MemAvailable``), bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


MEM_WAIT_S = 1200.0  # how long a run waits for the memory it needs on a shared machine


def wait_for_memory(need: int, what: str) -> int:
    """Wait (up to ``MEM_WAIT_S``, checking every 5 s) until ``need`` bytes are available, so
    that a run's shm files cannot push a shared machine into the OOM killer; returns the bytes
    available when it starts. Raises TimeoutError if they never are."""
    t0 = time.monotonic()
    said = -60.0
    while (avail := mem_available()) < need:
        waited = time.monotonic() - t0
        if waited > MEM_WAIT_S:
            raise TimeoutError(f"{what}: {need / 2**30:.1f} GiB never available in {MEM_WAIT_S:g} s")
        if waited - said >= 60:
            log(f"    {what} waits for memory: {avail / 2**30:.1f} GiB available, needs {need / 2**30:.1f}")
            said = waited
        time.sleep(5)
    return avail


def wait_until(pred: Any, timeout: float, what: str, every: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if pred():
                return
        except (OSError, http.client.HTTPException):
            pass
        time.sleep(every)
    raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")


# ---------------------------------------------------------------------------------------------
# the runs


@dataclass
class Bench:
    args: argparse.Namespace
    snap: Path
    names: list[str]
    size: int
    digests_file: Path
    digests: dict[str, list[str]]
    cluster: Cluster | None = None
    moto: Proc | None = None
    nic_mbit: float = 200
    bucket_mbit: float = 200
    rows: list[dict[str, Any]] = field(default_factory=list)
    prior: list[dict[str, Any]] = field(default_factory=list)  # rows kept from --out (--merge)
    _ab_round: int = 0  # --ab-src: runs paired so far (ABBA order)

    def floor(self) -> float:
        return self.size * 8 / (self.nic_mbit * 1e6)

    def row(
        self, system: str, n: int, seconds: float | None, egress: int | None, fault: str | None, **extra: Any
    ) -> dict[str, Any]:
        r = {
            "system": system,
            "nodes": n,
            "snapshot_bytes": self.size,
            "nic_mbit": self.nic_mbit,
            "seconds": None if seconds is None else round(seconds, 2),
            "floor_seconds": round(self.floor(), 2),
            "bucket_egress_bytes": egress,
            "fault": fault,
            "bucket_mbit": self.bucket_mbit,
            **extra,
        }
        if system.startswith("bdn") and system != "bdn-loopback":
            r.setdefault("chunk_bytes", (self.args.chunk_mib << 20) or None)
        elif system == "libtorrent":
            r.setdefault("piece_bytes", self.args.piece_kib * 1024)
        self.rows.append(r)
        self.save()
        log(
            f"ROW {system} N={n} fault={fault}: {r['seconds']} s (floor {r['floor_seconds']} s), "
            f"bucket egress {None if egress is None else round(egress / self.size, 3)} x S, "
            f"cpu busy {extra.get('machine_cpu_busy')}"
        )
        return r

    def save(self) -> None:
        out = Path(self.args.out)
        # --merge: rows of earlier runs stay unless this run measured the same point again, so a
        # bdn-only re-run keeps the boto3/libtorrent rows (they do not depend on the daemon).
        mine = {row_key(r) for r in self.rows}
        rows = [r for r in self.prior if row_key(r) not in mine] + self.rows
        tmp = out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(rows, indent=1) + "\n")
        tmp.replace(out)

    def point(
        self, fn: Any, *args: Any, metrics: tuple[str, ...] = (), by: str = "seconds", **kw: Any
    ) -> list[dict[str, Any]]:
        """Measure one point ``--runs`` times and keep one row per system it measures.

        ``fn`` appends one row per run (a system run) or several (the ceiling: bdn and iperf3).
        Rows of the same point (``row_key``) collapse into one: its fields come from the run with
        the median ``by`` value (so its per-node bytes, CPU and counters belong to one real run);
        ``RUN_METRICS`` plus ``metrics`` become the medians, with ``runs``/``median``/``min``/``max``
        beside them (bench/runs.py). After every run the collapsed rows so far replace the
        earlier ones and are saved, so a run cut short keeps what it measured.
        """
        from bench.runs import collapse

        keep = RUN_METRICS + tuple(m for m in metrics if m not in RUN_METRICS)
        start = len(self.rows)
        raw: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
        for k in range(self.args.runs):
            if self.args.runs > 1:
                log(f"    run {k + 1} of {self.args.runs}")
            mark = len(self.rows)
            touched = pretouch() if self.args.pretouch else 0.0
            try:
                fn(*args, **kw)
            finally:
                for r in self.rows[mark:]:
                    r["pretouch_gib"] = touched
                    raw.setdefault(row_key(r), []).append(r)
                self.rows[start:] = [collapse(rs, keep, by=by) for rs in raw.values()]
                self.save()
        return self.rows[start:]

    def check_files(self, d: Path) -> bool:
        from bench.swarm.snapshot import chunk_digests

        return all((d / n).exists() and chunk_digests(d / n) == self.digests[n] for n in self.names)

    # ---- bdn --------------------------------------------------------------------------------
    def start_bdnd(self, i: int, peers: list[int], tag: str) -> tuple[Proc, Path]:
        sockp = WORK / f"n{i}.sock"
        env = dict(
            AWS_ENV,
            BDN_BUCKET=f"s3://{BUCKET}/{PREFIX}",
            BDN_ENDPOINT_URL=f"http://{BUCKET_IP}:{S3_PORT}",
            BDN_NODE_ID=f"n{i}",
            BDN_PEER_LISTEN="0.0.0.0:7080",
            BDN_ADVERTISE_URL=f"http://{node_ip(i)}:7080",
            BDN_LOCAL_LISTEN="127.0.0.1:7081",
            BDN_LOCAL_SOCKET=str(sockp),
            BDN_SHM_DIR=str(SHM / f"n{i}"),
            BDN_PARTITION_SECRET_FILE=str(WORK / "secret"),
            BDN_PEERS=",".join(f"http://{node_ip(j)}:7080" for j in peers if j != i),
            BDN_LOAD_STARTUP="false",
        )
        # every node's per-chunk event log next to its daemon log (bench.swarm.timeline reads them)
        chunks = WORK / "logs" / f"{tag}-n{i}.chunks.jsonl"
        chunks.unlink(missing_ok=True)  # bdnd appends: one run per file
        env["BDN_CHUNK_LOG"] = str(chunks)
        env.update(self.args.bdn_env)
        if self.args.bdn_src:
            env["BENCH_PYTHONPATH"] = self.args.bdn_src
        pr = spawn(f"bdnd-n{i}", node_ns(i), [str(BIN / "bdnd")], env, WORK / "logs" / f"{tag}-n{i}.log")
        return pr, sockp

    def run_bdn_recycled(self, n: int, fault: str | None = None) -> dict[str, Any]:
        """``run_bdn`` with every node's page pool holding a collected snapshot's pages: RL's steady
        state, where step N+2 lands in the pages of step N (bdn.daemon.store.spares), against a first
        anchor's fresh tmpfs pages (on this VM 0.8-3.6 CPU-s per GiB of first touch, 8 daemons at
        once on 2 cores: the disk threads' system time was the VM's first touch of fresh pages)."""
        return self.run_bdn(n, fault, system="bdn-recycled", pages="recycled")

    def run_ab(self, s: str, n: int, fault: str | None = None) -> None:
        """One run of bdn system ``s`` (``bdn``, ``bdn_recycled``) with this tree's daemon and one
        with ``--ab-src``'s (row system ``<system>@LABEL``), in the order ABBA over a point's runs."""
        label, _, src = self.args.ab_src.partition("=")
        system, pages = ("bdn-recycled", "recycled") if s == "bdn_recycled" else ("bdn", "fresh")
        first_b = self._ab_round % 4 in (1, 2)
        self._ab_round += 1
        for other in (first_b, not first_b):
            saved = self.args.bdn_src
            self.args.bdn_src = src if other else saved
            try:
                self.run_bdn(n, fault, system=f"{system}@{label}" if other else system, pages=pages)
            finally:
                self.args.bdn_src = saved

    def plant_spares(self, daemons: dict[int, tuple[Proc, Path]]) -> int:
        """Give every node's page pool the pages of one collected snapshot of the same file sizes
        (written, so resident), as its GC would have left them; returns the bytes per node."""
        sizes = [(self.snap / nm).stat().st_size for nm in self.names]
        block = b"\x5a" * (8 << 20)
        for i, (_, s) in daemons.items():
            sid = api(s, "GET", "/v1/status")[1]["swarm_id"]
            d = SHM / f"n{i}" / sid / ".spares"
            d.mkdir(parents=True, exist_ok=True)
            for k, size in enumerate(sizes):
                with open(d / f"bench-{k}", "wb") as f:
                    left = size
                    while left:
                        left -= f.write(block[: min(left, len(block))])
        return sum(sizes)

    def run_bdn(self, n: int, fault: str | None = None, system: str = "bdn", pages: str = "fresh") -> dict[str, Any]:
        tag = f"{system}-N{n}-{fault or 'nofault'}-b{int(self.bucket_mbit)}".replace("[", "-").replace("]", "")
        if self.args.bdn_src:
            tag += "-src"  # keep the logs of the repo's daemon at the same point
        nodes = list(range(1, n + 1))
        clear_shm("n")
        # n snapshots' files (in the planted spares' pages if recycled) plus the seeds a node
        # starts once ready (docs/OPERATIONS.md), until the daemons stop right after the last one
        avail = wait_for_memory(int(n * self.size * 1.25) + (2 << 30), f"{system} N={n}")
        rev = daemon_rev() + (f" patched copy at {self.args.bdn_src}" if self.args.bdn_src else "")
        daemons = {i: self.start_bdnd(i, nodes, tag) for i in nodes}
        try:

            def all_up() -> bool:
                for _, s in daemons.values():
                    st, body = api(s, "GET", "/v1/status")
                    if st != 200 or sum(1 for p in body["peers"] if p["alive"]) < n - 1:
                        return False
                return True

            wait_until(all_up, 60, "every bdnd up and seeing all its peers")
            if pages == "recycled":
                log(f"planted {self.plant_spares(daemons)} bytes of spare pages per node")
            meter = Meter(nodes, [d[0] for d in daemons.values()] + [self.moto])  # type: ignore[list-item]
            prof = self.start_profile(daemons[1][0], tag) if self.args.profile else None
            busy = self.start_503_capture(tag)
            t0 = time.time()
            # All at once, as a fleet-wide hot-load reaches them: the local API answers a prefetch
            # only after the job's first look at the bucket (~0.3 s here), and POSTed one after
            # another the eighth daemon started 2.5 s after the first (its bucket share idle
            # meanwhile).
            answers: dict[int, tuple[int, Any]] = {}

            def post(i: int, s: Path) -> None:
                answers[i] = api(s, "POST", f"/v1/snapshots/{IDENTITY}/prefetch")

            posters = [threading.Thread(target=post, args=(i, s)) for i, (_, s) in daemons.items()]
            for t in posters:
                t.start()
            for t in posters:
                t.join()
            for i, (st, body) in sorted(answers.items()):
                if st not in (200, 202):
                    raise RuntimeError(f"prefetch on n{i}: {st} {body}")
            done: dict[int, float] = {}
            failed: dict[int, str] = {}
            victim = n if fault else None
            last_status: dict[int, Any] = {}
            killed_at: list[float] = []
            deadline = time.monotonic() + self.timeout(n)

            def waiter(i: int, s: Path) -> None:
                while time.monotonic() < deadline and i not in done and i not in failed:
                    try:
                        st, body = api(s, "GET", f"/v1/snapshots/{IDENTITY}/wait?state=ready&timeout=20", timeout=30)
                    except (OSError, http.client.HTTPException) as e:
                        if i == victim and killed_at:
                            return
                        failed[i] = f"local API: {e}"
                        return
                    if st == 200 and body.get("state") == "ready":
                        done[i] = time.time()
                    elif st == 409:
                        failed[i] = str(body)

            ths = [threading.Thread(target=waiter, args=(i, s), daemon=True) for i, (_, s) in daemons.items()]
            for t in ths:
                t.start()
            while time.monotonic() < deadline and any(t.is_alive() for t in ths):
                time.sleep(0.2)
                meter.sample_cpu()
                if victim is not None and not killed_at:
                    try:
                        st, body = api(daemons[victim][1], "GET", "/v1/status")
                        last_status[victim] = body
                        j = next(x for x in body["snapshots"] if x["identity"] == IDENTITY)
                        if j["bytes_total"] and j["bytes_done"] >= 0.5 * j["bytes_total"]:
                            daemons[victim][0].popen.kill()
                            self.cluster.link(victim, False)  # type: ignore[union-attr]  # the machine is gone
                            killed_at.append(time.time() - t0)
                            log(
                                f"fault: killed n{victim} at {j['bytes_done'] / j['bytes_total']:.0%}, "
                                f"t={killed_at[0]:.1f} s, and took its link down"
                            )
                    except (OSError, http.client.HTTPException, StopIteration, KeyError):
                        pass
            survivors = [i for i in nodes if i != victim]
            m = meter.finish()
            if prof:
                self.stop_profile(prof, tag)
            m["peer_503"] = self.stop_503_capture(busy, tag)
            statuses: dict[int, Any] = {}
            for i in nodes:
                if i == victim:
                    statuses[i] = last_status.get(i)
                    continue
                try:
                    statuses[i] = api(daemons[i][1], "GET", "/v1/status")[1]
                except OSError:
                    statuses[i] = None
            ok = all(i in done for i in survivors)
            seconds = (max(done[i] for i in survivors) - t0) if ok else None
            egress = 0
            counters = {}
            for i, stt in statuses.items():
                if stt:
                    c = stt["counters"]
                    counters[f"n{i}"] = {
                        k: c.get(k)
                        for k in (
                            "bucket_bytes_owner",
                            "bucket_bytes_fallback",
                            "bucket_manifest_bytes",
                            "peer_bytes_in",
                            "peer_bytes_out",
                            "chunk_verify_failures",
                            "bucket_chunks_owner",
                            "bucket_chunks_fallback",
                            "peer_chunks_in",
                            "peer_chunks_out",
                        )
                    }
                    egress += c["bucket_bytes_owner"] + c["bucket_bytes_fallback"] + c.get("bucket_manifest_bytes", 0)
                    m["per_node"][f"n{i}"].update(counters[f"n{i}"])
            # Stopped before the digest check: a node that is ready copies its snapshot into a
            # seed in the background (docs/OPERATIONS.md), another snapshot's worth of shm per
            # node; the files stay until clear_shm below.
            for p, _ in daemons.values():
                stop(p)
            verified = None
            if ok and not self.args.no_verify:
                verified = all(self.check_files(SHM / f"n{i}" / statuses[i]["swarm_id"] / IDENTITY) for i in survivors)
            for i in done:
                m["per_node"][f"n{i}"]["done_s"] = round(done[i] - t0, 2)
            m["log_lines"] = self.count_log_lines(tag, nodes)
            if pages == "recycled":  # what each daemon says it reserved in recycled pages
                m["recycled_bytes"] = {
                    f"n{i}": recycled_bytes(WORK / "logs" / f"{tag}-n{i}.log", IDENTITY) for i in nodes
                }
            return self.row(
                system,
                n,
                seconds,
                egress,
                fault,
                daemon_commit=rev,
                verified=verified,
                pages=pages,
                shm=shm_mount(),
                failed=failed or None,
                killed_at_s=killed_at[0] if killed_at else None,
                survivors=len(survivors) if fault else None,
                mem_available_gib=round(avail / 2**30, 1),
                **m,
            )
        finally:
            for p, _ in daemons.values():
                stop(p)
            if fault:
                self.cluster.link(n, True)  # type: ignore[union-attr]
            clear_shm("n")

    @staticmethod
    def count_log_lines(tag: str, nodes: list[int]) -> dict[str, int]:
        """Per-run totals of the bdnd log lines that explain a slow run (fallbacks, failed health
        checks, warnings, errors), summed over every node's log."""
        out = {"fallback": 0, "health_check_failed": 0, "warning": 0, "error": 0}
        for i in nodes:
            try:
                text = (WORK / "logs" / f"{tag}-n{i}.log").read_text(errors="replace")
            except OSError:
                continue
            out["fallback"] += text.count("from the bucket as a fallback")
            out["health_check_failed"] += text.count("health check failed")
            out["warning"] += text.count(" WARNING ")
            out["error"] += text.count(" ERROR ")
        return out

    def timeout(self, n: int) -> float:
        return 60 + 4 * max(self.floor(), n * self.size * 8 / (self.bucket_mbit * 1e6))

    # ---- py-spy -----------------------------------------------------------------------------
    def start_profile(self, pr: Proc, tag: str) -> Proc:
        out = REPO / "bench" / "swarm" / "profiles" / f"{tag}.collapsed"
        out.parent.mkdir(exist_ok=True)
        return spawn(
            "py-spy",
            None,
            [
                str(BIN / "py-spy"),
                "record",
                "-p",
                str(pr.pid),
                "-r",
                "50",
                "-f",
                "raw",
                "-o",
                str(out),
                "--nonblocking",
                "-t",
            ],
            logfile=WORK / "logs" / f"pyspy-{tag}.log",
        )

    def start_503_capture(self, tag: str) -> Proc | None:
        """tcpdump every 503 a bdnd peer port answers (bdn has no counter for them).

        The BPF filter keeps only TCP segments from port 7080 whose payload starts with
        "HTTP/1.1 503", so the 8+ GB of chunk traffic is never copied to user space. Each segment
        is seen once, entering the bridge from the answering node's veth (``inbound``).
        """
        if not shutil.which("tcpdump"):
            return None
        off = "((tcp[12:1] & 0xf0) >> 2)"
        flt = (
            f"inbound and tcp src port 7080 and tcp[{off}:4] = 0x48545450 "
            f"and tcp[{off} + 4:4] = 0x2f312e31 and tcp[{off} + 8:4] = 0x20353033"
        )
        return spawn(
            "tcpdump",
            None,
            ["tcpdump", "-i", "any", "-nn", "-l", "-A", "-s", "400", flt],
            logfile=WORK / "logs" / f"503-{tag}.txt",
        )

    def stop_503_capture(self, pr: Proc | None, tag: str) -> dict[str, Any] | None:
        """Counts of 503 answers by reason (the body text) and by answering node."""
        if pr is None:
            return None
        time.sleep(0.5)
        pr.popen.send_signal(signal.SIGINT)
        try:
            pr.popen.wait(10)
        except subprocess.TimeoutExpired:
            pr.popen.kill()
        if pr in PROCS:
            PROCS.remove(pr)
        text = (WORK / "logs" / f"503-{tag}.txt").read_text(errors="replace")
        out: dict[str, Any] = {"total": text.count("HTTP/1.1 503")}
        for why in ("still fetching", "chunk already uploading", "upload slots full"):
            out[why] = text.count(why)
        by_node: dict[str, int] = {}
        for line in text.splitlines():
            parts = line.split()
            if len(parts) > 1 and parts[1].startswith("bdnb-v"):
                k = "n" + parts[1][len("bdnb-v") :]
                by_node[k] = by_node.get(k, 0) + 1
        out["by_answering_node"] = by_node
        return out

    def stop_profile(self, pr: Proc, tag: str) -> None:
        pr.popen.send_signal(signal.SIGINT)
        try:
            pr.popen.wait(30)
        except subprocess.TimeoutExpired:
            pr.popen.kill()
        if pr in PROCS:
            PROCS.remove(pr)

    # ---- boto3 ------------------------------------------------------------------------------
    def run_boto3(self, n: int) -> dict[str, Any]:
        tag = f"boto3-N{n}-b{int(self.bucket_mbit)}"
        nodes = list(range(1, n + 1))
        clear_shm("n")
        procs = {}
        for i in nodes:
            procs[i] = spawn(
                f"s3get-n{i}",
                node_ns(i),
                [
                    PY,
                    "-m",
                    "bench.swarm.s3get",
                    "--endpoint",
                    f"http://{BUCKET_IP}:{S3_PORT}",
                    "--bucket",
                    BUCKET,
                    "--prefix",
                    f"{PREFIX}/{IDENTITY}",
                    "--out",
                    str(SHM / f"n{i}"),
                    "--digests",
                    str(self.digests_file),
                ],
                capture=True,
                logfile=WORK / "logs" / f"{tag}-n{i}.err",
            )
        meter = Meter(nodes, list(procs.values()) + [self.moto])  # type: ignore[list-item]
        deadline = time.monotonic() + self.timeout(n)
        while time.monotonic() < deadline and any(p.popen.poll() is None for p in procs.values()):
            time.sleep(0.2)
            meter.sample_cpu()
        m = meter.finish()
        res = {}
        for i, p in procs.items():
            stop(p)
            js = [json.loads(x) for x in p.lines if x.startswith("{")]
            if js and p.popen.returncode == 0:
                res[i] = js[-1]
        ok = len(res) == n
        t0 = min(r["start"] for r in res.values()) if res else 0
        seconds = max(r["done"] for r in res.values()) - t0 if ok else None
        for i, r in res.items():
            m["per_node"][f"n{i}"].update(done_s=round(r["done"] - t0, 2), fetch_s=round(r["fetched"] - r["start"], 2))
        egress = sum(r["bytes"] for r in res.values())
        clear_shm("n")
        return self.row(
            "boto3",
            n,
            seconds,
            egress,
            None,
            verified=ok or None,
            failed=None if ok else {i: "no result" for i in nodes if i not in res},
            **m,
        )

    # ---- libtorrent -------------------------------------------------------------------------
    def torrent(self) -> Path:
        from bench.swarm.lt_node import make_torrent

        t = self.snap.parent / f"{self.snap.name}.torrent"
        if not t.exists():
            make_torrent(self.snap, self.names, t, self.args.piece_kib * 1024)
        return t

    def run_libtorrent(self, n: int, fault: str | None = None) -> dict[str, Any]:
        tag = f"lt-N{n}-{fault or 'nofault'}-b{int(self.bucket_mbit)}"
        nodes = list(range(1, n + 1))
        clear_shm("n")
        tor = self.torrent()
        procs = {}
        for i in nodes:
            argv = [
                PY,
                "-m",
                "bench.swarm.lt_node",
                "--torrent",
                str(tor),
                "--save",
                str(SHM / f"n{i}"),
                "--ip",
                node_ip(i),
                "--peers",
                ",".join(f"{node_ip(j)}:6881" for j in nodes if j != i),
                "--timeout",
                str(self.timeout(n)),
            ]
            if i == 1:
                argv += [
                    "--seed-from-bucket",
                    "--endpoint",
                    f"http://{BUCKET_IP}:{S3_PORT}",
                    "--bucket",
                    BUCKET,
                    "--prefix",
                    f"{PREFIX}/{IDENTITY}",
                ]
            procs[i] = spawn(f"lt-n{i}", node_ns(i), argv, capture=True, logfile=WORK / "logs" / f"{tag}-n{i}.err")
        meter = Meter(nodes, list(procs.values()) + [self.moto])  # type: ignore[list-item]
        victim = n if fault else None
        killed_at: list[float] = []

        def events(i: int, kind: str) -> list[dict[str, Any]]:
            out = []
            for x in list(procs[i].lines):
                if x.startswith("{"):
                    e = json.loads(x)
                    if e.get("event") == kind:
                        out.append(e)
            return out

        deadline = time.monotonic() + self.timeout(n)
        t_start = time.time()
        while time.monotonic() < deadline:
            time.sleep(0.2)
            meter.sample_cpu()
            if victim and not killed_at:
                prog = events(victim, "progress")
                if prog and prog[-1]["p"] >= 0.5:
                    procs[victim].popen.kill()
                    self.cluster.link(victim, False)  # type: ignore[union-attr]
                    killed_at.append(time.time())
                    log(f"fault: killed lt n{victim} at {prog[-1]['p']:.0%} and took its link down")
            if all(events(i, "done") for i in nodes if i != victim):
                break
            if any(procs[i].popen.poll() is not None for i in nodes if i != victim):
                break
        m = meter.finish()
        for p in procs.values():
            stop(p, 10)
        if victim:
            self.cluster.link(victim, True)  # type: ignore[union-attr]
        starts = [e["t"] for i in nodes for e in events(i, "start")]
        t0 = min(starts) if starts else t_start
        survivors = [i for i in nodes if i != victim]
        ok = all(events(i, "done") for i in survivors)
        seconds = max(events(i, "done")[0]["t"] for i in survivors) - t0 if ok else None
        fetched = events(1, "fetched")
        egress = fetched[0]["bytes"] if fetched else None
        for i in nodes:
            d = events(i, "done")
            st = events(i, "stats")
            if d:
                m["per_node"][f"n{i}"]["done_s"] = round(d[0]["t"] - t0, 2)
            if st:
                m["per_node"][f"n{i}"].update(payload_up=st[-1]["upload"], payload_down=st[-1]["download"])
        if fetched:
            m["seed_fetch_s"] = round(fetched[0]["t"] - t0, 2)
        verified = None
        if ok and not self.args.no_verify:
            verified = all(self.check_files(SHM / f"n{i}" / self.snap.name) for i in survivors)
        clear_shm("n")
        return self.row(
            "libtorrent",
            n,
            seconds,
            egress,
            fault,
            verified=verified,
            killed_at_s=round(killed_at[0] - t0, 2) if killed_at else None,
            survivors=len(survivors) if fault else None,
            **m,
        )


# ---------------------------------------------------------------------------------------------
# set-up steps


def start_moto(ns: str, host: str, tag: str) -> Proc:
    # bench.swarm.moto_ranges: moto with ranged GETs that cost their range, not the whole object
    pr = spawn(
        f"moto-{tag}",
        ns,
        [PY, "-m", "bench.swarm.moto_ranges", "-H", "0.0.0.0", "-p", str(S3_PORT)],
        logfile=WORK / "logs" / f"moto-{tag}.log",
    )
    wait_until(
        lambda: (
            urllib.request.urlopen(f"http://{host}:{S3_PORT}/", timeout=2).status == 200 if ns == BUCKET_NS else True
        ),
        30,
        "moto",
    )
    return pr


def ns_python(ns: str | None, code: str, timeout: float = 600) -> str:
    argv = (["ip", "netns", "exec", ns] if ns else []) + [PY, "-c", code]
    r = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=dict(os.environ, **AWS_ENV, PYTHONPATH=str(REPO)),
    )
    if r.returncode != 0:
        raise RuntimeError(f"python in {ns}: {r.stderr.strip()[-2000:]}")
    return r.stdout


def create_bucket(ns: str | None, endpoint: str) -> None:
    code = (
        f"import boto3,time\nc=boto3.client('s3',endpoint_url={endpoint!r},region_name='us-east-1')\n"
        "for _ in range(100):\n  try:\n    c.create_bucket(Bucket=" + repr(BUCKET) + "); break\n"
        "  except Exception as e:\n    time.sleep(0.2)\n"
    )
    ns_python(ns, code)


def publish(
    ns: str | None,
    endpoint: str,
    snap: Path,
    chunk_bytes: int | None = None,
    identity: str = IDENTITY,
    version: int = 1,
    bucket: str = f"s3://{BUCKET}/{PREFIX}",
) -> None:
    """``bdn-publish full`` of ``snap`` (``chunk_bytes``: the manifest's chunk size, default bdn's)."""
    argv = (["ip", "netns", "exec", ns] if ns else []) + [
        str(BIN / "bdn-publish"),
        "full",
        "--dir",
        str(snap),
        "--bucket",
        bucket,
        "--identity",
        identity,
        "--policy-version",
        str(version),
        "--overwrite",
    ]
    argv += ["--endpoint-url", endpoint] if bucket.startswith("s3://") else []
    if chunk_bytes:
        argv += ["--chunk-size", str(chunk_bytes)]
    r = subprocess.run(
        argv, capture_output=True, text=True, timeout=900, env=dict(os.environ, **AWS_ENV, PYTHONPATH=str(REPO))
    )  # this tree's bdn, installed or not
    if r.returncode != 0:
        raise RuntimeError(f"bdn-publish: {r.stderr.strip()}")


def moto_get_rate(ns: str | None, endpoint: str, key: str, size: int, streams: int) -> float:
    """MB/s of ``streams`` parallel ranged GETs of one object (unshaped): moto's own ceiling."""
    code = f"""
import boto3, time
from concurrent.futures import ThreadPoolExecutor
from botocore.config import Config
c = boto3.client('s3', endpoint_url={endpoint!r}, region_name='us-east-1', config=Config(max_pool_connections=32))
size, n, ch = {size}, {streams}, 16 * 2**20
def get(off):
    b = c.get_object(Bucket={BUCKET!r}, Key={key!r}, Range=f'bytes={{off}}-{{min(size, off + ch) - 1}}')['Body']
    t = 0
    while True:
        x = b.read(1 << 20)
        if not x: return t
        t += len(x)
t0 = time.time()
with ThreadPoolExecutor(n) as ex:
    tot = sum(ex.map(get, range(0, size, ch)))
print(tot / (time.time() - t0) / 1e6)
"""
    return float(ns_python(ns, code).strip())


#: One pretouch worker: maps ``gib`` GiB of anonymous memory with MAP_POPULATE (every page
#: written by the kernel) 1 GiB at a time, then exits, freeing it.
_PRETOUCH = (
    "import mmap, sys\n"
    "ms = [mmap.mmap(-1, 1 << 30, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)"
    " for _ in range(int(sys.argv[1]))]\n"
)
#: GiB of the machine's available memory the pretouch leaves alone.
PRETOUCH_MARGIN_GIB = 1.5


def pretouch() -> float:
    """Touch nearly all of the guest's available memory and free it again, right before a run;
    returns the GiB touched.

    Why (measured on this VM, 2026-12-02): this VM's host backs a
    guest page only when it is first touched, and takes freed guest memory back within minutes
    (free page reporting), so a run that lands its snapshot in fresh tmpfs pages pays ~2.9 s of
    CPU per GiB of first touch (0.26 s/GiB for memory touched before), 8 nodes at once on 2
    cores. A GPU node's memory is pinned by its hypervisor for device passthrough (or the node is
    bare metal), so there a fresh page costs its zeroing only. Touching 3 GiB was not enough (2
    of 3 ceiling runs still paid it: the allocator hands out other free pages than the ones just
    touched), so the whole available memory but ``PRETOUCH_MARGIN_GIB`` is touched. Every
    system of the run gets it."""
    t0 = time.monotonic()
    avail = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            avail = int(line.split()[1]) * 1024
    n = max(0, int(avail / (1 << 30) - PRETOUCH_MARGIN_GIB))
    workers = max(1, min(os.cpu_count() or 1, n))
    per = [n // workers + (1 if k < n % workers else 0) for k in range(workers)]
    procs = [subprocess.Popen([sys.executable, "-c", _PRETOUCH, str(g)]) for g in per if g]
    for pr in procs:
        pr.wait()
    log(f"    pretouched {n} GiB of guest memory in {time.monotonic() - t0:.1f} s")
    return float(n)


def recycled_bytes(logfile: Path, identity: str) -> int | None:
    """Bytes of ``identity``'s files the receiver reserved in recycled pages (its log line)."""
    try:
        text = logfile.read_text(errors="replace")
    except OSError:
        return None
    got = re.findall(rf"snapshot {identity}: reserved \d+ bytes, (\d+) in recycled pages", text)
    return int(got[-1]) if got else None


def wait_idle(procs: list[Proc], quiet: float = 0.05, window: float = 1.0, timeout: float = 120.0) -> float:
    """Wait until every process of ``procs`` used under ``quiet`` CPU-s in one ``window`` s
    (background work after a ready snapshot, a seed's copy, done), at most ``timeout`` s (then
    logged); returns the seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        c0 = [cpu_seconds(p.pid) for p in procs]
        time.sleep(window)
        if all(cpu_seconds(p.pid) - c < quiet for p, c in zip(procs, c0)):
            break
    else:
        log(f"    daemons still busy after {timeout:g} s: measured anyway")
    return time.monotonic() - t0


def ceiling(b: Bench) -> None:
    """One bdnd pulls the snapshot from another over unshaped loopback; iperf3 on the same loopback."""
    sh(f"ip netns add {LO_NS}")
    sh(f"ip netns exec {LO_NS} ip link set lo up")
    # The bucket is a file:// one: the ceiling measures lo1 -> lo2 only, and moto (Python) took
    # 190 s to serve lo1 its 1 GiB on the loaded machine (2026-12-01 14:34).
    bdir = WORK / "bucket-lo"
    shutil.rmtree(bdir, ignore_errors=True)
    bdir.mkdir(parents=True)
    ep, bucket = "", f"file://{bdir}"
    # --ceiling-pages recycled: the receiver first loads two warm-up snapshots (other bytes) and
    # collects the older, so the measured one lands in the page pool's spares (RL's steady
    # state: step N+2 receives into the pages of step N); fresh: into new tmpfs pages.
    recycled = b.args.ceiling_pages == "recycled"
    warm = ("warm000001", "warm000002") if recycled else ()
    # lo1 keeps every snapshot, lo2 two (one of them its spare); each seeds its first one unless
    # BDN_SPARSE_SEED_MBIT=0
    seeds = 0 if str(b.args.bdn_env.get("BDN_SPARSE_SEED_MBIT", "")).strip() in ("0", "0.0") else 2
    wait_for_memory(((5 if recycled else 2) + seeds) * b.size + (3 << 29), "the ceiling")
    if recycled:
        from bench.swarm.snapshot import make_snapshot

        wsnap = make_snapshot(CACHE / "warm", b.size, seed=2)
        for v, w in enumerate(warm, 1):
            publish(LO_NS, ep, wsnap, identity=w, version=v, bucket=bucket)
    publish(LO_NS, ep, b.snap, version=3 if recycled else 1, bucket=bucket)
    clear_shm("lo")
    rev = daemon_rev()
    ds = {}
    for i, port in ((1, 7180), (2, 7280)):
        sockp = WORK / f"lo{i}.sock"
        env = dict(
            AWS_ENV,
            BDN_BUCKET=bucket,
            BDN_NODE_ID=f"lo{i}",
            BDN_PEER_LISTEN=f"127.0.0.1:{port}",
            BDN_ADVERTISE_URL=f"http://127.0.0.1:{port}",
            BDN_LOCAL_LISTEN=f"127.0.0.1:{port + 1}",
            BDN_LOCAL_SOCKET=str(sockp),
            BDN_SHM_DIR=str(SHM / f"lo{i}"),
            BDN_PARTITION_SECRET_FILE=str(WORK / "secret"),
            BDN_PEERS="" if i == 1 else "http://127.0.0.1:7180",
            BDN_LOAD_STARTUP="false",
        )
        if recycled:  # lo1 keeps all three; lo2 only the newest, collected at once
            env.update({"BDN_KEEP_READY": "3"} if i == 1 else {"BDN_KEEP_READY": "1", "BDN_GC_GRACE_S": "0"})
        env.update(b.args.bdn_env)
        if b.args.bdn_src:  # another tree's bdn (main's, for the baseline) ahead of this one's
            env["BENCH_PYTHONPATH"] = b.args.bdn_src
        if i == 2:
            # B starts after A is ready, so everything B needs is already on a peer.
            for ident in (*warm, IDENTITY):
                st, _ = api(ds[1][1], "POST", f"/v1/snapshots/{ident}/prefetch")
                wait_until(
                    lambda ident=ident: api(ds[1][1], "GET", f"/v1/snapshots/{ident}")[1]["state"] == "ready",
                    600,
                    f"A has {ident} from the bucket",
                    every=0.5,
                )
        pr = spawn(f"bdnd-lo{i}", LO_NS, [str(BIN / "bdnd")], env, WORK / "logs" / f"ceiling-lo{i}.log")
        ds[i] = (pr, sockp)
        wait_until(lambda sockp=sockp: api(sockp, "GET", "/v1/health")[0] == 200, 60, f"bdnd lo{i}")
    wait_until(
        lambda: (
            all(p["alive"] for p in api(ds[2][1], "GET", "/v1/status")[1]["peers"])
            and api(ds[2][1], "GET", "/v1/status")[1]["peers"]
        ),
        60,
        "lo2 sees lo1",
    )
    time.sleep(3)  # let lo1 learn lo2 in a membership round too
    for ident in warm:  # the second warm-up's ready collects the first: its files become spares
        api(ds[2][1], "POST", f"/v1/snapshots/{ident}/prefetch")
        wait_until(
            lambda ident=ident: api(ds[2][1], "GET", f"/v1/snapshots/{ident}")[1]["state"] == "ready",
            600,
            f"lo2 has {ident}",
            every=0.5,
        )
    # Once a snapshot is ready a daemon copies it into a seed in the background (docs/OPERATIONS.md):
    # the measured download starts when neither daemon is busy any more, as a node's next step does.
    idle_s = wait_idle([p for p, _ in ds.values()])
    log(f"    both daemons idle after {idle_s:.1f} s")
    c0 = {i: cpu_seconds(p.pid) for i, (p, _) in ds.items()}
    m0 = machine_cpu()
    prof = b.start_profile(ds[2][0], "ceiling-receiver") if b.args.profile else None
    prof1 = b.start_profile(ds[1][0], "ceiling-sender") if b.args.profile else None
    t0 = time.time()
    api(ds[2][1], "POST", f"/v1/snapshots/{IDENTITY}/prefetch")
    st, body = 202, None
    deadline = time.monotonic() + 600
    while st == 202 and time.monotonic() < deadline:
        st, body = api(ds[2][1], "GET", f"/v1/snapshots/{IDENTITY}/wait?state=ready&timeout=30", timeout=40)
    secs = time.time() - t0
    c1 = {i: cpu_seconds(p.pid) for i, (p, _) in ds.items()}
    m1 = machine_cpu()
    for pf, tg in ((prof, "ceiling-receiver"), (prof1, "ceiling-sender")):
        if pf:
            b.stop_profile(pf, tg)
    s2 = api(ds[2][1], "GET", "/v1/status")[1]
    cpu = {f"lo{i}": round(c1[i] - c0[i], 2) for i in ds}
    tot_cpu = sum(cpu.values())
    ok = st == 200
    verified = b.check_files(SHM / "lo2" / s2["swarm_id"] / IDENTITY) if ok else False
    c = s2["counters"]
    b.rows.append(
        {
            "system": "bdn-loopback",
            "nodes": 2,
            "snapshot_bytes": b.size,
            "nic_mbit": None,
            "seconds": round(secs, 2) if ok else None,
            "floor_seconds": None,
            "bucket_egress_bytes": c["bucket_bytes_owner"]
            + c["bucket_bytes_fallback"]
            + c.get("bucket_manifest_bytes", 0),
            "fault": None,
            "MB_per_s": round(b.size / secs / 1e6, 1),
            "MB_per_cpu_s": round(b.size / tot_cpu / 1e6, 1),
            "cpu_seconds": cpu,
            "machine_cpu_busy": round((m1[0] - m0[0]) / max(1, m1[1] - m0[1]), 3),
            "peer_bytes_in": c["peer_bytes_in"],
            "verified": verified,
            "cores": os.cpu_count(),
            "daemon_commit": rev,
            "bdn_src": b.args.bdn_src or None,
            "pages": b.args.ceiling_pages,
            "recycled_bytes": recycled_bytes(WORK / "logs" / "ceiling-lo2.log", IDENTITY),
            "idle_wait_s": round(idle_s, 1),
        }
    )
    log(f"ceiling: bdn lo1 -> lo2 {b.size / secs / 1e6:.0f} MB/s, {b.size / tot_cpu / 1e6:.0f} MB per CPU-s {cpu}")
    for p, _ in ds.values():
        stop(p)
    shutil.rmtree(bdir, ignore_errors=True)
    clear_shm("lo")
    # iperf3 over the same loopback, in the same run
    srv = spawn(
        "iperf3-s",
        LO_NS,
        ["iperf3", "-s", "-1", "-B", "127.0.0.1", "-p", "5201"],
        logfile=WORK / "logs" / "iperf3-s.log",
    )
    time.sleep(1)
    r = subprocess.run(
        ["ip", "netns", "exec", LO_NS, "iperf3", "-c", "127.0.0.1", "-p", "5201", "-t", "10", "-J"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    stop(srv)
    j = json.loads(r.stdout)
    bps = j["end"]["sum_received"]["bits_per_second"]
    cpu_u = j["end"]["cpu_utilization_percent"]
    # iperf3 reports each side's CPU as % of one core over the test: bytes per CPU-second follow.
    cpu_s = (cpu_u["host_total"] + cpu_u["remote_total"]) / 100 * j["end"]["sum_received"]["seconds"]
    nbytes = j["end"]["sum_received"]["bytes"]
    b.rows.append(
        {
            "system": "iperf3-loopback",
            "nodes": 2,
            "snapshot_bytes": nbytes,
            "nic_mbit": None,
            "seconds": round(j["end"]["sum_received"]["seconds"], 2),
            "floor_seconds": None,
            "bucket_egress_bytes": None,
            "fault": None,
            "MB_per_s": round(bps / 8 / 1e6, 1),
            "MB_per_cpu_s": round(nbytes / cpu_s / 1e6, 1) if cpu_s else None,
            "cpu_utilization_percent": cpu_u,
        }
    )
    log(f"ceiling: iperf3 {bps / 8 / 1e6:.0f} MB/s, cpu {cpu_u}")
    if b.args.ceiling_pages == "fresh":
        # the same, the server writing what it receives into a new file on the shm tmpfs (fresh
        # pages, as bdn's receiver does): what landing bytes in fresh pages costs any receiver
        # on this machine; 1 GiB (-n), not 10 s of it
        out = SHM / "lo-iperf3.bin"
        out.unlink(missing_ok=True)
        srv = spawn(
            "iperf3-s",
            LO_NS,
            ["iperf3", "-s", "-1", "-B", "127.0.0.1", "-p", "5201", "-F", str(out)],
            logfile=WORK / "logs" / "iperf3-s-file.log",
        )
        time.sleep(1)
        r = subprocess.run(
            ["ip", "netns", "exec", LO_NS, "iperf3", "-c", "127.0.0.1", "-p", "5201", "-n", str(b.size), "-J"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        stop(srv)
        landed = out.stat().st_size if out.exists() else 0
        out.unlink(missing_ok=True)
        j = json.loads(r.stdout)
        e = j["end"]
        bps_f, cpu_f = e["sum_received"]["bits_per_second"], e["cpu_utilization_percent"]
        cpu_s = (cpu_f["host_total"] + cpu_f["remote_total"]) / 100 * e["sum_received"]["seconds"]
        b.rows.append(
            {
                "system": "iperf3-loopback-shm-file",
                "nodes": 2,
                "snapshot_bytes": e["sum_received"]["bytes"],
                "nic_mbit": None,
                "seconds": round(e["sum_received"]["seconds"], 2),
                "floor_seconds": None,
                "bucket_egress_bytes": None,
                "fault": None,
                "MB_per_s": round(bps_f / 8 / 1e6, 1),
                "MB_per_cpu_s": round(e["sum_received"]["bytes"] / cpu_s / 1e6, 1) if cpu_s else None,
                "cpu_utilization_percent": cpu_f,
                "landed_bytes": landed,
                "pages": "fresh",
            }
        )
        log(f"ceiling: iperf3 into a fresh shm file {bps_f / 8 / 1e6:.0f} MB/s, cpu {cpu_f}, {landed} bytes landed")
    b.save()
    sh(["ip", "netns", "del", LO_NS], check=False)
    time.sleep(0.5)  # the namespace's loopback must be gone before the next run adds it again


# ---------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", default="2,4,8", help="comma list of cluster sizes")
    ap.add_argument("--nic-mbit", type=float, default=200, help="each node's NIC rate, both ways")
    ap.add_argument("--bucket-mbit", type=float, default=200, help="the bucket's egress rate")
    ap.add_argument(
        "--bucket-fast-x",
        type=float,
        default=0,
        help="one more run of every system at the largest N with the bucket this many times faster",
    )
    ap.add_argument("--snapshot-gb", type=float, default=1.0, help="snapshot size in GiB (bf16 safetensors)")
    ap.add_argument(
        "--systems",
        default="bdn,boto3,libtorrent",
        help="comma list of bdn, bdn_recycled (bdn with a collected snapshot's pages in every "
        "node's page pool), boto3, libtorrent",
    )
    ap.add_argument("--fault", default="", help="kill50: kill one node (process and link) at 50%% of its download")
    ap.add_argument("--fault-systems", default="bdn,libtorrent")
    ap.add_argument("--ceiling", action="store_true", help="also: bdnd -> bdnd over loopback vs iperf3")
    ap.add_argument("--ceiling-only", action="store_true")
    ap.add_argument(
        "--ceiling-pages",
        choices=("fresh", "recycled"),
        default="fresh",
        help="the ceiling's receiver lands bytes in new tmpfs pages, or in a collected "
        "snapshot's recycled ones (bdn.daemon.store.spares)",
    )
    ap.add_argument(
        "--pretouch",
        action="store_true",
        help="before every run, touch and free the guest's available memory (but 1.5 GiB), so "
        "that fresh tmpfs pages cost what they cost where the hypervisor pins memory (pretouch())",
    )
    ap.add_argument("--quick", action="store_true", help="N=2,4 at 200 Mbit/s, 256 MiB snapshot")
    ap.add_argument("--mtu", type=int, default=9000)
    ap.add_argument("--piece-kib", type=int, default=4096, help="BitTorrent piece size")
    ap.add_argument(
        "--chunk-mib",
        type=int,
        default=4,
        help="bdn's chunk size for the swarm runs (0: bdn-publish's default, 16 MiB); 4 MiB = "
        "the BitTorrent piece size, so both systems move the same pieces",
    )
    ap.add_argument("--profile", action="store_true", help="py-spy record node 1's bdnd in each bdn run")
    ap.add_argument("--no-verify", action="store_true", help="skip the harness's own digest check of each node's files")
    ap.add_argument("--bdn-env", default="", help="extra BDN_*=v,... for every bdnd")
    ap.add_argument(
        "--bdn-variants",
        default="",
        help="extra bdn runs at the largest N: name:BDN_K=v,...;name2:... (tuning experiments)",
    )
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "swarm.json"))
    ap.add_argument(
        "--bdn-src",
        default="",
        help="directory holding a (patched) copy of the bdn package, imported ahead of the repo's "
        "by every bdnd: for experiments on the daemon without editing it; rows then record it",
    )
    ap.add_argument(
        "--ab-src",
        default="",
        help="LABEL=DIR: every bdn run is paired with the same run of the bdn package in DIR (an older "
        "commit's, from git archive), its row's system suffixed @LABEL; the two alternate in ABBA order, "
        "so a loaded machine's drift falls on both alike",
    )
    ap.add_argument(
        "--merge", action="store_true", help="keep the rows already in --out, except points this run measures again"
    )
    ap.add_argument("--cleanup", action="store_true", help="only remove what a previous run left")
    from bench.runs import add_runs_arg

    add_runs_arg(ap)
    a = ap.parse_args()
    if os.geteuid() != 0:
        print("bench/swarm/run.py needs root (network namespaces and tc)", file=sys.stderr)
        return 2
    a.bdn_env = dict(kv.split("=", 1) for kv in a.bdn_env.split(",") if kv)
    if a.cleanup and not a.ceiling_only:  # the cluster and its in-run ceiling namespace
        cleanup(cluster=True, ceiling=True)
        return 0
    if a.ceiling_only:
        # Its own namespace, work, shm and cache directories, and a cleanup that touches only
        # those: a --ceiling-only run leaves a cluster run of this script (bridge, bdnb-*
        # namespaces, /tmp/bdnbench, /dev/shm/bdnbench) alone, so both can run on one machine.
        global WORK, SHM, CACHE, LO_NS
        WORK, SHM, CACHE, LO_NS = (
            Path("/tmp/bdnceiling"),
            Path("/dev/shm/bdnceiling"),
            Path("/var/tmp/bdnceiling"),
            "bdnc-lo",
        )
        if a.cleanup:
            cleanup_ceiling()
            return 0
    if a.quick:
        a.nodes, a.nic_mbit, a.bucket_mbit, a.snapshot_gb = "2,4", 200, 200, 0.25
    ns_list = [int(x) for x in a.nodes.split(",") if x]
    systems = [s for s in a.systems.split(",") if s]

    from bench.swarm.snapshot import digest_table, make_snapshot, snapshot_bytes, snapshot_files

    def tidy() -> None:
        if a.ceiling_only:
            cleanup_ceiling()
        else:
            cleanup(cluster=True, ceiling=a.ceiling)

    tidy()
    (WORK / "logs").mkdir(parents=True, exist_ok=True)
    (WORK / "secret").write_text(os.urandom(32).hex() + "\n")
    snap = make_snapshot(CACHE, int(a.snapshot_gb * 2**30))
    dfile = snap.parent / f"{snap.name}.digests.json"
    if not dfile.exists():
        dfile.write_text(json.dumps(digest_table(snap)))
    digests = json.loads(dfile.read_text())
    b = Bench(
        a,
        snap,
        [p.name for p in snapshot_files(snap)],
        snapshot_bytes(snap),
        dfile,
        digests,
        nic_mbit=a.nic_mbit,
        bucket_mbit=a.bucket_mbit,
    )
    if a.merge and Path(a.out).exists():
        b.prior = json.loads(Path(a.out).read_text())
    log(f"snapshot {snap}: {b.size} bytes, floor {b.floor():.1f} s at {a.nic_mbit:g} Mbit/s")
    try:
        if not a.ceiling_only:
            b.cluster = Cluster(max(ns_list), a.mtu)
            b.cluster.setup()
            ep = f"http://{BUCKET_IP}:{S3_PORT}"
            b.moto = start_moto(BUCKET_NS, BUCKET_IP, "bucket")
            create_bucket(None, ep)
            t = time.time()
            publish(None, ep, snap, a.chunk_mib << 20 if a.chunk_mib else None)
            log(f"published in {time.time() - t:.1f} s")
            big = max(b.names, key=lambda n: (snap / n).stat().st_size)
            r1 = moto_get_rate(node_ns(1), ep, f"{PREFIX}/{IDENTITY}/{big}", (snap / big).stat().st_size, 1)
            r8 = moto_get_rate(node_ns(1), ep, f"{PREFIX}/{IDENTITY}/{big}", (snap / big).stat().st_size, 8)
            log(
                f"moto GET unshaped: {r1:.0f} MB/s with 1 stream, {r8:.0f} MB/s with 8 "
                f"(NIC {a.nic_mbit / 8:.0f} MB/s, bucket {a.bucket_mbit / 8:.0f} MB/s)"
            )
            b.rows.append(
                {
                    "system": "moto-unshaped-get",
                    "nodes": 1,
                    "snapshot_bytes": (snap / big).stat().st_size,
                    "nic_mbit": None,
                    "seconds": None,
                    "floor_seconds": None,
                    "bucket_egress_bytes": None,
                    "fault": None,
                    "MB_per_s_1_stream": round(r1, 1),
                    "MB_per_s_8_streams": round(r8, 1),
                }
            )
            b.cluster.shape(a.nic_mbit, a.bucket_mbit)
            for n in ns_list:
                for s in systems:
                    log(f"--- {s} N={n}")
                    b.point(b.run_ab if a.ab_src else getattr(b, f"run_{s}"), *([s] if a.ab_src else []), n)
            top = max(ns_list)
            if a.fault:
                for s in systems:
                    if s in a.fault_systems.split(","):
                        log(f"--- {s} N={top} fault {a.fault}")
                        b.point(
                            b.run_ab if a.ab_src else getattr(b, f"run_{s}"),
                            *([s] if a.ab_src else []),
                            top,
                            fault=a.fault,
                        )
            for spec in [v for v in a.bdn_variants.split(";") if v]:
                # A tuning experiment: the same bdn at the largest N with other settings.
                vname, _, kvs = spec.partition(":")
                saved = a.bdn_env
                a.bdn_env = dict(saved, **dict(kv.split("=", 1) for kv in kvs.split(",") if kv))
                log(f"--- bdn[{vname}] N={top} {a.bdn_env}")
                b.point(b.run_bdn, top, system=f"bdn[{vname}]")
                a.bdn_env = saved
            if a.bucket_fast_x:
                b.bucket_mbit = a.bucket_mbit * a.bucket_fast_x
                b.cluster.shape(a.nic_mbit, b.bucket_mbit)
                for s in systems:
                    log(f"--- {s} N={top} bucket {b.bucket_mbit:g} Mbit/s")
                    b.point(getattr(b, f"run_{s}"), top)
                b.bucket_mbit = a.bucket_mbit
            if b.moto:
                stop(b.moto)
        if a.ceiling or a.ceiling_only:
            tidy()
            b.point(ceiling, b, metrics=("MB_per_s", "MB_per_cpu_s"), by="MB_per_s")
    finally:
        b.save()
        tidy()
    log(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
