"""Attacks on a real bdnd that once crashed a handler or left a wrong state: a bearer token
that is not ASCII, JSON's non-numbers in an engine body, an engine that leaves mid hot-load.

One daemon over a ``file://`` bucket under ``tmp_path`` (``tests/support/swarm.py``); requests
go over real loopback sockets, some byte for byte (``raw``) so no client normalises them.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from bdn.publish import publish_full
from tests.support.checkpoints import make_state, write_hf_dir
from tests.support.swarm import Daemon

CHUNK = 64 << 10
TOKEN = "attack-test-token"

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("attacks")
    bucket = root / "bucket"
    bucket.mkdir()
    ck = write_hf_dir(root / "src" / "step000001", make_state(0), 1)
    publish_full(f"file://{bucket}", "step000001", 1, dir=ck, chunk_size=CHUNK)
    d = Daemon(root / "work", "node0", f"file://{bucket}",
               extra_env={"BDN_LOAD_STARTUP": "false", "BDN_API_TOKEN": TOKEN})
    d.start([])
    try:
        d.wait_healthy()
        yield d
    finally:
        d.stop()


def raw(port: int, data: bytes) -> tuple[int, bytes]:
    """Send ``data`` as is on a fresh connection (it must ask ``Connection: close``); status, body."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    head, _, body = out.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def test_a_bearer_token_that_is_not_ascii_gets_401_not_500(daemon: Daemon) -> None:
    for token in (b"\xff\xfe", "jeton-\u00e9".encode(), b"\x80" + TOKEN.encode()):
        status, body = raw(daemon.peer_port, b"GET /hot_load/v1/models/hot_load HTTP/1.1\r\nHost: x\r\n"
                           b"Authorization: Bearer " + token + b"\r\nConnection: close\r\n\r\n")
        assert status == 401, (token, status, body)
    assert "Traceback" not in daemon.log()
    status, _ = raw(daemon.peer_port, b"GET /hot_load/v1/models/hot_load HTTP/1.1\r\nHost: x\r\n"
                    b"Authorization: Bearer " + TOKEN.encode() + b"\r\nConnection: close\r\n\r\n")
    assert status == 200
