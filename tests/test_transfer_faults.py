"""Faults on the transfer layer, on real sockets and processes: a body cut short (a liar, and a
server killed -9 mid-body) is a failure and never a short success; corrupted bytes are caught;
garbage, huge frames and silent connections close only that connection and the server keeps
serving; memory stays bounded."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import threading
import time

import pytest

from bdn.proto import handshake, wire
from bdn.transfer import Outcome, Peer, TransferClient, TransferServer
from bdn.transfer.answer import Granted
from support.api import wait_for
from support.procmem import rss_anon_kib as _rss_anon_kib
from support.transfer import (
    KEYS,
    ServerProcess,
    Target,
    accept_ask,
    connect,
    make_chunk_file,
    read_to_end,
    recv_frame,
)

CHUNK = 1 << 20


@pytest.fixture
def src(shm):
    return make_chunk_file(shm / "f", 8 * CHUNK, CHUNK)


class Liar:
    """A peer that knows the secret and speaks the wire, then answers every ask with a DATA
    header announcing ``announce`` bytes (default: the asked length), sends ``send`` bytes of
    them and closes the connection."""

    def __init__(self, send: int, announce: int | None = None) -> None:
        self.send, self.announce = send, announce
        self.ls = socket.create_server(("127.0.0.1", 0))
        self.addr = self.ls.getsockname()
        self.connections = 0
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self) -> None:
        while True:
            try:
                sock, _ = self.ls.accept()
            except OSError:
                return
            self.connections += 1
            try:
                session, ask = accept_ask(sock, "liar")
                n = ask.length if self.announce is None else self.announce
                sock.sendall(session.seal(wire.FrameType.DATA, wire.encode_data(n)))
                sock.sendall(os.urandom(min(self.send, n)))
            except (OSError, ConnectionError):
                pass
            finally:
                sock.close()

    def close(self) -> None:
        self.ls.close()


@pytest.mark.parametrize("into", ["mapping", "fd"])
@pytest.mark.parametrize("send", [0, 1, CHUNK // 2, CHUNK - 1])
def test_body_cut_short_is_a_failure(shm, src, send, into):
    liar = Liar(send)
    client = TransferClient(KEYS, "cli")
    target = Target(shm / "out", CHUNK)
    peer = Peer("liar", *liar.addr)
    try:
        dest = target.map if into == "mapping" else target._f.fileno()
        r = client.fetch_into(peer, src.address(0), dest, 0, CHUNK, src.digests[0])
        assert r.outcome is Outcome.FAILED and "closed after" in r.error, r
        assert client.streams_open(peer) == 0  # the broken stream is not reused
    finally:
        client.close()
        target.close()
        liar.close()


def test_wrong_announced_length_is_a_failure(shm, src):
    liar = Liar(CHUNK + 10, announce=CHUNK + 10)
    client = TransferClient(KEYS, "cli")
    target = Target(shm / "out", 2 * CHUNK)
    try:
        r = client.fetch_into(Peer("liar", *liar.addr), src.address(0), target.map, 0, CHUNK, src.digests[0])
        assert r.outcome is Outcome.FAILED and "announced" in r.error
        assert target.map[CHUNK:] == bytes(CHUNK)  # nothing was written past the asked range
    finally:
        client.close()
        target.close()
        liar.close()


def _fetch_to(out: list, client: TransferClient, peer: Peer, address: str, dest, length: int, digest: str) -> None:
    out.append(client.fetch_into(peer, address, dest, 0, length, digest))


def test_server_killed_mid_body_is_a_failure(shm):
    """kill -9 of the serving process once the body has started to land: FAILED, never OK with
    a short body. If a loaded machine lets the whole chunk through before the kill lands, that
    attempt must be a bit-exact OK and the scenario is tried again."""
    big = make_chunk_file(shm / "big", 256 << 20, 256 << 20)
    page = big.path.read_bytes()[:4096]
    outcomes = []
    for _attempt in range(5):
        proc = ServerProcess(big.path, big.chunk_size)
        client = TransferClient(KEYS, "cli", rcvbuf=256 << 10, io_timeout_s=60)
        target = Target(shm / "out", big.size)
        result: list = []
        try:
            t = threading.Thread(
                target=_fetch_to,
                args=(
                    result,
                    client,
                    Peer(proc.node_id, *proc.addr),
                    big.address(0),
                    target.map,
                    big.size,
                    big.digests[0],
                ),
            )
            t.start()

            def landing(t: threading.Thread = t, target: Target = target, result: list = result) -> bool:
                if target.map[:4096] == page:
                    return True
                assert t.is_alive(), result
                return False

            wait_for(landing, 120, "the body to start landing in the mapping", 0.001)
            os.kill(proc.proc.pid, signal.SIGSTOP)  # freeze it mid-body (buffers hold far less than 256 MiB)
            os.kill(proc.proc.pid, signal.SIGKILL)
            t.join(120)
            assert result, "fetch did not return"
            r = result[0]
            outcomes.append(r.outcome)
            assert r.outcome in (Outcome.FAILED, Outcome.OK), r
            if r.ok:
                assert target.map[:] == big.path.read_bytes()
            else:
                break
        finally:
            proc.kill()
            client.close()
            target.close()
    assert Outcome.FAILED in outcomes, outcomes


def test_corrupted_bytes_from_a_lying_server_are_caught(shm, src):
    # the server's index points chunk 0's address at chunk 1's bytes
    table = dict(src.table)
    table[src.address(0)] = src.table[src.address(1)]
    with TransferServer(KEYS, "srv", table.get) as srv:
        client = TransferClient(KEYS, "cli", streams_per_peer=1)
        target = Target(shm / "out", src.size)
        peer = Peer("srv", *srv.address)
        try:
            r = client.fetch_into(peer, src.address(0), target.map, 0, CHUNK, src.digests[0])
            assert r.outcome is Outcome.CORRUPT and src.digests[0] in r.error
            # a stream that carried wrong bytes is not reused (a liar may have sent more than it
            # announced): the next chunk comes over a new one
            assert client.fetch_into(peer, src.address(2), target.map, 2 * CHUNK, CHUNK, src.digests[2]).ok
            assert srv.stats.connections == 2
        finally:
            client.close()
            target.close()


def test_file_shorter_than_its_location_is_not_served(shm, src):
    table = {src.address(0): (str(src.path), src.size - CHUNK // 2, CHUNK)}
    with TransferServer(KEYS, "srv", table.get) as srv:
        client = TransferClient(KEYS, "cli")
        target = Target(shm / "out", CHUNK)
        try:
            r = client.fetch_into(Peer("srv", *srv.address), src.address(0), target.map, 0, CHUNK, src.digests[0])
            assert r.outcome is Outcome.NOT_HERE
        finally:
            client.close()
            target.close()


def _session_socket(addr):
    sock, nonce = connect(addr)
    hello, session = handshake.client_hello(KEYS, "cli", "srv", nonce, secrets.token_bytes(32), time.time())
    sock.sendall(hello)
    assert recv_frame(sock)[0] == wire.FrameType.ACCEPT
    return sock, session


def _flip_last(frame: bytes) -> bytes:
    return frame[:-1] + bytes([frame[-1] ^ 1])


def _untagged(payload: bytes) -> bytes:
    return wire.HEADER.pack(1 + len(payload), wire.FrameType.ASK) + payload


def test_garbage_and_huge_frames_close_that_connection_only(shm, src):
    with TransferServer(KEYS, "srv", src.resolve) as srv:
        client = TransferClient(KEYS, "cli", streams_per_peer=1)
        target = Target(shm / "out", src.size)
        peer = Peer("srv", *srv.address)
        try:
            assert client.fetch_into(peer, src.address(0), target.map, 0, CHUNK, src.digests[0]).ok
            rss0 = _rss_anon_kib()
            attacks = {
                "garbage before the handshake": lambda s, _: s.sendall(os.urandom(4096)),
                "http request": lambda s, _: s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"),
                "4 GiB frame before the handshake": lambda s, _: s.sendall(wire.HEADER.pack(0xFFFFFFFF, 2)),
                "frame just over the limit": lambda s, _: s.sendall(
                    wire.HEADER.pack(wire.MAX_FRAME + 1, 2) + bytes(100)
                ),
                "unknown frame type": lambda s, _: s.sendall(wire.HEADER.pack(10, 0x7F) + bytes(9)),
            }
            for _ in range(20):  # repeated: memory must not grow with them
                for name, send in attacks.items():
                    sock, _nonce = connect(srv.address)
                    try:
                        send(sock, None)
                        data, end = read_to_end(sock)
                        assert data == b"" and end in ("eof", "reset"), name
                    finally:
                        sock.close()
            after_handshake = {
                "4 GiB frame": lambda s, sess: s.sendall(wire.HEADER.pack(0xFFFFFFFF, wire.FrameType.ASK)),
                "garbage": lambda s, sess: s.sendall(os.urandom(4096)),
                "bad tag": lambda s, sess: s.sendall(
                    _flip_last(sess.seal(wire.FrameType.ASK, wire.encode_ask(wire.Ask(src.address(1), 0, CHUNK))))
                ),
                "untagged ask": lambda s, sess: s.sendall(
                    _untagged(wire.encode_ask(wire.Ask(src.address(1), 0, CHUNK)))
                ),
                "server frame from a client": lambda s, sess: s.sendall(
                    sess.seal(wire.FrameType.DATA, wire.encode_data(5))
                ),
                "malformed ask": lambda s, sess: s.sendall(sess.seal(wire.FrameType.ASK, b"\1\2\3")),
                "ask of 0 bytes": lambda s, sess: s.sendall(
                    sess.seal(wire.FrameType.ASK, bytes(16) + bytes(8) + bytes(8) + bytes(5))
                ),
            }
            for name, send in after_handshake.items():
                sock, session = _session_socket(srv.address)
                try:
                    send(sock, session)
                    data, end = read_to_end(sock)
                    assert data == b"" and end in ("eof", "reset"), name
                finally:
                    sock.close()
            # the server kept serving the established stream and serves new ones
            assert client.fetch_into(peer, src.address(3), target.map, 3 * CHUNK, CHUNK, src.digests[3]).ok
            other = TransferClient(KEYS, "cli2")
            assert other.fetch_into(peer, src.address(4), target.map, 4 * CHUNK, CHUNK, src.digests[4]).ok
            other.close()
            assert srv.stats.protocol_errors >= len(after_handshake)
            assert _rss_anon_kib() - rss0 < 16 << 10, "server memory grew with garbage and huge frames"
        finally:
            client.close()
            target.close()


def test_strangers_in_their_handshake_cannot_keep_a_peer_out(shm, src):
    """300 connections that never say hello (no secret needed) held the transfer port's 256
    slots, so no peer could connect (tests/test_adversarial_*: breaker). Pending handshakes are
    bounded on their own; a newcomer drops the oldest, so a real peer gets in and is served."""
    with TransferServer(KEYS, "srv", src.resolve, max_connections=4, max_handshakes=8) as srv:
        silent = [connect(srv.address)[0] for _ in range(40)]
        try:
            client = TransferClient(KEYS, "cli")
            target = Target(shm / "out", CHUNK)
            r = client.fetch_into(Peer("srv", *srv.address), src.address(0), target.map, 0, CHUNK, src.digests[0])
            assert r.ok, r
            assert srv.stats.handshakes_evicted >= 40 - 8
            # the oldest strangers were dropped: they read EOF long before the 10 s handshake timeout
            assert read_to_end(silent[0], timeout_s=60) == (b"", "eof")
            client.close()
            target.close()
        finally:
            for s in silent:
                s.close()


def test_silent_connections_are_dropped_and_the_cap_holds(shm, src):
    with TransferServer(KEYS, "srv", src.resolve, handshake_timeout_s=0.5, max_connections=4, max_handshakes=4) as srv:
        silent = [connect(srv.address)[0] for _ in range(3)]
        try:
            for s in silent:
                assert read_to_end(s, timeout_s=60) == (b"", "eof")  # closed by the handshake timeout
            wait_for(srv.open_connections, 60, "the server to drop every connection", 0.01, until=lambda n: not n)
            # beyond the handshake bound the oldest unauthenticated connection is dropped and the
            # newcomer gets its hello
            held = [connect(srv.address)[0] for _ in range(4)]
            extra, _ = connect(srv.address)
            assert read_to_end(held[0], timeout_s=60) == (b"", "eof")
            assert srv.stats.handshakes_evicted == 1
            extra.close()
            for s in held:
                s.close()
            client = TransferClient(KEYS, "cli")
            target = Target(shm / "out", CHUNK)
            # the held ones go as the server notices them closed
            wait_for(
                lambda: client.fetch_into(
                    Peer("srv", *srv.address), src.address(0), target.map, 0, CHUNK, src.digests[0]
                ),
                60,
                "a fetch to succeed",
                0.05,
                until=lambda r: r.ok,
            )
            client.close()
            target.close()
        finally:
            for s in silent:
                s.close()


def test_a_failing_callback_ends_that_connection_only(shm, src):
    def resolve(address: str):
        if address == src.address(0):
            raise RuntimeError("index bug")
        return src.resolve(address)

    with TransferServer(KEYS, "srv", resolve) as srv:
        client = TransferClient(KEYS, "cli")
        target = Target(shm / "out", src.size)
        peer = Peer("srv", *srv.address)
        try:
            assert (
                client.fetch_into(peer, src.address(0), target.map, 0, CHUNK, src.digests[0]).outcome is Outcome.FAILED
            )
            assert client.fetch_into(peer, src.address(1), target.map, CHUNK, CHUNK, src.digests[1]).ok
        finally:
            client.close()
            target.close()


def test_a_peer_that_reads_a_little_now_and_then_gives_its_upload_slot_back(shm, src):
    """breaker2: the server sent a DATA body with ``sendfile`` until it was whole, each call bounded
    only by the send timeout; a peer (with the secret) reading 2 KiB every 0.05 s is never silent
    for a whole timeout, so it held the connection thread and its upload slot for the body's length
    at that pace (minutes for 1 MiB; hours for 16 MiB at a byte a second). The body now has the
    deadline its receiver gives it (``receive.body_limit`` on the send timeout)."""
    send_timeout = 0.5
    released: list[bool] = []
    srv = TransferServer(
        KEYS,
        "srv",
        src.resolve,
        admit=lambda peer, ask: Granted(released.append),
        send_timeout_s=send_timeout,
        sndbuf=4096,
    )
    host, port = srv.start()
    client = TransferClient(KEYS, "slow", rcvbuf=4096, io_timeout_s=30)
    stream = client.connect(Peer("srv", host, port))
    got = 0
    ended = threading.Event()

    def read_slowly() -> None:
        # 2 KiB every 0.05 s: the 1 MiB body would take ~26 s at this pace, never silent for 0.5 s
        nonlocal got
        try:
            while True:
                b = stream.sock.recv(2048)
                if not b:
                    return
                got += len(b)
                time.sleep(0.05)
        except OSError:
            return
        finally:
            ended.set()

    reader = threading.Thread(target=read_slowly, daemon=True)
    try:
        ask = wire.encode_ask(wire.Ask(src.address(0), 0, CHUNK, 0, None, 0))
        stream.sock.sendall(stream.session.seal(wire.FrameType.ASK, ask))
        stream.sock.settimeout(60)
        reader.start()
        # without the body's deadline the slot came back only with the whole body sent (True);
        # with it, the watchdog cuts the send off: the slot comes back False, long before the end
        assert wait_for(lambda: released, 60, "the upload slot released") == [False], (released, got)
        assert srv._deadlines.fired == 1 and srv.stats.aborted == 1, (srv._deadlines.fired, srv.stats)
        assert ended.wait(60), "the slow reader's connection never ended"
        assert got < CHUNK, got  # the body was cut short, not sent whole
        assert wait_for(lambda: srv.open_connections() == 0, 30, "the slow reader's connection closed")
    finally:
        stream.sock.close()
        reader.join(5)
        client.close()
        srv.close()


def test_send_deadlines_of_answers_that_ended_in_time_are_not_kept(shm, src):
    """Each answer registers its send deadline (bdn.transfer.deadlines); one that ends in time
    leaves nothing behind, so the watchdog's heap holds only the sends in flight."""
    srv = TransferServer(KEYS, "srv", src.resolve, send_timeout_s=30)
    host, port = srv.start()
    client = TransferClient(KEYS, "cli", io_timeout_s=30)
    target = Target(shm / "out", 8 * CHUNK)
    try:
        for _rep in range(3):
            for i in range(8):
                r = client.fetch_into(
                    Peer("srv", host, port), src.address(i), target.map, i * CHUNK, CHUNK, src.digests[i]
                )
                assert r.outcome is Outcome.OK, r
        assert len(srv._deadlines) == 0
    finally:
        client.close()
        target.close()
        srv.close()
