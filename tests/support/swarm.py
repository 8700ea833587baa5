"""Real bdnd processes on loopback for tests: start, wait healthy, talk to, kill."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgpack

from bdn.proto.keys import derive_keys, sign_request

from .api import wait_for
from .peerproc import (  # relative: imported as support.swarm and as tests.support.swarm (bench/control)
    tail,
    wait_started,
)

SECRET = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"


#: Ports :func:`free_port` handed out in this process: never handed out twice.
_HANDED: set[int] = set()
#: One file per port handed out, naming the test process that took it (see :func:`_claim`).
PORT_CLAIMS = Path(tempfile.gettempdir()) / "bdn-test-ports"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _claim(port: int) -> bool:
    """Claim ``port`` for this process among every test process of the machine (pytest-xdist
    workers, other suites run at once): a file ``PORT_CLAIMS/<port>`` holding our pid, created
    exclusively; a claim whose process ended is taken over. Own code because a daemon binds
    its ports only once started (tens of seconds on a loaded machine), and in that window any
    other process's probe finds the port free: portpicker coordinates this only through its
    separate portserver process, port-for not across processes at all."""
    PORT_CLAIMS.mkdir(exist_ok=True)
    path = PORT_CLAIMS / str(port)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        try:
            pid = int(path.read_text() or 0)
        except (OSError, ValueError):
            return False
        if not pid or _pid_alive(pid):
            return False  # (0: its owner is writing it now)
        tmp = PORT_CLAIMS / f".{port}.{os.getpid()}"
        tmp.write_text(str(os.getpid()))
        os.replace(tmp, path)  # take the stale claim over atomically
        try:
            return path.read_text() == str(os.getpid())
        except OSError:
            return False
    with os.fdopen(fd, "w") as f:
        f.write(str(os.getpid()))
    return True


def free_port() -> int:
    """A free loopback port below the kernel's ephemeral range, so that no outgoing connection
    (to a peer, the proxy, moto) can take it between this check and the daemon's bind.

    Never the same port twice on the machine while the test process that took it runs
    (:func:`_claim`): a daemon's peer, local and transfer ports were three independent draws,
    so two of them could be one port, and two test processes could draw one port before either
    daemon bound it (the daemon then fails to bind, and until it exits its local port may be
    answered by a transfer server: the BadStatusLine once seen in test_http_guard's fixture)."""
    import random

    try:
        lo = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        lo = 32768
    for _ in range(1000):
        port = random.randint(10000, max(10001, lo - 1))
        if port in _HANDED:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        if not _claim(port):
            continue
        _HANDED.add(port)
        return port
    raise RuntimeError("no free port found")


class Daemon:
    """One bdnd process with its own ports, shm dir and log file."""

    def __init__(
        self,
        workdir: Path,
        node_id: str,
        bucket: str,
        secret: str = SECRET,
        extra_env: dict[str, str] | None = None,
        peer_port: int | None = None,
    ) -> None:
        self.node_id = node_id
        self.peer_port = peer_port or free_port()
        self.local_port = free_port()
        # An explicit transfer port: the default (peer port + 1 or + 2) can be another test
        # daemon's peer or local port, drawn at random from the same range.
        self.transfer_port = free_port()
        self.dir = workdir / node_id
        self.dir.mkdir(parents=True, exist_ok=True)
        self.shm_dir = self.dir / "shm"
        self.keys = derive_keys(secret)
        self.log_path = self.dir / "bdnd.log"
        secret_file = self.dir / "secret"
        secret_file.write_text(secret + "\n")
        self.env = {
            # the tests' own switches (BDN_TEST_*) are not bdnd's config: it refuses unknown BDN_ keys
            **{k: v for k, v in os.environ.items() if not k.startswith("BDN_TEST_")},
            "BDN_BUCKET": bucket,
            "BDN_NODE_ID": node_id,
            "BDN_PEER_LISTEN": f"127.0.0.1:{self.peer_port}",
            "BDN_ADVERTISE_URL": self.peer_url,
            "BDN_LOCAL_LISTEN": f"127.0.0.1:{self.local_port}",
            "BDN_TRANSFER_LISTEN": f"127.0.0.1:{self.transfer_port}",
            "BDN_SHM_DIR": str(self.shm_dir),
            "BDN_PARTITION_SECRET_FILE": str(secret_file),
            "BDN_MANIFEST_POLL_S": "0.2",
            "BDN_LOG_LEVEL": "debug",
            **(extra_env or {}),
        }
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.local_port}"

    @property
    def store(self) -> Path:
        """The daemon's store, ``<shm_dir>/<swarm_id>/``: one directory per snapshot it rebuilt."""
        return self.shm_dir / self.keys.swarm_id

    def start(self, peers: list[str]) -> None:
        env = dict(self.env, BDN_PEERS=",".join(p for p in peers if p != self.peer_url))
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bdn.daemon.main"], env=env, stdout=log, stderr=subprocess.STDOUT
        )
        log.close()

    def wait_healthy(
        self, timeout: float = 240.0
    ) -> None:  # generous: on a loaded machine the imports alone took 60+ s
        wait_started(self.proc, self._healthy, timeout, f"bdnd {self.node_id}", "healthy", self.log)

    def _healthy(self) -> bool:
        try:
            self.get("/v1/health")
            return True
        except (OSError, urllib.error.URLError, http.client.HTTPException):
            # (HTTPException: something that is not this daemon's HTTP answered, e.g. a
            # process that took the port; the daemon then exits, which wait_started reports)
            return False

    def log(self) -> str:
        """The last 6000 characters of the daemon's log."""
        return tail(self.log_path, 6000)

    def request(self, method: str, path: str, timeout: float = 60.0) -> tuple[int, Any]:
        req = urllib.request.Request(self.url + path, method=method)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                body = r.read()
                return r.status, (json.loads(body) if r.headers.get_content_type() == "application/json" else body)
        except urllib.error.HTTPError as e:
            body = e.read()
            try:
                return e.code, json.loads(body)
            except ValueError:
                return e.code, body

    def get(self, path: str, timeout: float = 60.0) -> Any:
        status, body = self.request("GET", path, timeout)
        if status >= 400:
            raise urllib.error.HTTPError(self.url + path, status, str(body), None, None)  # type: ignore[arg-type]
        return body

    def peer_post(self, route: str, message: Any, sender: str = "tester") -> tuple[int, bytes]:
        """``(status, body)`` of one ``POST /bdn/v1/<swarm_id>/<route>`` to the peer API with
        ``message`` as msgpack, signed with the swarm's keys as peer ``sender`` (for this daemon)."""
        path = f"/bdn/v1/{self.keys.swarm_id}/{route}"
        conn = http.client.HTTPConnection("127.0.0.1", self.peer_port, timeout=30)
        try:
            conn.request(
                "POST",
                path,
                body=msgpack.packb(message),
                headers={"Authorization": sign_request(self.keys, "POST", path, sender, to=self.node_id)},
            )
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()

    def prefetch(self, identity: str) -> tuple[int, Any]:
        return self.request("POST", f"/v1/snapshots/{identity}/prefetch")

    def wait_ready(self, identity: str, timeout: float = 120.0) -> dict[str, Any]:
        """``identity``'s record once it is ready (the daemon holds each poll up to 10 s);
        AssertionError at once if it fails, or with the log after ``timeout`` s."""

        def answer() -> tuple[int, Any]:
            status, body = self.request("GET", f"/v1/snapshots/{identity}/wait?state=ready&timeout=10")
            if status == 409:
                raise AssertionError(f"{self.node_id}: {identity} failed: {body.get('error')}")
            if status not in (200, 202, 404):
                raise AssertionError(f"{self.node_id}: wait answered {status}: {body}")
            return status, body

        return wait_for(
            answer,
            timeout,
            f"{identity} ready on {self.node_id}",
            0.1,
            until=lambda answer: answer[0] == 200,
            detail=self.log,
        )[1]

    def wait_settled(self, identity: str, timeout: float = 120.0) -> dict[str, Any]:
        """``identity``'s record as first seen ``failed`` or ``ready`` (polled every 0.1 s). A ready
        snapshot GC collected before a poll saw it (with ``keep_ready`` 1 the next one's READY
        frees it at once) is ``{"state": "ready", "collected": True}``: its READY and its removal
        are both in the log (a failed record is kept, so a 404 alone never stands for ready).
        AssertionError with the record and the log after ``timeout`` s."""

        def seen() -> dict[str, Any]:
            status, rec = self.request("GET", f"/v1/snapshots/{identity}")
            if status == 200 and rec.get("state") in ("failed", "ready"):
                return rec
            if status == 404:
                text = self.log_path.read_text(errors="replace")
                if f"snapshot {identity}: ready at " in text and f"gc: removed snapshot {identity} " in text:
                    return {"state": "ready", "collected": True}
            return {}

        return wait_for(
            seen,
            timeout,
            f"{identity} failed or ready on {self.node_id}",
            0.1,
            detail=lambda: f"{identity}: {self.request('GET', f'/v1/snapshots/{identity}')}\n{self.log()}",
        )

    def status(self) -> dict[str, Any]:
        return self.get("/v1/status")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def kill(self) -> None:
        self.stop(signal.SIGKILL)


@contextmanager
def running(d: Daemon, peers: Sequence[str] = ()) -> Iterator[Daemon]:
    """``d`` started (with static ``peers``) and healthy; stopped on the way out, also when it
    never became healthy."""
    d.start(list(peers))
    try:
        d.wait_healthy()
        yield d
    finally:
        d.stop()


class Swarm:
    """N daemons sharing one partition secret, each listing the others as static peers."""

    def __init__(
        self, workdir: Path, n: int, bucket: str, secret: str = SECRET, extra_env: dict[str, str] | None = None
    ) -> None:
        self.daemons = [Daemon(workdir, f"node{i}", bucket, secret, extra_env) for i in range(n)]

    @property
    def peer_urls(self) -> list[str]:
        return [d.peer_url for d in self.daemons]

    def start(self) -> Swarm:
        try:
            for d in self.daemons:
                d.start(self.peer_urls)
            for d in self.daemons:
                d.wait_healthy()
            self.wait_members()
        except BaseException:
            self.stop()  # never leave daemons behind when the swarm did not come up
            raise
        return self

    def wait_members(self, timeout: float = 120.0) -> None:
        """Until every running daemon sees every other running daemon as alive."""
        running = [d for d in self.daemons if d.proc is not None and d.proc.poll() is None]
        wait_for(
            lambda: all(
                {o.node_id for o in running if o is not d} <= {p["node_id"] for p in d.status()["peers"] if p["alive"]}
                for d in running
            ),
            timeout,
            "the swarm's members to converge",
            0.2,
            detail=lambda: "\n".join(d.log() for d in running),
        )

    def stop(self) -> None:
        for d in self.daemons:
            d.stop()

    def __enter__(self) -> Swarm:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def sparse_counters(d: Daemon) -> dict[str, float]:
    """The daemon's ``bdn_sparse_total{what=...}`` counters (sparse applies, catch-ups, seeds,
    bytes written, fallbacks, bad chunks) from its ``/metrics``."""
    text = d.get("/metrics").decode()
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(r'^bdn_sparse_total\{what="(\w+)"\} (\S+)$', text, re.MULTILINE)
    }
