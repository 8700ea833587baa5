"""The transfer layer's isolation on real sockets: without the secret nothing is learned (unknown
swarm, wrong secret, replay, skewed clock, a hello made for another daemon: one answer, for chunks
that exist and that do not), and nothing captured can be replayed, not even at another daemon of
the same swarm."""

from __future__ import annotations

import secrets
import shutil
import time

import pytest

from bdn.proto import handshake, wire
from bdn.proto.keys import MAX_SKEW_S, SwarmKeys, derive_keys
from bdn.transfer import Outcome, Peer, TransferClient, TransferServer
from support.transfer import (
    KEYS,
    Target,
    connect,
    make_chunk_file,
    read_to_end,
    recv_frame,
    shm_tmpdir,
)

CHUNK = 256 << 10
OTHER = derive_keys("a-different-partition-secret-42")
ABSENT = "5a" * 16


@pytest.fixture(scope="module")
def src():
    d = shm_tmpdir()
    yield make_chunk_file(d / "f", 4 * CHUNK, CHUNK)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def server(src):
    with TransferServer(KEYS, "srv", src.resolve) as s:
        yield s


def _ask(address: str) -> bytes:
    return wire.encode_ask(wire.Ask(address, 0, CHUNK))


def _probe(
    addr,
    address: str,
    *,
    keys: SwarmKeys = KEYS,
    target: str = "srv",
    skew: float = 0.0,
    hello: bytes | None = None,
    ask: bytes | None = None,
) -> tuple[bytes, str]:
    """Connect, send a hello (made here, or the captured ``hello``) and an ask in one write, and
    return what came back and how the connection ended."""
    sock, nonce = connect(addr)
    try:
        if hello is None:
            hello, session = handshake.client_hello(
                keys, "cli", target, nonce, secrets.token_bytes(32), time.time() + skew
            )
            ask = session.seal(wire.FrameType.ASK, _ask(address))
        sock.sendall(hello + (ask or b""))
        return read_to_end(sock)
    finally:
        sock.close()


def _capture(addr, address: str) -> tuple[bytes, bytes, bytes, bytes]:
    """A legitimate exchange at ``addr``: (server nonce, hello, ask frame, answer received)."""
    sock, nonce = connect(addr)
    try:
        hello, session = handshake.client_hello(KEYS, "cli", "srv", nonce, secrets.token_bytes(32), time.time())
        ask = session.seal(wire.FrameType.ASK, _ask(address))
        sock.sendall(hello)
        ftype, body = recv_frame(sock)
        assert ftype == wire.FrameType.ACCEPT
        handshake.check_accept(session, body)
        sock.sendall(ask)
        ftype, body = recv_frame(sock)
        return nonce, hello, ask, bytes([ftype]) + body
    finally:
        sock.close()


def test_one_answer_for_every_failure_for_present_and_absent_chunks(server, src):
    wrong_secret = SwarmKeys(KEYS.swarm_id, OTHER.auth_key, OTHER.address_key)
    _, old_hello, old_ask, _ = _capture(server.address, src.address(0))
    answers = {}
    for name, address in (("present", src.address(0)), ("absent", ABSENT)):
        answers[("unknown swarm", name)] = _probe(server.address, address, keys=OTHER)
        answers[("wrong secret", name)] = _probe(server.address, address, keys=wrong_secret)
        answers[("skew behind", name)] = _probe(server.address, address, skew=-(MAX_SKEW_S + 5))
        answers[("skew ahead", name)] = _probe(server.address, address, skew=MAX_SKEW_S + 5)
        answers[("for another daemon", name)] = _probe(server.address, address, target="srv2")
        answers[("replayed hello", name)] = _probe(server.address, address, hello=old_hello, ask=old_ask)
    assert len(set(answers.values())) == 1, answers
    got, _end = next(iter(answers.values()))
    assert got == b""  # not a byte after the server hello
    # the probe can tell a working exchange from a refusal
    assert _capture(server.address, src.address(0))[3][0] == wire.FrameType.DATA
    assert _capture(server.address, ABSENT)[3][0] == wire.FrameType.NOT_HERE
    assert server.stats.handshakes_refused == len(answers)


def test_client_without_the_secret_is_refused_and_learns_nothing(server, src):
    stranger = TransferClient(OTHER, "cli")
    target = Target(src.path.parent / "t", CHUNK)
    try:
        for address in (src.address(0), ABSENT):
            r = stranger.fetch_into(Peer("srv", *server.address), address, target.map, 0, CHUNK, src.digests[0])
            assert r.outcome is Outcome.FAILED and "refused the transfer handshake" in r.error
    finally:
        stranger.close()
        target.close()


def test_captured_handshake_refused_by_same_server_and_another_daemon_of_the_swarm(src):
    with TransferServer(KEYS, "srv", src.resolve) as a:
        nonce_a, hello, ask, answer = _capture(a.address, src.address(1))
        assert answer[0] == wire.FrameType.DATA
        # B belongs to the same swarm and (worst case) even draws A's server nonce
        with TransferServer(KEYS, "srv-b", src.resolve, nonce=lambda n: nonce_a) as b:
            assert _probe(b.address, "", hello=hello, ask=ask) == (b"", "reset")
            assert b.stats.handshakes_refused == 1 and b.stats.chunks_out == 0
        assert _probe(a.address, "", hello=hello, ask=ask) == (b"", "reset")
        assert a.stats.handshakes_refused == 1  # counted before the connection closes


def test_captured_request_cannot_be_replayed_in_another_session_or_again(server, src):
    _, _, ask, answer = _capture(server.address, src.address(2))
    assert answer[0] == wire.FrameType.DATA
    # a fresh, valid session carrying the captured ASK frame: bad tag, connection closed
    sock, nonce = connect(server.address)
    try:
        hello, session = handshake.client_hello(KEYS, "cli", "srv", nonce, secrets.token_bytes(32), time.time())
        sock.sendall(hello)
        assert recv_frame(sock)[0] == wire.FrameType.ACCEPT
        sock.sendall(ask)
        assert read_to_end(sock)[0] == b""
    finally:
        sock.close()
    # within one session, the same ASK frame twice: answered once, then closed
    sock, nonce = connect(server.address)
    try:
        hello, session = handshake.client_hello(KEYS, "cli", "srv", nonce, secrets.token_bytes(32), time.time())
        frame = session.seal(wire.FrameType.ASK, _ask(ABSENT))
        sock.sendall(hello)
        assert recv_frame(sock)[0] == wire.FrameType.ACCEPT
        sock.sendall(frame)
        assert recv_frame(sock)[0] == wire.FrameType.NOT_HERE
        sock.sendall(frame)
        assert read_to_end(sock)[0] == b""
    finally:
        sock.close()


def test_server_without_the_secret_is_not_trusted(src):
    """A daemon of another partition answering at a peer's address: the client refuses it."""
    with TransferServer(OTHER, "srv", src.resolve) as impostor:
        client = TransferClient(KEYS, "cli")
        target = Target(src.path.parent / "t2", CHUNK)
        try:
            r = client.fetch_into(Peer("srv", *impostor.address), src.address(0), target.map, 0, CHUNK, src.digests[0])
            assert r.outcome is Outcome.FAILED
        finally:
            client.close()
            target.close()
