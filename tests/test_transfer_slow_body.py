"""A DATA or PART body that comes slowly, stops, or is interrupted, received with ``MSG_WAITALL``
on a blocking socket with a kernel receive timeout (bdn/transfer/receive.py).

On Linux the receive timeout of one ``MSG_WAITALL`` call bounds that call as a whole (a trickle
does not restart it; the call returns what came when it runs out), so a body that stops after
some bytes ends within two receive timeouts of its last byte, and a body that trickles on (one
byte now and then, never silent for a whole timeout) would, piece by piece, never end: it is
bounded by the body deadline of ``receive.body_limit``. Never a short success, and a stream that
failed (or got more than it asked for) is not reused."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest

from bdn.proto import handshake, wire
from bdn.transfer import Outcome, Peer, TransferClient
from bdn.transfer.receive import body_limit
from support.transfer import KEYS, Target, accept_ask, make_chunk_file

CHUNK = 1 << 20


@pytest.fixture
def src(shm):
    return make_chunk_file(shm / "f", 2 * CHUNK, CHUNK)


class Sender:
    """A peer that knows the secret: answers each ask with a DATA header (or one PART covering
    the range, ``part=True``) announcing ``announce`` bytes (default: the asked length), then
    sends the chunk's true bytes as ``plan(body)`` says: an iterable of (bytes, pause before
    them); then ``tail`` extra bytes; then holds the connection open until closed (``hold``) or
    closes it."""

    def __init__(
        self,
        data: bytes,
        plan,
        *,
        part: bool = False,
        announce: int | None = None,
        tail: bytes = b"",
        hold: bool = True,
        delay_header: float = 0.0,
        trickle_header: float = 0.0,
    ) -> None:
        self.delay_header, self.trickle_header = delay_header, trickle_header
        self.data, self.plan, self.part, self.announce, self.tail, self.hold = data, plan, part, announce, tail, hold
        self.ls = socket.create_server(("127.0.0.1", 0))
        self.addr = self.ls.getsockname()
        self.connections = 0
        self.done = threading.Event()
        self.stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                sock, _ = self.ls.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._one, args=(sock,), daemon=True).start()

    def _one(self, sock: socket.socket) -> None:
        try:
            session, ask = accept_ask(sock, "sender")
            n = ask.length if self.announce is None else self.announce
            if self.delay_header and self.stop.wait(self.delay_header):
                return
            if self.part:
                header = session.seal(wire.FrameType.PART, wire.encode_part(0, n))
            else:
                header = session.seal(wire.FrameType.DATA, wire.encode_data(n))
            if self.trickle_header:  # the answer's frame a byte at a time
                for i in range(len(header)):
                    if self.stop.wait(self.trickle_header):
                        return
                    sock.sendall(header[i : i + 1])
            else:
                sock.sendall(header)
            for piece, pause in self.plan(self.data):
                if self.stop.wait(pause):
                    return
                sock.sendall(piece)
            if self.tail:
                sock.sendall(self.tail)
            self.done.set()
            if self.hold:
                self.stop.wait(60)
        except OSError:
            pass
        finally:
            sock.close()

    def close(self) -> None:
        self.stop.set()
        self.ls.close()


def _fetch(client, peer, src, target, into, cut=False):
    dest = target._f.fileno() if into == "fd" else target.map
    return client.fetch_into(peer, src.address(0), dest, 0, CHUNK, src.digests[0], cut_through=cut)


def _fetch_bounded(client, peer, src, target, into, cut=False, join_s=60.0):
    """The fetch on a thread, joined for at most ``join_s``: (result or None, seconds)."""
    out: list = []
    t0 = time.monotonic()
    th = threading.Thread(target=lambda: out.append(_fetch(client, peer, src, target, into, cut)), daemon=True)
    th.start()
    th.join(join_s)
    return (out[0] if out else None), time.monotonic() - t0


def _chunk(src) -> bytes:
    with open(src.path, "rb") as f:
        return f.read(CHUNK)


VARIANTS = [("mapping", False), ("fd", False), ("mapping", True)]  # DATA into a mapping / a file; PART


@pytest.mark.parametrize(("into", "cut"), VARIANTS)
def test_an_honest_slow_body_lands_whole(shm, src, into, cut):
    """Pieces of every size, some a single byte, with pauses well inside the timeout: OK."""

    def plan(d: bytes):
        pos, k = 0, 0
        while pos < len(d):
            n = 1 if k % 3 == 0 else min(len(d) - pos, 97 * (k + 1) ** 3)
            yield d[pos : pos + n], 0.01 if k % 5 == 0 else 0.0
            pos, k = pos + n, k + 1

    data = _chunk(src)
    s = Sender(data, plan)
    client = TransferClient(KEYS, "cli", io_timeout_s=5)
    target = Target(shm / "out", CHUNK)
    try:
        r = _fetch(client, Peer("sender", *s.addr), src, target, into, cut)
        assert r.outcome is Outcome.OK, r
        assert target.map[:] == data
    finally:
        client.close()
        target.close()
        s.close()


@pytest.mark.parametrize(("into", "cut"), VARIANTS)
def test_a_body_that_stops_fails_within_two_timeouts_and_is_never_ok(shm, src, into, cut):
    io = 1.0
    data = _chunk(src)
    s = Sender(data, lambda d: [(d[: len(d) // 2], 0.0), (d[len(d) // 2 : len(d) // 2 + 1], 0.5)])
    client = TransferClient(KEYS, "cli", io_timeout_s=io)
    target = Target(shm / "out", CHUNK)
    peer = Peer("sender", *s.addr)
    try:
        r, took = _fetch_bounded(client, peer, src, target, into, cut)
        assert r is not None and r.outcome is Outcome.FAILED, r
        # the last byte came 0.5 s in; its WAITALL call then ran out, and one more call found nothing
        assert took <= 0.5 + 2 * io + 1.5, took
        assert client.streams_open(peer) == 0  # the stalled stream is not reused
    finally:
        client.close()
        target.close()
        s.close()


@pytest.mark.parametrize(("into", "cut"), VARIANTS)
def test_a_body_that_trickles_on_forever_is_cut_off_at_its_deadline(shm, src, into, cut):
    """One byte every 0.6 x the timeout: never silent for a whole timeout, so only a deadline on
    the body as a whole ends it (without one a 1 MiB body took 1 MiB x 0.3 s, a fetch thread
    held for months)."""
    io = 0.5
    data = _chunk(src)
    s = Sender(data, lambda d: ((d[i : i + 1], 0.3) for i in range(len(d))))
    client = TransferClient(KEYS, "cli", io_timeout_s=io)
    target = Target(shm / "out", CHUNK)
    try:
        r, took = _fetch_bounded(client, Peer("sender", *s.addr), src, target, into, cut, join_s=20)
        assert r is not None, f"the trickled body was still being received after {took:.0f} s"
        assert r.outcome is Outcome.FAILED, r
        limit = (4 * io) if cut else body_limit(CHUNK, io)
        assert took <= limit + 2 * io + 1.5, (took, limit)
    finally:
        client.close()
        target.close()
        s.close()


@pytest.mark.parametrize(("into", "cut"), VARIANTS)
def test_signals_at_the_receiving_thread_do_not_cut_a_body_short(shm, src, into, cut):
    got: list[int] = []
    old = signal.signal(signal.SIGUSR1, lambda *_: got.append(1))
    data = _chunk(src)
    s = Sender(data, lambda d: ((d[i : i + 4096], 0.002) for i in range(0, len(d), 4096)))
    client = TransferClient(KEYS, "cli", io_timeout_s=10)
    target = Target(shm / "out", CHUNK)
    out: list = []
    try:
        th = threading.Thread(
            target=lambda: out.append(_fetch(client, Peer("sender", *s.addr), src, target, into, cut))
        )
        th.start()
        while th.is_alive():
            signal.pthread_kill(th.ident, signal.SIGUSR1)
            time.sleep(0.003)
        assert out and out[0].outcome is Outcome.OK, out
        assert target.map[:] == data and got  # interrupted, and whole
    finally:
        signal.signal(signal.SIGUSR1, old)
        client.close()
        target.close()
        s.close()


@pytest.mark.parametrize("into", ["mapping", "fd"])
def test_bytes_past_the_announced_body_are_never_read_as_an_answer(shm, src, into):
    """A sender that sends the true body and then more: the chunk is OK (its bytes match), but the
    stream is not used again (the extra bytes would be read as the next answer's frame)."""
    data = _chunk(src)
    s = Sender(data, lambda d: [(d, 0.0)], tail=os.urandom(100))
    client = TransferClient(KEYS, "cli", io_timeout_s=5)
    target = Target(shm / "out", CHUNK)
    peer = Peer("sender", *s.addr)
    try:
        assert _fetch(client, peer, src, target, into).outcome is Outcome.OK
        assert s.done.wait(10)
        time.sleep(0.2)  # the tail is queued at the receiver
        target.map[:] = bytes(CHUNK)
        assert _fetch(client, peer, src, target, into).outcome is Outcome.OK
        assert s.connections == 2  # the first stream was dropped as it held bytes nobody asked for
        assert target.map[:] == data
    finally:
        client.close()
        target.close()
        s.close()


@pytest.mark.parametrize("into", ["mapping", "fd"])
def test_a_body_announced_shorter_is_a_failure(shm, src, into):
    s = Sender(_chunk(src), lambda d: [(d[:-1], 0.0)], announce=CHUNK - 1)
    client = TransferClient(KEYS, "cli", io_timeout_s=5)
    target = Target(shm / "out", CHUNK)
    try:
        r = _fetch(client, Peer("sender", *s.addr), src, target, into)
        assert r.outcome is Outcome.FAILED and "announced" in r.error, r
    finally:
        client.close()
        target.close()
        s.close()


@pytest.mark.parametrize("into", ["mapping", "fd"])
def test_the_wait_of_a_held_request_does_not_stretch_the_silence_of_its_body(shm, src, into):
    """A request held up to ``wait_s`` has that much more for its answer to begin; once the body
    begins a stop ends it within two ``io_timeout_s`` (it was two of ``io_timeout_s + wait_s``)."""
    io, wait = 1.0, 5.0
    data = _chunk(src)
    s = Sender(data, lambda d: [(d[:1000], 0.0)], delay_header=1.5)  # the answer after 1.5 s, then a stop
    client = TransferClient(KEYS, "cli", io_timeout_s=io)
    target = Target(shm / "out", CHUNK)
    dest = target._f.fileno() if into == "fd" else target.map
    try:
        t0 = time.monotonic()
        r = client.fetch_into(Peer("sender", *s.addr), src.address(0), dest, 0, CHUNK, src.digests[0], wait_s=wait)
        took = time.monotonic() - t0
        assert r.outcome is Outcome.FAILED, r
        assert took <= 1.5 + 2 * io + 1.0, took  # not 1.5 + 2 x (io + wait)
    finally:
        client.close()
        target.close()
        s.close()


class HaveSpammer:
    """A peer that knows the secret and answers the first request (ASK or TAKE) with HAVE frames
    only, one every 0.2 s, forever: never silent, never an answer."""

    def __init__(self) -> None:
        self.ls = socket.create_server(("127.0.0.1", 0))
        self.addr = self.ls.getsockname()
        self.stop = threading.Event()
        self.sent = 0
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        import secrets

        from support.transfer import recv_frame

        while True:
            try:
                sock, _ = self.ls.accept()
            except OSError:
                return
            try:
                nonce = secrets.token_bytes(handshake.NONCE_BYTES)
                sock.sendall(handshake.server_hello(nonce))
                _, body = recv_frame(sock)
                accept, session = handshake.check_client_hello(KEYS, "spammer", nonce, body, time.time())
                sock.sendall(accept)
                ftype, body = recv_frame(sock)
                session.open(ftype, body)
                have = wire.encode_have(wire.Have("step000001", 0, (1, 2, 3)))
                while not self.stop.wait(0.2):
                    sock.sendall(session.seal(wire.FrameType.HAVE, have))
                    self.sent += 1
            except OSError:
                pass
            finally:
                sock.close()

    def close(self) -> None:
        self.stop.set()
        self.ls.close()


@pytest.mark.parametrize("what", ["ask", "ask-waited", "take"])
def test_an_answer_that_never_begins_ends_at_the_timeout_however_many_haves_come(shm, src, what):
    """HAVE frames on a request stream are skipped (they are announcements, not answers); a peer
    sending them without end held the fetch (or TAKE) thread for ever: the answer must begin
    within ``io_timeout_s`` (plus the request's wait) whatever else comes."""
    io = 1.0
    s = HaveSpammer()
    client = TransferClient(KEYS, "cli", io_timeout_s=io)
    target = Target(shm / "out", CHUNK)
    peer = Peer("spammer", *s.addr)
    wait = 2.0 if what == "ask-waited" else 0.0
    out: list = []

    def go() -> None:
        if what == "take":
            out.append(client.take(peer, "step000001", 1))
        else:
            out.append(client.fetch_into(peer, src.address(0), target.map, 0, CHUNK, src.digests[0], wait_s=wait))

    try:
        t0 = time.monotonic()
        th = threading.Thread(target=go, daemon=True)
        th.start()
        th.join(30)
        took = time.monotonic() - t0
        assert out, f"still waiting for an answer after {took:.0f} s ({s.sent} HAVEs)"
        if what == "take":
            assert out[0] is False
        else:
            assert out[0].outcome is Outcome.FAILED, out[0]
        assert took <= io + wait + 1.5, took
    finally:
        client.close()
        target.close()
        s.close()


def test_an_answer_frame_that_trickles_in_is_cut_off_at_the_answers_deadline(shm, src):
    """The answer's frame header one byte every 0.6 x the timeout: every receive gets a byte, so
    only the answer's deadline (io_timeout + wait) ends it; without one a frame of ~40 bytes held
    the fetch thread ~40 x 0.3 s (a daemon's request waited 80-120 s)."""
    io = 0.5
    s = Sender(_chunk(src), lambda d: [(d, 0.0)], trickle_header=0.3)
    client = TransferClient(KEYS, "cli", io_timeout_s=io)
    target = Target(shm / "out", CHUNK)
    try:
        r, took = _fetch_bounded(client, Peer("sender", *s.addr), src, target, "mapping", join_s=60)
        assert r is not None, f"the trickled answer was still being received after {took:.0f} s"
        assert r.outcome is Outcome.FAILED and "deadline" in (r.error or ""), r
        assert took <= io + 2 * io + 1.5, took
        assert client.streams_open(Peer("sender", *s.addr)) == 0
    finally:
        client.close()
        target.close()
        s.close()


class SplitPartSender:
    """A peer that knows the secret and answers an ASK with a cut-through answer in two PARTs: the
    first half of the chunk at once, then the second PART frame's header trickled a byte every
    ``trickle`` s (then its bytes)."""

    def __init__(self, data: bytes, trickle: float) -> None:
        self.data, self.trickle = data, trickle
        self.ls = socket.create_server(("127.0.0.1", 0))
        self.addr = self.ls.getsockname()
        self.stop = threading.Event()
        self.trickled = 0
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                sock, _ = self.ls.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(sock,), daemon=True).start()

    def _one(self, sock: socket.socket) -> None:
        try:
            session, ask = accept_ask(sock, "sender")
            half = ask.length // 2
            sock.sendall(session.seal(wire.FrameType.PART, wire.encode_part(0, half)) + self.data[:half])
            second = session.seal(wire.FrameType.PART, wire.encode_part(half, ask.length - half))
            for i in range(len(second)):
                if self.stop.wait(self.trickle):
                    return
                sock.sendall(second[i : i + 1])
                self.trickled += 1
            sock.sendall(self.data[half : ask.length])
            self.stop.wait(60)
        except OSError:
            pass
        finally:
            sock.close()

    def close(self) -> None:
        self.stop.set()
        self.ls.close()


def test_a_later_part_frame_that_trickles_in_is_cut_off_at_the_answers_deadline(shm, src):
    """breaker2: the PART frames after the first were read without the answer's deadline (only
    checked between frames), so a second PART header trickled a byte every 0.6 x the timeout held
    the fetch thread ~40 x 0.3 s past ``wait_s + 4 x io_timeout``."""
    io = 0.5
    s = SplitPartSender(_chunk(src), trickle=0.3)
    client = TransferClient(KEYS, "cli", io_timeout_s=io)
    target = Target(shm / "out", CHUNK)
    try:
        r, took = _fetch_bounded(client, Peer("sender", *s.addr), src, target, "mapping", cut=True, join_s=60)
        assert r is not None, f"the trickled part was still being received after {took:.0f} s"
        assert r.outcome is Outcome.FAILED and "deadline" in (r.error or ""), r
        assert took <= 4 * io + 2 * io + 1.5, (took, s.trickled)
        assert client.streams_open(Peer("sender", *s.addr)) == 0
    finally:
        client.close()
        target.close()
        s.close()
