"""Attacks on bdnd's HTTP listeners (bdn/daemon/http/guard.py, http/common.py) over real
sockets: request bodies that trickle in. The guard's deadline covers headers; before the fix a
body sent one byte at a time held its connection as long as the sender liked, so
``http_max_connections`` of them shut a listener for everyone.
"""

from __future__ import annotations

import socket
import threading
import urllib.error
from collections.abc import Iterator

import pytest

from bdn.proto.keys import derive_keys, sign_request
from tests.support.api import wait_for
from tests.support.swarm import SECRET, Daemon, running

pytestmark = pytest.mark.timeout(300)
MAX_CONNS = 4


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    tmp_path = tmp_path_factory.mktemp("http")
    (tmp_path / "bucket").mkdir()
    with running(
        Daemon(
            tmp_path / "work",
            "node0",
            f"file://{tmp_path}/bucket",
            extra_env={
                "BDN_LOAD_STARTUP": "false",
                "BDN_HTTP_MAX_CONNECTIONS": str(MAX_CONNS),
                "BDN_HTTP_HEADER_TIMEOUT_S": "2",
            },
        )
    ) as d:
        yield d


class Trickle:
    """A request whose headers are complete and whose body comes one byte every 0.2 s."""

    def __init__(self, port: int, head: bytes) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=120)
        self.sock.sendall(head)
        self.answer = b""
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        reader = threading.Thread(target=self._read, daemon=True)
        reader.start()
        try:
            while not self.closed.is_set():
                self.sock.sendall(b"x")
                self.closed.wait(0.2)
        except OSError:
            pass  # the daemon closed it
        reader.join(120)

    def _read(self) -> None:
        try:
            while chunk := self.sock.recv(65536):
                self.answer += chunk
        except OSError:
            pass
        self.closed.set()

    def stop(self) -> None:
        self.closed.set()
        self.sock.close()
        self.thread.join(10)


def _healthy(d: Daemon) -> bool:
    try:
        return d.get("/v1/health", timeout=10)["status"] == "ok"
    except (OSError, urllib.error.URLError):
        return False


def test_bodies_that_trickle_in_are_answered_408_and_free_their_connections(daemon: Daemon) -> None:
    keys = derive_keys(SECRET)
    path = f"/bdn/v1/{keys.swarm_id}/bad_chunk"
    peer_head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\nAuthorization: "
        f"{sign_request(keys, 'POST', path, 'tester', to=daemon.node_id)}\r\n\r\n"
    ).encode()
    local_head = (
        b"POST /v1/engines HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    )
    attacks = [Trickle(daemon.peer_port, peer_head)]
    attacks += [Trickle(daemon.local_port, local_head) for _ in range(MAX_CONNS)]  # the local API's every slot
    try:
        for a in attacks:  # each is answered within the body deadline, and closed
            wait_for(a.closed.is_set, 120, "the daemon to close a trickling request", 0.1)
        wait_for(lambda: _healthy(daemon), 120, "the local API to answer again", 0.1)
    finally:
        for a in attacks:
            a.stop()
    assert attacks[0].answer.startswith(b"HTTP/1.1 408 "), attacks[0].answer
    assert attacks[0].answer.endswith(b"\r\n\r\nbad_chunk request body not complete after 2 s\n"), attacks[0].answer
    for a in attacks[1:]:
        assert a.answer.startswith(b"HTTP/1.1 408 "), a.answer
        assert a.answer.endswith(b'{"error": "request body not complete after 2 s"}'), a.answer
    assert "Traceback" not in daemon.log(), daemon.log()


def test_a_body_cut_short_is_answered_in_one_line_never_a_traceback(daemon: Daemon) -> None:
    """Headers, half the body, then the sender closes: before the fix aiohttp logged the
    handler's ConnectionResetError with a traceback at ERROR."""
    keys = derive_keys(SECRET)
    path = f"/bdn/v1/{keys.swarm_id}/members"
    heads = [
        (daemon.local_port, b'POST /v1/engines HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"na'),
        (daemon.local_port, b"POST /hot_load/v1/models/hot_load HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"),
        (
            daemon.peer_port,
            (
                f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\nAuthorization: "
                f"{sign_request(keys, 'POST', path, 'tester', to=daemon.node_id)}\r\n\r\n"
            ).encode()
            + b"\x81",
        ),
    ]
    for port, head in heads:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(head)
            s.shutdown(socket.SHUT_WR)  # the body ends here: 100 bytes were promised
            while s.recv(65536):
                pass
    wait_for(
        lambda: daemon.log().count("request body cut short by the sender") == len(heads) or "Traceback" in daemon.log(),
        120,
        "each cut to be handled",
        0.1,
    )
    assert _healthy(daemon)
    assert "Traceback" not in daemon.log(), daemon.log()
