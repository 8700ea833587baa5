"""Cut-through answers (bdn.transfer.growing) on real sockets: a chunk still landing at the
server goes to the asker part by part as it lands; the last bytes only once the server verified
the chunk; a copy the server finds bad is cut off (FAILED, never CORRUPT); a server that lies
with PARTs (overlapping, outside the range, to an asker that did not accept them) is a failure."""

from __future__ import annotations

import mmap
import os
import socket
import threading

import pytest

from bdn.proto import wire
from bdn.proto.chunks import digest
from bdn.proto.errors import ProtocolError
from bdn.transfer import GRANTED, NOT_HERE, FetchPool, Outcome, Peer, TransferClient, TransferServer
from bdn.transfer.coverage import Coverage
from bdn.transfer.growing import HOLD_BYTES, Growing, GrowingChunks
from support.api import wait_for
from support.transfer import KEYS, accept_ask

CHUNK = 1 << 20
PARTS = [(0, 256 << 10), (256 << 10, 256 << 10), (512 << 10, 256 << 10), (768 << 10, 256 << 10)]


class Landing:
    """A chunk file in tmpfs whose bytes land part by part, as an owner's bucket read does."""

    def __init__(self, path, data: bytes) -> None:
        self.data = data
        self.path = path
        path.write_bytes(b"\0" * len(data))
        self.g = Growing(str(path), 0, PARTS)
        self.fd = os.open(path, os.O_RDWR)

    def land(self, part: int, upto: int) -> None:
        off, n = PARTS[part]
        os.pwrite(self.fd, self.data[off : off + upto], off)
        self.g.landed(part, upto)

    def land_all(self) -> None:
        for i, (_, n) in enumerate(PARTS):
            self.land(i, n)

    def close(self) -> None:
        os.close(self.fd)


def _serve(growing: GrowingChunks, index: dict):
    def resolve(address: str):
        return index.get(address) or growing.get(address)

    return TransferServer(KEYS, "owner", resolve, admit=lambda peer, ask: GRANTED)


@pytest.fixture
def landing(shm):
    ld = Landing(shm / "chunk", os.urandom(CHUNK))
    yield ld
    ld.close()


def test_parts_go_out_as_they_land_and_the_end_only_once_verified(shm, landing):
    growing = GrowingChunks()
    address = KEYS.address(digest(landing.data))
    growing.start(address, landing.g)
    with _serve(growing, {}) as srv:
        client = TransferClient(KEYS, "cli", io_timeout_s=30)
        pool = FetchPool(client, workers=1)
        out = bytearray(CHUNK)
        try:
            fut = pool.submit(
                Peer("owner", *srv.address), address, out, 0, CHUNK, digest(landing.data), cut_through=True
            )
            # parts land out of order; the asker receives each one as it lands
            landing.land(2, 256 << 10)
            wait_for(lambda: out[512 << 10 : 768 << 10] == landing.data[512 << 10 : 768 << 10], 120, "part 2", 0.01)
            landing.land(0, 128 << 10)
            wait_for(lambda: out[: 128 << 10] == landing.data[: 128 << 10], 120, "half of part 0", 0.01)
            landing.land_all()
            # everything landed but the chunk is not verified: the last HOLD_BYTES stay back
            wait_for(
                lambda: out[: CHUNK - HOLD_BYTES] == landing.data[: CHUNK - HOLD_BYTES], 120, "all but the end", 0.01
            )
            assert not fut.done()
            assert out[CHUNK - HOLD_BYTES :] != landing.data[CHUNK - HOLD_BYTES :]
            landing.g.verified()
            res = fut.result(120)
            assert res.ok and res.cut_through
            assert bytes(out) == landing.data
            # counted by the server thread once its answer ended (after the client had it all)
            wait_for(lambda: srv.stats.cut_through == 1, 120, "the server to count its cut-through answer", 0.01)
        finally:
            pool.close()
            client.close()


def test_a_copy_the_server_finds_bad_is_cut_off_not_blamed(shm, landing):
    """The owner's bucket bytes did not match the digest: the asker gets FAILED (ask again),
    never CORRUPT (which would penalise an honest owner); the connection is closed."""
    growing = GrowingChunks()
    real = digest(landing.data)
    landing.data = os.urandom(CHUNK)  # what lands is not the chunk the digest names
    address = KEYS.address(real)
    growing.start(address, landing.g)
    with _serve(growing, {}) as srv:
        client = TransferClient(KEYS, "cli", io_timeout_s=30)
        pool = FetchPool(client, workers=1)
        try:
            out = bytearray(CHUNK)
            fut = pool.submit(Peer("owner", *srv.address), address, out, 0, CHUNK, real, cut_through=True)
            landing.land_all()
            # every byte but the held-back end reached the asker before the owner's hash failed
            wait_for(
                lambda: out[: CHUNK - HOLD_BYTES] == landing.data[: CHUNK - HOLD_BYTES], 120, "all but the end", 0.01
            )
            landing.g.failed()
            res = fut.result(120)
            assert res.outcome is Outcome.FAILED and res.cut_through  # the daemon blames nobody for it
            wait_for(lambda: srv.stats.aborted == 1, 120, "the server to count the answer it cut off", 0.01)
            assert srv.stats.cut_through == 0
        finally:
            pool.close()
            client.close()


def test_an_asker_that_does_not_accept_cut_through_is_not_sent_parts(shm, landing):
    growing = GrowingChunks()
    address = KEYS.address(digest(landing.data))
    growing.start(address, landing.g)
    landing.land_all()
    with _serve(growing, {}) as srv:
        client = TransferClient(KEYS, "cli", io_timeout_s=30)
        try:
            res = client.fetch_into(
                Peer("owner", *srv.address), address, bytearray(CHUNK), 0, CHUNK, digest(landing.data)
            )
            assert res.outcome is Outcome.NOT_HERE
        finally:
            client.close()


def test_ask_flags_round_trip_and_the_old_format_still_parses():
    a = wire.Ask("ab" * 16, 0, 10, 5, "snap", wire.ASK_CUT_THROUGH)
    assert wire.decode_ask(wire.encode_ask(a)) == a
    b = wire.Ask("ab" * 16, 0, 10, 5, "snap")
    enc = wire.encode_ask(b)
    assert wire.decode_ask(enc) == b and not wire.decode_ask(enc).cut_through
    with pytest.raises(ProtocolError):
        wire.decode_ask(enc + b"\x01\x01")
    with pytest.raises(ProtocolError):
        wire.decode_part(wire.encode_part(10, 1), 10)
    assert wire.decode_part(wire.encode_part(9, 1), 10) == (9, 1)


def test_coverage_refuses_overlaps_and_merges_neighbours():
    c = Coverage(100)
    c.add(50, 10)
    c.add(0, 10)
    c.add(10, 40)  # meets both neighbours
    with pytest.raises(ProtocolError):
        c.add(55, 1)
    with pytest.raises(ProtocolError):
        c.add(59, 2)
    c.add(60, 40)
    assert c.full


class PartLiar:
    """A peer that knows the secret and answers every ask with the PART frames ``parts(n)``
    gives (``(offset, length)``; random bytes), then leaves the connection open."""

    def __init__(self, parts) -> None:
        self.parts = parts
        self.ls = socket.create_server(("127.0.0.1", 0))
        self.addr = self.ls.getsockname()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                sock, _ = self.ls.accept()
            except OSError:
                return
            try:
                session, ask = accept_ask(sock, "liar")
                for off, n in self.parts(ask.length):
                    sock.sendall(session.seal(wire.FrameType.PART, wire.encode_part(off, n)) + os.urandom(n))
                sock.recv(1)  # hold it open until the client closes it
            except (OSError, ConnectionError):
                pass
            finally:
                sock.close()

    def close(self) -> None:
        self.ls.close()


@pytest.mark.parametrize("case", ["overlap", "outside", "not accepted"])
def test_lying_parts_are_a_failure(case):
    parts = {
        "overlap": lambda n: [(0, n // 2), (n // 2 - 1, n // 2 + 1)],
        "outside": lambda n: [(0, n - 1), (n - 1, 2)],
        "not accepted": lambda n: [(0, n)],
    }[case]
    liar = PartLiar(parts)
    client = TransferClient(KEYS, "cli", io_timeout_s=30)
    try:
        res = client.fetch_into(
            Peer("liar", *liar.addr),
            "ab" * 16,
            bytearray(CHUNK),
            0,
            CHUNK,
            "cd" * 16,
            cut_through=case != "not accepted",
        )
        assert res.outcome is Outcome.FAILED, res
    finally:
        client.close()
        liar.close()


def test_random_parts_that_cover_the_range_but_lie_are_corrupt():
    """Parts that cover the range exactly but hold other bytes: the whole-range hash catches it."""
    liar = PartLiar(lambda n: [(n // 2, n - n // 2), (0, n // 2)])
    client = TransferClient(KEYS, "cli", io_timeout_s=30)
    try:
        res = client.fetch_into(
            Peer("liar", *liar.addr), "ab" * 16, bytearray(CHUNK), 0, CHUNK, "cd" * 16, cut_through=True
        )
        assert res.outcome is Outcome.CORRUPT and res.cut_through
    finally:
        client.close()
        liar.close()


def test_verified_before_anyone_asked_is_served_whole(shm, landing):
    """A growing chunk verified already (indexed a moment later) still answers in full."""
    growing = GrowingChunks()
    address = KEYS.address(digest(landing.data))
    growing.start(address, landing.g)
    landing.land_all()
    landing.g.verified()
    with _serve(growing, {}) as srv:
        client = TransferClient(KEYS, "cli", io_timeout_s=30)
        out = bytearray(CHUNK)
        try:
            res = client.fetch_into(
                Peer("owner", *srv.address), address, out, 0, CHUNK, digest(landing.data), cut_through=True
            )
            assert res.ok and bytes(out) == landing.data
        finally:
            client.close()


def test_not_here_when_neither_growing_nor_held(shm):
    with TransferServer(KEYS, "owner", lambda a: None, admit=lambda p, a: NOT_HERE) as srv:
        client = TransferClient(KEYS, "cli", io_timeout_s=30)
        try:
            res = client.fetch_into(
                Peer("owner", *srv.address), "ab" * 16, bytearray(16), 0, 16, "cd" * 16, cut_through=True
            )
            assert res.outcome is Outcome.NOT_HERE
        finally:
            client.close()


def test_a_stream_that_cannot_be_opened_is_a_failure_not_a_stall():
    """A peer whose handshake does not come within the connect timeout: FAILED with "connect:"
    (a plain failure), which the daemon does not penalise as a stalled answer."""
    from bdn.daemon.fetch.wire_source import stalled

    ls = socket.create_server(("127.0.0.1", 0))  # accepts, never says hello
    client = TransferClient(KEYS, "cli", connect_timeout_s=0.5, io_timeout_s=30)
    try:
        res = client.fetch_into(Peer("mute", *ls.getsockname()), "ab" * 16, bytearray(16), 0, 16, "cd" * 16)
        assert res.outcome is Outcome.FAILED and ": connect: " in res.error and "TimeoutError" in res.error, res
        assert not stalled(res)
    finally:
        client.close()
        ls.close()


def test_with_a_file_whole_answers_are_written_and_cut_through_ones_land_in_the_mapping(shm, landing):
    """``fetch_into(..., fd=)`` (how the daemon receives a whole answer): a DATA answer is
    pwritten to the file through the stream's buffer, a cut-through answer lands in the mapped
    buffer; both are verified, and both end up in the same file."""
    growing = GrowingChunks()
    address = KEYS.address(digest(landing.data))
    other = os.urandom(CHUNK)
    whole = shm / "whole"
    whole.write_bytes(other)
    index = {KEYS.address(digest(other)): (str(whole), 0, CHUNK)}
    growing.start(address, landing.g)
    out = shm / "out"
    fd = os.open(out, os.O_RDWR | os.O_CREAT, 0o600)
    os.posix_fallocate(fd, 0, 2 * CHUNK)
    m = mmap.mmap(fd, 2 * CHUNK)
    with _serve(growing, index) as srv:
        client = TransferClient(KEYS, "cli", io_timeout_s=30)
        peer = Peer("owner", *srv.address)
        try:
            landing.land_all()
            landing.g.verified()
            r1 = client.fetch_into(peer, address, m, 0, CHUNK, digest(landing.data), cut_through=True, fd=fd)
            assert r1.ok and r1.cut_through
            r2 = client.fetch_into(
                peer, KEYS.address(digest(other)), m, CHUNK, CHUNK, digest(other), cut_through=True, fd=fd
            )
            assert r2.ok and not r2.cut_through
            bad = client.fetch_into(peer, KEYS.address(digest(other)), m, CHUNK, CHUNK, "0" * 32, fd=fd)
            assert bad.outcome is Outcome.CORRUPT
        finally:
            client.close()
            m.close()
            os.close(fd)
    assert out.read_bytes() == landing.data + other
