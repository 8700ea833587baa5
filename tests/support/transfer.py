"""Helpers for the transfer tests: chunk files in /dev/shm, target mappings, a raw wire probe,
and a transfer server in its own process (``python tests/support/transfer.py serve ...``)."""

from __future__ import annotations

import argparse
import mmap
import os
import socket
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from bdn.proto import handshake, wire
from bdn.proto.chunks import digest
from bdn.proto.keys import SwarmKeys, derive_keys
from bdn.transfer import Outcome, Peer, TransferClient

SECRET = "transfer-test-secret-0123456789abcdef"
KEYS = derive_keys(SECRET)
SHM = Path("/dev/shm")


def shm_tmpdir() -> Path:
    """A fresh directory on tmpfs (the caller removes it with ``shutil.rmtree``)."""
    base = SHM if SHM.is_dir() else Path(tempfile.gettempdir())
    return Path(tempfile.mkdtemp(prefix="bdn-transfer-test-", dir=base))


@dataclass
class ChunkFile:
    """A file of random chunks and its table: swarm address -> (path, offset, length)."""

    path: Path
    chunk_size: int
    digests: list[str]
    table: dict[str, tuple[str, int, int]]
    size: int

    def address(self, i: int) -> str:
        return KEYS.address(self.digests[i])

    def resolve(self, address: str) -> tuple[str, int, int] | None:
        return self.table.get(address)


def make_chunk_file(path: Path, size: int, chunk_size: int, keys: SwarmKeys = KEYS) -> ChunkFile:
    """Write ``size`` random bytes to ``path`` and index its chunks by swarm address."""
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, 16 << 20)
            f.write(os.urandom(n))
            left -= n
    digests, table = [], {}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        for off in range(0, size, chunk_size):
            n = min(chunk_size, size - off)
            d = digest(memoryview(m)[off : off + n])
            digests.append(d)
            table[keys.address(d)] = (str(path), off, n)
    return ChunkFile(path, chunk_size, digests, table, size)


class Target:
    """A writable shared mapping of a new file of ``size`` bytes (the receiver's target file)."""

    def __init__(self, path: Path, size: int) -> None:
        self.path = path
        self._f = open(path, "w+b")  # noqa: SIM115 - kept open with the mapping, closed by close()
        self._f.truncate(size)
        self.map = mmap.mmap(self._f.fileno(), size)

    def close(self) -> None:
        self.map.close()
        self._f.close()


def ask_daemon(
    keys: SwarmKeys,
    node_id: str,
    port: int,
    address: str,
    length: int,
    *,
    wait_s: float = 0.0,
    snapshot: str | None = None,
    me: str = "tester",
) -> tuple[Outcome, bytes]:
    """Ask daemon ``node_id``'s transfer server on ``127.0.0.1:port`` for the chunk at swarm
    ``address`` (``length`` bytes), as member ``me`` would: ``(outcome, the bytes as sent)``.
    The bytes are not checked (``digest`` None): the caller compares them with what it expects."""
    client = TransferClient(keys, me, io_timeout_s=30.0)
    try:
        buf = bytearray(length)
        res = client.fetch_into(
            Peer(node_id, "127.0.0.1", port), address, buf, 0, length, None, wait_s=wait_s, snapshot=snapshot
        )
        return res.outcome, bytes(buf)
    finally:
        client.close()


# ---- a raw client speaking the wire by hand -------------------------------------------------


def accept_ask(sock: socket.socket, node_id: str, keys: SwarmKeys = KEYS) -> tuple[handshake.Session, wire.Ask]:
    """The server side of a transfer handshake on ``sock`` as daemon ``node_id`` (a test peer
    that knows the secret), then the client's first ASK: ``(session, ask)``."""
    import secrets
    import time

    nonce = secrets.token_bytes(handshake.NONCE_BYTES)
    sock.sendall(handshake.server_hello(nonce))
    _, body = recv_frame(sock)
    accept, session = handshake.check_client_hello(keys, node_id, nonce, body, time.time())
    sock.sendall(accept)
    ftype, body = recv_frame(sock)
    return session, wire.decode_ask(session.open(ftype, body))


def recv_frame(sock: socket.socket) -> tuple[wire.FrameType, bytes]:
    hdr = _recv_n(sock, 5)
    ftype, n = wire.parse_header(hdr)
    return ftype, _recv_n(sock, n)


def _recv_n(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        got = sock.recv(n - len(out))
        if not got:
            raise ConnectionError(f"closed after {len(out)} of {n} bytes")
        out += got
    return bytes(out)


def read_to_end(sock: socket.socket, timeout_s: float = 30.0) -> tuple[bytes, str]:
    """Everything the server still sends, and how the connection ended: ``eof``, ``reset`` or
    ``open`` (nothing for ``timeout_s``: the server neither answered nor closed)."""
    sock.settimeout(timeout_s)
    got = bytearray()
    try:
        while True:
            b = sock.recv(1 << 16)
            if not b:
                return bytes(got), "eof"
            got += b
    except ConnectionResetError:
        return bytes(got), "reset"
    except TimeoutError:
        return bytes(got), "open"


def connect(addr: tuple[str, int]) -> tuple[socket.socket, bytes]:
    """A raw connection and the server nonce of its SERVER_HELLO."""
    sock = socket.create_connection(addr, timeout=30)
    ftype, body = recv_frame(sock)
    assert ftype == wire.FrameType.SERVER_HELLO
    return sock, handshake.parse_server_hello(body)


# ---- a transfer server in its own process ---------------------------------------------------


class ServerProcess:
    """``TransferServer`` over one chunk file, in a child process (so it can be stopped and
    killed -9 mid-transfer)."""

    def __init__(self, path: Path, chunk_size: int, node_id: str = "srvproc") -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "serve", str(path), str(chunk_size), node_id],
            stdout=subprocess.PIPE,
            text=True,
            env=os.environ.copy(),
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().split()
        if len(line) != 3 or line[0] != "listening":
            self.proc.kill()
            raise RuntimeError(f"transfer server process did not start: {line}")
        self.addr = (line[1], int(line[2]))
        self.node_id = node_id

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


def _serve(path: str, chunk_size: int, node_id: str) -> None:
    from bdn.transfer import TransferServer

    size = os.path.getsize(path)
    table = {}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        for off in range(0, size, chunk_size):
            n = min(chunk_size, size - off)
            table[KEYS.address(digest(memoryview(m)[off : off + n]))] = (path, off, n)
    srv = TransferServer(KEYS, node_id, table.get, sndbuf=256 << 10)
    host, port = srv.start()
    print("listening", host, port, flush=True)
    threading.Event().wait()  # serve until the test kills this process


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=["serve"])
    ap.add_argument("path")
    ap.add_argument("chunk_size", type=int)
    ap.add_argument("node_id")
    a = ap.parse_args()
    _serve(a.path, a.chunk_size, a.node_id)
