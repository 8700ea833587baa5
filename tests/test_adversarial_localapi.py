"""Garbage on the local API of a real bdnd (bdn/daemon/http/local.py): path traversal in file
paths and tensor names, invalid UTF-8 in ids, malformed / overlapping / huge ``Range`` headers,
huge and deeply nested bodies on every POST, and a crowd of slow clients on both listeners while
a download runs.

What must hold: a status code and one line for each (never a traceback, never a byte outside the
snapshot's files), bounded memory and descriptors, ``/v1/health`` answering throughout, and the
download finishing.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bdn.publish import publish_full
from support.api import raw_request, wait_for
from support.checkpoints import make_state, write_hf_dir
from support.swarm import Daemon, Swarm, running

pytestmark = pytest.mark.timeout(300)
IDENT = "step000001"
SHARD = "model-00001-of-00002.safetensors"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, Path]]:
    tmp = tmp_path_factory.mktemp("localapi")
    (tmp / "bucket").mkdir()
    ck = write_hf_dir(tmp / "trainer", make_state(0, scale=2), 1)
    publish_full(f"file://{tmp}/bucket", IDENT, 1, dir=ck, chunk_size=64 << 10)
    with running(Daemon(tmp / "nodes", "node0", f"file://{tmp}/bucket", extra_env={"BDN_LOAD_STARTUP": "false"})) as d:
        assert d.prefetch(IDENT)[0] == 202
        d.wait_ready(IDENT)
        yield d, ck


def one_line(body: bytes) -> str:
    """The ``error`` of a JSON answer (or the text), which must be one line."""
    try:
        text = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        text = body.decode(errors="replace").strip()
    assert text and "\n" not in text and "Traceback" not in text, body[:300]
    return text


TRAVERSALS = [
    f"/v1/snapshots/{IDENT}/files/../../../../etc/passwd",
    f"/v1/snapshots/{IDENT}/files/%2e%2e/%2e%2e/%2e%2e/etc/passwd",
    f"/v1/snapshots/{IDENT}/files/..%2f..%2f..%2fetc%2fpasswd",
    f"/v1/snapshots/{IDENT}/files/%2fetc%2fpasswd",
    f"/v1/snapshots/{IDENT}/files//etc/passwd",
    f"/v1/snapshots/{IDENT}/files/READY",
    f"/v1/snapshots/{IDENT}/files/./READY",
    f"/v1/snapshots/{IDENT}/files/{SHARD}%00.json",
    f"/v1/snapshots/{IDENT}/files/{SHARD}/..",
    f"/v1/snapshots/{IDENT}/files/..",
    f"/v1/snapshots/{IDENT}/files/%ff%fe",
    f"/v1/snapshots/{IDENT}/tensors/..%2f..%2fetc%2fpasswd",
    f"/v1/snapshots/{IDENT}/tensors/%2e%2e",
    f"/v1/snapshots/{IDENT}/tensors/%ff",
    f"/v1/snapshots/{IDENT}/tensors/embed.weight%00",
    "/v1/snapshots/..%2f..%2fetc/files/passwd",
    "/v1/snapshots/%ff%fe/files/config.json",
    "/v1/snapshots/%c0%af/prefetch",
    "/v1/snapshots/step%00001",
    "/v1/engines/%ff/next?timeout=0",
    "/v1/engines/..%2f..%2f/next?timeout=0",
    "/v1/snapshots/" + "a" * 5000,
    f"/v1/snapshots/{IDENT}/wait?state=%ff&timeout=0",
    f"/v1/snapshots/{IDENT}/wait?state=ready&timeout=1e400",
    f"/v1/snapshots/{IDENT}/wait?state=ready&timeout=nan",
]


@pytest.mark.parametrize("path", TRAVERSALS)
def test_traversal_and_invalid_utf8_in_paths_are_a_status_and_one_line(served: tuple[Daemon, Path], path: str) -> None:
    d, ck = served
    method = "POST" if path.endswith("/prefetch") else "GET"
    status, body = raw_request(d.url, method, path)
    assert 400 <= status < 500, (path, status, body[:200])
    one_line(body)
    assert b"root:" not in body and b'"identity"' not in body, body[:200]  # no /etc/passwd, no READY


RANGES = [
    ("bytes=0-10,5-15", 416),
    ("bytes=0-0," * 500 + "0-0", 416),
    ("bytes=5-5, 5-5", 416),
    ("bytes=0-0," * 2000 + "0-0", 431),  # 12 KB: over the header line limit (8190)
    ("bytes=" + "9" * 20 + "-", 416),
    ("bytes=0-" + "9" * 20, 416),
    ("bytes=--5", 416),
    ("bytes=-", 416),
    ("bytes = 0-5", 416),
    ("items=0-5", 416),
    ("bytes=0x10-0x20", 416),
    ("bytes=\u00b9-5", 416),
    ("bytes=-9223372036854775807", 206),
    ("bytes=0-9223372036854775806", 206),
    ("bytes=0-", 206),
]


@pytest.mark.parametrize("value, want", RANGES)
def test_malformed_overlapping_and_huge_ranges(served: tuple[Daemon, Path], value: str, want: int) -> None:
    d, ck = served
    data = (ck / SHARD).read_bytes()
    try:
        value.encode("latin-1")
    except UnicodeEncodeError:
        pytest.skip("not sendable as a header")
    status, body = raw_request(d.url, "GET", f"/v1/snapshots/{IDENT}/files/{SHARD}", {"Range": value})
    assert status == want, (value[:60], status, body[:200])
    if want == 206:
        assert body == data, value  # every one of these covers the whole file
    else:
        one_line(body)


POSTS = ["/v1/engines", f"/v1/snapshots/{IDENT}/leases", "/hot_load/v1/models/hot_load"]


def _post_raw(d: Daemon, path: str, head: bytes, body: bytes) -> tuple[int, bytes]:
    """A POST written by hand (headers ``head``), the body sent as far as the daemon takes it."""
    with socket.create_connection(("127.0.0.1", d.local_port), timeout=60) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode() + head + b"\r\n")
        try:
            s.sendall(body)
        except OSError:
            pass  # the daemon answered and closed before taking all of it
        got = b""
        while b"\r\n\r\n" not in got or len(got.split(b"\r\n\r\n", 1)[1]) < _length(got):
            try:
                data = s.recv(65536)
            except OSError:
                break
            if not data:
                break
            got += data
    status = int(got.split(b" ", 2)[1])
    return status, got.split(b"\r\n\r\n", 1)[1]


def _length(got: bytes) -> int:
    for line in got.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            return int(v)
    return 0


@pytest.mark.parametrize("path", POSTS)
def test_huge_and_deep_bodies_on_every_post(served: tuple[Daemon, Path], path: str) -> None:
    d, _ = served
    # declared huge, nothing sent: refused at once
    status, body = _post_raw(d, path, b"Content-Length: 1000000000000000\r\n", b"")
    assert status == 413, (status, body)
    one_line(body)
    # chunked, 4 MiB of it: refused once over the limit, never all read
    piece = b"x" * 65536
    chunked = (f"{len(piece):x}\r\n".encode() + piece + b"\r\n") * 64 + b"0\r\n\r\n"
    status, body = _post_raw(d, path, b"Transfer-Encoding: chunked\r\n", chunked)
    assert status == 413, (status, body)
    one_line(body)
    for bad in (b"[" * 60000, b'{"a":' * 12000, b'{"name": "\xff\xfe"}', b'{"holder": "\xc0\xaf"}', b"\x00" * 100):
        status, body = _post_raw(d, path, f"Content-Length: {len(bad)}\r\n".encode(), bad)
        assert status == 400, (bad[:20], status, body)
        one_line(body)
    assert d.get("/v1/health")["status"] == "ok"
    assert "Traceback" not in d.log(), d.log()


def _fds(d: Daemon) -> int:
    assert d.proc is not None
    return len(os.listdir(f"/proc/{d.proc.pid}/fd"))


def _rss(d: Daemon) -> int:
    assert d.proc is not None
    for line in open(f"/proc/{d.proc.pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


def test_a_crowd_of_slow_clients_while_a_download_runs(tmp_path: Path) -> None:
    """1,000 connections on node1's local API and 1,000 on its peer port, each sending a byte of
    headers every 0.5 s (slowloris) or nothing at all, while node1 downloads a snapshot from
    node0 and the bucket (both slowed to 4 Mbit/s so the crowd arrives mid-download): health answers
    throughout, the download finishes with the trainer's bytes, and once the crowd is cut
    (the 2 s header deadline) node1's descriptors are back near where they were."""
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    ck = write_hf_dir(tmp_path / "trainer", make_state(0, scale=8), 1)  # ~10 MB: ~20 s at 4 Mbit/s
    publish_full(f"file://{bucket}", IDENT, 1, dir=ck, chunk_size=64 << 10)
    env = {
        "BDN_LOAD_STARTUP": "false",
        "BDN_HTTP_HEADER_TIMEOUT_S": "2",
        "BDN_BUCKET_MBIT": "4",
        "BDN_PEER_DOWNLOAD_MBIT": "4",
    }
    with Swarm(tmp_path / "nodes", 2, f"file://{bucket}", extra_env=env) as s:
        node0, node1 = s.daemons
        assert node0.prefetch(IDENT)[0] == 202
        node0.wait_ready(IDENT)
        fds0, rss0 = _fds(node1), _rss(node1)
        crowd: list[socket.socket] = []
        t0 = time.monotonic()
        assert node1.prefetch(IDENT)[0] == 202
        t_prefetch = time.monotonic() - t0
        try:
            for i in range(2000):
                port = node1.local_port if i % 2 else node1.peer_port
                c = socket.socket()
                c.setblocking(False)
                try:
                    c.connect(("127.0.0.1", port))
                except BlockingIOError:
                    pass
                crowd.append(c)
            healthy, slowest = 0, 0.0
            deadline = time.monotonic() + 120
            t0 = time.monotonic()
            assert node1.get("/v1/health", timeout=120)["status"] == "ok"  # behind the whole crowd
            first = time.monotonic() - t0
            while (rec := node1.get(f"/v1/snapshots/{IDENT}"))["state"] not in ("ready", "failed"):
                assert time.monotonic() < deadline, rec
                for c in crowd[::3]:  # a third of them trickle header bytes, the rest stay silent
                    try:
                        c.send(b"G")
                    except OSError:
                        pass
                t0 = time.monotonic()
                assert node1.get("/v1/health", timeout=60)["status"] == "ok"
                slowest = max(slowest, time.monotonic() - t0)
                healthy += 1
                time.sleep(0.5)
            assert rec["state"] == "ready", rec
            got = Path(rec["path"])
            for f in ck.iterdir():
                assert (got / f.name).read_bytes() == f.read_bytes(), f.name
            peak = _rss(node1)
            # the crowd is cut at the header deadline: descriptors come back
            wait_for(lambda: _fds(node1) < fds0 + 100, 120, "node1's descriptors to come back", interval=0.2)
        finally:
            for c in crowd:
                c.close()
        print(
            f"prefetch {t_prefetch:.2f} s, first health check behind the crowd {first:.2f} s, fds before {fds0}, rss before {rss0 >> 20} MiB, peak {peak >> 20} MiB,"
            f" {healthy} health checks during the download, slowest {slowest:.2f} s"
        )
        assert peak < rss0 + (200 << 20), (rss0, peak)
        assert node1.get("/v1/health")["status"] == "ok"
        assert "Traceback" not in node1.log(), node1.log()
