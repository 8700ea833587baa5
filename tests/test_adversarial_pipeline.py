"""A pipelined partial request (a complete request and the start of the next in one segment, then
silence) on bdnd's guarded HTTP listeners (bdn/daemon/http/guard.py). aiohttp parses the second
request's bytes along with the first one's and never tells the protocol, so they were under no
deadline but the keep-alive timer (the adversarial session measured 15 s on the peer port, 75 s on
the local API, with a 10 s header deadline). The guard now caps the keep-alive at the header
deadline: a listener configured with an hour of keep-alive still closes such a connection once
``header_timeout_s`` passed. Real aiohttp listeners on real loopback sockets, with the guard of
bdnd, in this process (the behaviour is the runner's); a real bdnd's peer port is probed too.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from aiohttp import web

from bdn.daemon.http.guard import GuardedRunner
from bdn.daemon.observe.stats import Stats
from tests.support.swarm import Daemon, running

pytestmark = pytest.mark.timeout(300)
PIPELINED = b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\nGET /pi"  # the second request never ends


def _until_closed(port: int, payload: bytes, deadline_s: float = 120.0) -> bytes:
    """Send ``payload``, read until the server closes (at most ``deadline_s``); everything read."""
    with socket.create_connection(("127.0.0.1", port), timeout=deadline_s) as s:
        s.sendall(payload)
        got = b""
        while True:
            try:
                data = s.recv(65536)
            except TimeoutError:
                raise AssertionError(f"connection still open after {deadline_s:g} s: {got[:200]!r}") from None
            if not data:
                return got
            got += data


@pytest.fixture()
def listener() -> Iterator[int]:
    """A guarded aiohttp listener (header deadline 1 s, keep-alive asked: one hour, capped at 2 s) on its own loop."""

    async def ping(_: web.Request) -> web.Response:
        return web.Response(text="pong")

    app = web.Application()
    app.router.add_get("/ping", ping)
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    port: list[int] = []
    stop = asyncio.Event()

    async def serve() -> None:
        runner = GuardedRunner(
            app,
            name="test API",
            header_timeout_s=1.0,
            max_connections=64,
            stats=Stats(),
            access_log=None,
            keepalive_timeout=3600,
        )
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port.append(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
        ready.set()
        await stop.wait()
        await runner.cleanup()

    t = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    t.start()
    assert ready.wait(120)
    try:
        yield port[0]
    finally:
        loop.call_soon_threadsafe(stop.set)
        t.join(120)


def test_a_pipelined_partial_request_is_closed_at_the_header_deadline(listener: int) -> None:
    got = _until_closed(listener, PIPELINED)  # before: open for the hour of keep-alive
    assert got.startswith(b"HTTP/1.1 200") and got.count(b"HTTP/1.1") == 1 and got.endswith(b"pong"), got
    # an idle keep-alive connection is closed at the same bound, after its answer
    got = _until_closed(listener, b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
    assert got.startswith(b"HTTP/1.1 200") and got.endswith(b"pong"), got


def test_a_daemon_peer_port_closes_a_pipelined_partial_request(tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    # 3 s, not 1: at load 17 a 1 s deadline cut wait_healthy's own requests (BadStatusLine)
    d = Daemon(
        tmp_path,
        "pipelined",
        f"file://{bucket}",
        extra_env={"BDN_HTTP_HEADER_TIMEOUT_S": "3", "BDN_LOAD_STARTUP": "false"},
    )
    with running(d), ThreadPoolExecutor(2) as pool:
        peer = pool.submit(
            _until_closed, d.peer_port, b"GET /bdn/v1/0000/status HTTP/1.1\r\nHost: x\r\n\r\nGET /bdn/v1/00"
        )
        local = pool.submit(_until_closed, d.local_port, b"GET /v1/health HTTP/1.1\r\nHost: x\r\n\r\nGET /v1/hea")
        got = peer.result()
        assert got.startswith(b"HTTP/1.1 401") and got.count(b"HTTP/1.1") == 1, got  # unsigned: 401, no detail
        got = local.result()
        assert got.startswith(b"HTTP/1.1 200") and got.count(b"HTTP/1.1") == 1, got
        assert "Traceback" not in d.log()
