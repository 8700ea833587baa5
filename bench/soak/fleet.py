"""The soak's processes: a moto bucket behind a fault proxy, N bdnd daemons, a lying peer, an engine.

Everything listens on 127.0.0.1. :class:`Fleet` is thread-safe: the chaos loop kills and restarts
daemons while the trainer, the verifier and the sampler read :meth:`Fleet.live`. Each daemon's
incarnations (pid, start, end, how it ended) are recorded; a daemon that exits without being
killed by the chaos loop is recorded in ``unexpected_exits`` (a finding) and started again, as
systemd would. :meth:`Fleet.close` kills every process it started, whatever happened before.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))  # tests/support: real daemons, the fault proxy, the liar

from aiohttp import web  # noqa: E402

from support.faults import ChunkFaultProxy, listen_ports, stable_ports  # noqa: E402
from support.liar import Liar  # noqa: E402
from support.s3server import _error_xml, create_bucket, start_moto_server, stop_moto_server  # noqa: E402
from support.swarm import SECRET, Daemon  # noqa: E402

ENGINE_SERVER = REPO / "examples" / "engine" / "server.py"
PROBE_ENV = "SOAK_TRACEMALLOC"  # bench/soak/tmprobe.py: a daemon with it runs under the memory probe
OBJPROBE_ENV = "SOAK_OBJPROBE"  # bench/soak/objprobe.py: a daemon with it runs under the object census
TOKEN = "soak-trainer-token-0123456789abcdef"


def http_json(
    method: str, url: str, body: object | None = None, token: str | None = None, timeout: float = 30.0
) -> tuple[int, Any]:
    """One JSON request; ``(status, parsed body)``; OSError when nothing answered."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            return r.status, (json.loads(raw) if raw else {})
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, {"error": raw.decode(errors="replace")[:300]}


class BurstProxy(ChunkFaultProxy):
    """The fault proxy plus timed bursts: ``throttle_for(s)`` answers every request that arrives in
    the next ``s`` seconds with 503 SlowDown, as S3 throttles a hot prefix for a while (a burst
    measured in time, not in requests: the daemons' retries back off into it)."""

    def __init__(self, upstream: str) -> None:
        super().__init__(upstream)
        self._until = 0.0
        self.throttled = 0

    def throttle_for(self, seconds: float) -> None:
        with self._lock:
            self._until = max(self._until, time.monotonic() + seconds)

    async def _answer(self, request: web.Request, record, finished):  # type: ignore[no-untyped-def]
        with self._lock:
            burst = time.monotonic() < self._until
            if burst:
                self.throttled += 1
        if not burst:
            return await super()._answer(request, record, finished)
        body = _error_xml("SlowDown", "Please reduce your request rate (soak burst).", record.path).encode()
        record.status, record.injected, record.response_bytes = 503, True, len(body)
        return web.Response(status=503, body=body, content_type="application/xml")


class ProbedDaemon(Daemon):
    """A :class:`Daemon` started as ``python -m bench.soak.tmprobe`` (the daemon's own ``__main__``
    under a tracemalloc / mallinfo2 probe, bench/soak/tmprobe.py), snapshots in ``<dir>/tracemalloc``."""

    def start(self, peers: list[str]) -> None:
        env = dict(
            self.env,
            BDN_PEERS=",".join(p for p in peers if p != self.peer_url),
            SOAK_TRACEMALLOC_DIR=str(self.dir / "tracemalloc"),
        )
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.soak.tmprobe"], env=env, stdout=log, stderr=subprocess.STDOUT
        )
        log.close()


class CensusDaemon(Daemon):
    """A :class:`Daemon` started as ``python -m bench.soak.objprobe`` (the daemon's own ``__main__``
    with a census of its Python objects, bench/soak/objprobe.py), lines in ``<dir>/objprobe``."""

    def start(self, peers: list[str]) -> None:
        env = dict(
            self.env,
            BDN_PEERS=",".join(p for p in peers if p != self.peer_url),
            SOAK_OBJPROBE_DIR=str(self.dir / "objprobe"),
        )
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.soak.objprobe"], env=env, stdout=log, stderr=subprocess.STDOUT
        )
        log.close()


@dataclass
class Incarnation:
    """One process life of a daemon: ``ended_by`` is ``kill``, ``exit <rc>``, or ``""`` (running)."""

    pid: int
    started: float
    ended: float | None = None
    ended_by: str = ""
    with_liar: bool = False


@dataclass
class Node:
    daemon: Daemon
    state: str = "down"  # down | starting | up
    lives: list[Incarnation] = field(default_factory=list)
    base_env: dict[str, str] | None = None  # the daemon's variables without a life's own


class Fleet:
    """Moto + fault proxy + ``n`` daemons (+ liar, engine), under ``workdir`` and ``shm_root``.

    ``clock`` is the harness's monotonic clock (seconds since the soak began) used in records.
    """

    def __init__(
        self,
        workdir: Path,
        shm_root: Path,
        n: int,
        clock: Any,
        log_level: str = "info",
        engine_node: int = 1,
        daemon_env: dict[str, str] | None = None,
        node_env: dict[str, dict[str, str]] | None = None,
    ) -> None:
        self.workdir, self.shm_root, self.n, self.clock = workdir, shm_root, n, clock
        self.log_level = log_level
        self.daemon_env, self.node_env = dict(daemon_env or {}), dict(node_env or {})
        self.engine_node = f"node{engine_node % n}"
        self.token = TOKEN
        self.secret = SECRET
        self._lock = threading.RLock()
        self.nodes: dict[str, Node] = {}
        self.moto: subprocess.Popen[bytes] | None = None
        self.endpoint = ""
        self.bucket_url = ""
        self.proxy: BurstProxy | None = None
        self.liar: Liar | None = None
        self.engine: subprocess.Popen[bytes] | None = None
        self.engine_port = 0
        self.engine_lives: list[Incarnation] = []
        self.unexpected_exits: list[dict[str, Any]] = []
        self.shutdown_logs: dict[str, list[str]] = {}  # node -> its log after "stopping", when SIGTERM hung
        self.closed = False

    # ---- bring-up ------------------------------------------------------------------------
    def start_bucket(self) -> None:
        """moto on a loopback port, a fresh bucket, the proxy the daemons read through."""
        for k, v in (
            ("AWS_ACCESS_KEY_ID", "testing"),
            ("AWS_SECRET_ACCESS_KEY", "testing"),
            ("AWS_DEFAULT_REGION", "us-east-1"),
        ):
            os.environ.setdefault(k, v)
        os.environ.pop("AWS_PROFILE", None)
        self.moto, self.endpoint = start_moto_server()
        # The trainer and the liar (a subprocess inheriting this) reach moto directly.
        os.environ["AWS_ENDPOINT_URL"] = self.endpoint
        name = create_bucket(self.endpoint)
        self.bucket_url = f"s3://{name}/soak"
        self.proxy = BurstProxy(self.endpoint).start()

    def start_daemons(self, timeout: float = 600.0) -> None:  # 8 daemons importing at load 25+: minutes
        """Create and start every daemon; return once all see each other alive."""
        assert self.proxy is not None
        env = {
            "BDN_API_TOKEN": self.token,
            "BDN_ENDPOINT_URL": self.proxy.url,
            "BDN_LOG_LEVEL": self.log_level,
            **self.daemon_env,
        }
        for i in range(self.n):
            node_env = {**env, **self.node_env.get(f"node{i}", {})}
            kind = ProbedDaemon if node_env.get(PROBE_ENV) else CensusDaemon if node_env.get(OBJPROBE_ENV) else Daemon
            d = stable_ports(kind(self.workdir, f"node{i}", self.bucket_url, self.secret, node_env))
            d.shm_dir = self.shm_root / d.node_id
            d.env["BDN_SHM_DIR"] = str(d.shm_dir)
            self.nodes[d.node_id] = Node(d)
        for node in self.nodes.values():
            self._spawn(node, [])
        for node in self.nodes.values():
            node.daemon.wait_healthy(timeout)
            node.state = "up"
        self.wait_members(timeout)

    def wait_members(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            missing = {}
            ups = [n.daemon for n in self.live()]
            for d in ups:
                try:
                    alive = {p["node_id"] for p in d.status()["peers"] if p["alive"]}
                except OSError:
                    alive = set()
                want = {o.node_id for o in ups if o is not d}
                if not want <= alive:
                    missing[d.node_id] = sorted(want - alive)
            if not missing:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"members did not converge in {timeout} s: {missing}")
            time.sleep(0.5)

    # ---- daemons ---------------------------------------------------------------------------
    def _spawn(self, node: Node, extra_peers: list[str], env: dict[str, str] | None = None) -> None:
        peers = [n.daemon.peer_url for n in self.nodes.values()] + extra_peers
        base = node.base_env if node.base_env is not None else dict(node.daemon.env)
        node.base_env = base
        node.daemon.env = {**base, **(env or {})}  # a life's own variables (chaos "slow") end with it
        node.daemon.start(peers)
        assert node.daemon.proc is not None
        node.lives.append(Incarnation(node.daemon.proc.pid, self.clock(), with_liar=bool(extra_peers)))
        node.state = "starting"

    def live(self) -> list[Node]:
        """Daemons that answered health since their last start and have not been killed."""
        with self._lock:
            return [n for n in self.nodes.values() if n.state == "up"]

    def down(self) -> list[Node]:
        with self._lock:
            return [n for n in self.nodes.values() if n.state != "up"]

    def kill(self, node_id: str) -> int:
        """kill -9 one daemon; its pid."""
        with self._lock:
            node = self.nodes[node_id]
            proc = node.daemon.proc
            assert proc is not None
            node.state = "down"
            proc.kill()
            proc.wait()
            life = node.lives[-1]
            life.ended, life.ended_by = self.clock(), "kill"
            return proc.pid

    def restart(
        self,
        node_id: str,
        extra_peers: list[str] | None = None,
        timeout: float = 300.0,
        env: dict[str, str] | None = None,
    ) -> float:
        """Start a daemon that is down again (``env``: variables for this life only); wait until
        healthy; seconds it took."""
        t0 = time.monotonic()
        with self._lock:
            node = self.nodes[node_id]
            if self.closed or node.state != "down":
                return 0.0
            self._spawn(node, extra_peers or [], env)
        node.daemon.wait_healthy(timeout)
        with self._lock:
            if node.state == "starting":
                node.state = "up"
        return time.monotonic() - t0

    def reap(self) -> list[str]:
        """Find daemons that exited without being killed; record and restart them (as systemd would)."""
        dead = []
        with self._lock:
            for node in self.nodes.values():
                p = node.daemon.proc
                if node.state == "up" and p is not None and p.poll() is not None:
                    life = node.lives[-1]
                    life.ended, life.ended_by = self.clock(), f"exit {p.returncode}"
                    node.state = "down"
                    tail = node.daemon.log()[-1500:]
                    self.unexpected_exits.append(
                        {
                            "node": node.daemon.node_id,
                            "pid": p.pid,
                            "rc": p.returncode,
                            "t_s": round(self.clock(), 1),
                            "log_tail": tail,
                        }
                    )
                    dead.append(node.daemon.node_id)
        for nid in dead:
            try:
                self.restart(nid)
            except (RuntimeError, TimeoutError) as e:
                self.unexpected_exits.append({"node": nid, "restart_failed": str(e)[:500]})
        return dead

    # ---- the lying peer --------------------------------------------------------------------
    def start_liar(self) -> str:
        """Start the lying peer; its URL. It joins when a daemon lists it (see chaos)."""
        with self._lock:
            if self.liar is None:
                self.liar = Liar(self.workdir, self.bucket_url, self.secret).start()
            return self.liar.url

    def stop_liar(self) -> None:
        with self._lock:
            if self.liar is not None:
                self.liar.stop()
                self.liar = None

    # ---- the engine ------------------------------------------------------------------------
    def start_engine(self) -> int:
        """Start the reference engine against ``engine_node``'s local API; its pid."""
        with self._lock:
            d = self.nodes[self.engine_node].daemon
            if not self.engine_port:
                self.engine_port = listen_ports(1)[0]
            log = open(self.workdir / "engine.log", "ab")
            self.engine = subprocess.Popen(
                [
                    sys.executable,
                    str(ENGINE_SERVER),
                    "--bdn-url",
                    d.url,
                    "--listen",
                    f"127.0.0.1:{self.engine_port}",
                    "--replica-id",
                    d.node_id,
                    "--name",
                    "soak-engine",
                    "--connect-timeout",
                    "600",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            log.close()
            self.engine_lives.append(Incarnation(self.engine.pid, self.clock()))
            return self.engine.pid

    def kill_engine(self) -> int | None:
        """kill -9 the engine (it does not unregister); its pid, or None if it was not running."""
        with self._lock:
            p = self.engine
            if p is None or p.poll() is not None:
                return None
            p.kill()
            p.wait()
            self.engine = None
            life = self.engine_lives[-1]
            life.ended, life.ended_by = self.clock(), "kill"
            return p.pid

    @property
    def engine_url(self) -> str:
        return f"http://127.0.0.1:{self.engine_port}"

    # ---- teardown --------------------------------------------------------------------------
    def close(self, term_timeout: float = 20.0) -> dict[str, dict[str, Any]]:
        """Stop every process started here; remove shm. Daemons get SIGTERM first, all at once
        (README: they stop cleanly with exit 0), and are watched together every 50 ms; what each
        did is returned per node: ``{"pid", "exit_s"`` (seconds from SIGTERM to its exit, None if
        it did not), ``"rc"`` (None if it did not), ``"result"``: ``"exit 0"``, ``"exit N"``, or
        ``"did not exit in N s"`` (then it is SIGKILLed and its log after "stopping" kept in
        ``shutdown_logs``)}``. Then the engine, liar, proxy and moto are stopped."""
        shutdown: dict[str, dict[str, Any]] = {}
        with self._lock:
            self.closed = True
            running = {
                nid: n.daemon.proc
                for nid, n in self.nodes.items()
                if n.daemon.proc is not None and n.daemon.proc.poll() is None
            }
            if self.engine is not None and self.engine.poll() is None:
                self.engine.kill()
                self.engine.wait()
            t_term = time.monotonic()
            for p in running.values():
                p.send_signal(signal.SIGTERM)
            waiting = dict(running)
            while waiting and time.monotonic() - t_term < term_timeout:
                for nid, p in list(waiting.items()):
                    if p.poll() is not None:
                        shutdown[nid] = {
                            "pid": p.pid,
                            "exit_s": round(time.monotonic() - t_term, 2),
                            "rc": p.returncode,
                            "result": f"exit {p.returncode}",
                        }
                        del waiting[nid]
                time.sleep(0.05)
            for nid, p in waiting.items():
                if p.poll() is not None:  # exited in the last 50 ms
                    shutdown[nid] = {
                        "pid": p.pid,
                        "exit_s": round(time.monotonic() - t_term, 2),
                        "rc": p.returncode,
                        "result": f"exit {p.returncode}",
                    }
                    continue
                p.kill()
                p.wait()
                shutdown[nid] = {
                    "pid": p.pid,
                    "exit_s": None,
                    "rc": None,
                    "result": f"did not exit in {term_timeout:g} s",
                    "killed_rc": p.returncode,
                }
                self.shutdown_logs[nid] = self._after_stopping(self.nodes[nid].daemon)
            for node in self.nodes.values():
                if node.lives and node.lives[-1].ended is None:
                    node.lives[-1].ended, node.lives[-1].ended_by = self.clock(), "end"
                node.state = "down"
            if self.engine_lives and self.engine_lives[-1].ended is None:
                self.engine_lives[-1].ended, self.engine_lives[-1].ended_by = self.clock(), "end"
        self.stop_liar()
        if self.proxy is not None:
            self.proxy.stop()
            self.proxy = None
        if self.moto is not None:
            stop_moto_server(self.moto)
            self.moto = None
        shutil.rmtree(self.shm_root, ignore_errors=True)
        return shutdown

    @staticmethod
    def _after_stopping(d: Daemon, n: int = 12) -> list[str]:
        lines = d.log().splitlines()
        idx = max((i for i, line in enumerate(lines) if " stopping" in line), default=len(lines) - n)
        return [line[:300] for line in lines[idx : idx + n]]

    def kill_all(self) -> None:
        """Last resort (an exception during close): SIGKILL whatever is still running."""
        procs = [n.daemon.proc for n in self.nodes.values()] + [self.engine]
        if self.liar is not None:
            procs.append(self.liar.proc)
        if self.moto is not None:
            procs.append(self.moto)
        for p in procs:
            if p is not None and p.poll() is None:
                p.kill()
