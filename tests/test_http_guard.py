"""The HTTP guards of a real bdnd (bdn/daemon/http/guard.py), with raw sockets: a request whose
headers never finish is closed on the peer port and the local API (slowloris), a listener holds
at most ``http_max_connections``, and an oversized header is a 431 with no traceback in the log."""

from __future__ import annotations

import socket
import time

import pytest

from support.api import wait_for
from support.swarm import Daemon


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """Two daemons started together (one start-up wait): ``quick`` cuts unfinished requests
    after 1 s; ``small`` holds at most 3 connections per listener."""
    root = tmp_path_factory.mktemp("guard")
    bucket = root / "bucket"
    bucket.mkdir()
    quick = Daemon(root, "quick", f"file://{bucket}", extra_env={"BDN_HTTP_HEADER_TIMEOUT_S": "1"})
    small = Daemon(
        root,
        "small",
        f"file://{bucket}",
        extra_env={"BDN_HTTP_MAX_CONNECTIONS": "3", "BDN_HTTP_HEADER_TIMEOUT_S": "600"},
    )
    try:
        for d in (quick, small):
            d.start([])
        for d in (quick, small):
            d.wait_healthy(240)  # generous: a loaded machine imports for tens of seconds
        yield quick, small
    finally:
        for d in (quick, small):
            d.kill()


def _closed_by_server(sock: socket.socket, deadline: float) -> bytes:
    """Trickle header lines into ``sock`` until the daemon closes it; what it sent back."""
    got = b""
    sock.settimeout(0.2)
    while time.monotonic() < deadline:
        try:
            sock.sendall(b"X-Slow: 1\r\n")
        except OSError:
            return got  # reset: closed
        try:
            data = sock.recv(4096)
        except TimeoutError:
            continue
        except OSError:
            return got
        if not data:
            return got
        got += data
    raise AssertionError("the daemon kept a connection whose request headers never finished")


def _guard_metric(d: Daemon, reason: str) -> float:
    text = d.get("/metrics").decode()
    for line in text.splitlines():
        if line.startswith(f'bdn_http_guard_total{{reason="{reason}"}}'):
            return float(line.split()[-1])
    raise AssertionError(f"no bdn_http_guard_total{{reason={reason!r}}} in /metrics")


def test_unfinished_requests_are_closed_and_oversized_headers_get_431(daemons) -> None:  # type: ignore[no-untyped-def]
    d, _ = daemons
    deadline = time.monotonic() + 120
    for port in (d.local_port, d.peer_port):
        with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
            s.sendall(b"GET /v1/health HTTP/1.1\r\nHost: x\r\n")
            assert _closed_by_server(s, deadline) == b""  # closed, no answer to half a request
    assert _guard_metric(d, "header_timeout") >= 2
    # A keep-alive connection: the first request is answered, the unfinished second is cut.
    with socket.create_connection(("127.0.0.1", d.local_port), timeout=60) as s:
        s.sendall(b"GET /v1/health HTTP/1.1\r\nHost: x\r\n\r\n")
        first = s.recv(65536)
        assert first.startswith(b"HTTP/1.1 200"), first
        s.sendall(b"GET /v1/health HTTP/1.1\r\n")
        _closed_by_server(s, deadline)
    # An oversized header: 431 and one short line, never a traceback.
    with socket.create_connection(("127.0.0.1", d.local_port), timeout=60) as s:
        s.sendall(b"GET /v1/health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n")
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.endswith(b"\n"):
            data = s.recv(65536)
            if not data:
                break
            answer += data
    assert answer.split(b" ", 2)[1] == b"431", answer[:200]
    assert answer.endswith(b"\r\n\r\nrequest header too large\n"), answer
    assert d.get("/v1/health")  # still serving
    log = d.log()
    assert "Traceback" not in log and "Error handling request" not in log, log


def test_a_listener_holds_at_most_http_max_connections(daemons) -> None:  # type: ignore[no-untyped-def]
    _, d = daemons
    held: list[socket.socket] = []
    try:
        # Three idle connections fill the local API; the daemon accepts in order, so the fourth
        # is seen after them and refused.
        held = [socket.create_connection(("127.0.0.1", d.local_port), timeout=60) for _ in range(3)]
        with socket.create_connection(("127.0.0.1", d.local_port), timeout=60) as s:
            answer = s.recv(4096)
        assert answer.startswith(b"HTTP/1.1 503 ") and answer.endswith(b"too many connections\n"), answer
        # One closes: the listener takes connections again.
        held.pop().close()

        def health() -> bytes:
            with socket.create_connection(("127.0.0.1", d.local_port), timeout=60) as s:
                s.sendall(b"GET /v1/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                return s.recv(4096)

        wait_for(
            health,
            120,
            "the listener to take connections again",
            0.05,
            until=lambda answer: answer.startswith(b"HTTP/1.1 200"),
        )
    finally:
        for s in held:
            s.close()
