"""The local HTTP pull on sendfile (issue 9): file ranges and tensors from a real bdnd over TCP
and its unix socket, bit-exact, Range edge cases, and answers the client must not trust."""

from __future__ import annotations

import http.client
import socket
import threading
from pathlib import Path

import numpy as np
import pytest

from bdn.bucket import open_bucket
from bdn.client import DaemonClient
from bdn.client.bulk import get_into
from bdn.client.errors import DaemonError, DaemonUnreachable
from bdn.proto.errors import ProtocolError
from bdn.publish import publish_full
from support.checkpoints import make_state, write_hf_dir
from support.swarm import Daemon, running

IDENT = "step000001"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pull")
    bucket = f"file://{tmp}/bucket"
    state = make_state(0, scale=4)
    ck = write_hf_dir(tmp / "trainer", state, 1)
    b = open_bucket(bucket)
    try:
        publish_full(b, IDENT, 1, dir=ck, chunk_size=64 << 10)
    finally:
        b.close()
    sock = tmp / "local.sock"
    env = {"BDN_LOAD_STARTUP": "false", "BDN_LOCAL_SOCKET": str(sock)}
    with running(Daemon(tmp / "nodes", "node0", bucket, extra_env=env)) as d:
        assert d.prefetch(IDENT)[0] == 202
        d.wait_ready(IDENT, 120)
        yield d, ck, state, sock


def shard(ck: Path) -> tuple[str, bytes]:
    p = min(ck.glob("*.safetensors"))
    return p.name, p.read_bytes()


def test_ranges_and_tensors_over_tcp_and_the_unix_socket(served) -> None:
    d, ck, state, sock = served
    name, data = shard(ck)
    for url in (d.url, f"unix://{sock}"):
        with DaemonClient(url) as c:
            assert c.read_file(IDENT, name) == data
            assert c.read_file(IDENT, name, 1, 70000) == data[1:70001]
            assert c.read_file(IDENT, name, len(data) - 3) == data[-3:]
            for tname, want in state.items():
                got = c.read_tensor(IDENT, tname)
                assert got.dtype == want.dtype and got.shape == want.shape
                assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), tname


def raw(d: Daemon, path: str, headers: dict[str, str] | None = None, method: str = "GET"):
    conn = http.client.HTTPConnection("127.0.0.1", d.local_port, timeout=30)
    try:
        conn.request(method, path, headers=headers or {})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


def test_range_edge_cases(served) -> None:
    d, ck, _, _ = served
    name, data = shard(ck)
    path = f"/v1/snapshots/{IDENT}/files/{name}"
    st, h, body = raw(d, path, {"Range": "bytes=-10"})
    assert (
        st == 206 and body == data[-10:] and h["Content-Range"] == f"bytes {len(data) - 10}-{len(data) - 1}/{len(data)}"
    )
    st, h, body = raw(d, path, {"Range": f"bytes=5-{len(data) * 2}"})  # clipped to the file
    assert st == 206 and body == data[5:]
    st, h, _ = raw(d, path, {"Range": f"bytes={len(data)}-"})
    assert st == 416 and h["Content-Range"] == f"bytes */{len(data)}"
    st, _, _ = raw(d, path, {"Range": "bytes=9-3"})
    assert st == 416
    # a zero-byte suffix asks for nothing (RFC 9110 §14.1.1); aiohttp's parser served the whole file
    st, h, body = raw(d, path, {"Range": "bytes=-0"})
    assert st == 416 and h["Content-Range"] == f"bytes */{len(data)}", (st, body[:100])
    # a 5000-digit position: one line naming the header, not Python's int-conversion limit
    st, _, body = raw(d, path, {"Range": "bytes=" + "9" * 5000 + "-"})
    assert st == 416 and b"is not one range" in body and b"int" not in body, body[:200]
    st, _, body = raw(d, path, {"Range": "bytes=0-1,5-6"})  # several ranges: not served as one
    assert st == 416 and b"is not one range" in body
    st, h, body = raw(d, path, method="HEAD")
    assert st == 200 and int(h["Content-Length"]) == len(data) and body == b""
    st, _, body = raw(d, path)  # keep-alive after a sendfile body: a second request on a fresh conn is fine too
    assert st == 200 and body == data


class FakeDaemon:
    """A loopback server that answers one request with ``answer`` then closes: what a broken
    or hostile process on the local port could send."""

    def __init__(self, answer: bytes) -> None:
        self.ls = socket.create_server(("127.0.0.1", 0))
        self.port = self.ls.getsockname()[1]
        self.answer = answer
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        c, _ = self.ls.accept()
        with c:
            c.recv(65536)
            c.sendall(self.answer)


@pytest.mark.parametrize(
    "answer, err",
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 10, ProtocolError),  # short body
        (b"HTTP/1.1 200 OK\r\n\r\nxxxx", ProtocolError),  # no Content-Length
        (b"HTTP/1.1 200 OK\r\nContent-Length: -5\r\n\r\n", ProtocolError),
        (b"garbage\r\n\r\n", ProtocolError),
        (b"HTTP/1.1 200 OK\r\n" + b"X: " + b"y" * (70 << 10), ProtocolError),  # endless head
        (b"", DaemonUnreachable),
    ],
)
def test_bulk_get_refuses_broken_answers(answer: bytes, err: type) -> None:
    f = FakeDaemon(answer)
    with pytest.raises(err):
        get_into("127.0.0.1", f.port, None, "/x", {}, lambda n, h: bytearray(n), timeout=10, url="http://fake")


def test_pull_into_the_callers_buffer_in_parallel_ranges(served) -> None:
    """read_file_into / read_tensor_into fill a buffer the caller reuses, bit-exact, over TCP and
    the unix socket, with 1 and several connections; a buffer of the wrong size is refused."""
    d, ck, state, sock = served
    name, data = shard(ck)
    buf = bytearray(len(data))
    part = np.zeros(70000, dtype=np.uint8)
    for url in (d.url, f"unix://{sock}"):
        with DaemonClient(url) as c:
            for conns in (1, 3, 16):
                buf[:] = bytes(len(buf))
                assert c.read_file_into(IDENT, name, buf, connections=conns) == len(data)
                assert buf == data, conns
            assert c.read_file_into(IDENT, name, part, 1, connections=2) == 70000
            assert part.tobytes() == data[1:70001]
            for tname, want in state.items():
                out = np.empty(want.nbytes, dtype=np.uint8)
                got = c.read_tensor_into(IDENT, tname, out)
                assert got.dtype == want.dtype and got.shape == want.shape
                assert np.shares_memory(got, out)
                assert np.array_equal(got.view(np.uint8).reshape(-1), want.view(np.uint8).reshape(-1)), tname
                # an array of the tensor's own dtype and shape (bf16: ml_dtypes.bfloat16, which has
                # no buffer-protocol format) is filled as it is
                same = np.empty_like(want)
                assert np.shares_memory(c.read_tensor_into(IDENT, tname, same), same)
                assert same.tobytes() == want.tobytes(), tname
            assert any(w.dtype.name == "bfloat16" for w in state.values())
            tname, want = next(iter(state.items()))
            with pytest.raises(ValueError, match="buffer holds"):
                c.read_tensor_into(IDENT, tname, bytearray(want.nbytes + 1))
            with pytest.raises(ValueError, match="read-only"):
                c.read_file_into(IDENT, name, bytes(10))
            with pytest.raises(DaemonError) as e:  # a range past the end of the file: 416
                c.read_file_into(IDENT, name, bytearray(10), len(data))
            assert e.value.status == 416
            # the client is still usable after every refusal
            assert c.read_file_into(IDENT, name, part) == 70000 and part.tobytes() == data[:70000]
