"""Relays (bdn.transfer.growing, ``TransferClient.fetch_into(..., relay=)``) on real sockets: a
node receiving a chunk cut-through from its owner passes the bytes on, cut-through, to a third
node while they still arrive; that node completes only once the relay verified the chunk, which
needs the owner's verification first; an owner's copy that fails cuts the whole chain off
(FAILED at every link, never CORRUPT). Plus the pure parts: the relay's landed ranges and what
``send_growing`` sends of them."""

from __future__ import annotations

import mmap
import os
import threading

from bdn.proto.chunks import digest
from bdn.transfer import GRANTED, FetchPool, Outcome, Peer, TransferClient, TransferServer
from bdn.transfer.growing import (
    FAILED,
    HOLD_BYTES,
    MIN_PIECE,
    VERIFIED,
    Growing,
    GrowingChunks,
    _unsent,
)
from support.transfer import KEYS
from test_transfer_cut_through import _eventually

CHUNK = 1 << 20
PARTS = [(0, 256 << 10), (256 << 10, 256 << 10), (512 << 10, 256 << 10), (768 << 10, 256 << 10)]


class Node:
    """A transfer server answering from its own ``GrowingChunks``, and a client."""

    def __init__(self, name: str) -> None:
        self.growing = GrowingChunks()
        self.asks: list = []

        def admit(peer, ask):
            self.asks.append(ask)
            return GRANTED

        self.server = TransferServer(KEYS, name, self.growing.get, admit=admit)
        self.server.start()
        self.peer = Peer(name, *self.server.address)
        self.client = TransferClient(KEYS, name + "-cli", io_timeout_s=30)
        self.pool = FetchPool(self.client, workers=2)

    def close(self) -> None:
        self.pool.close()
        self.client.close()
        self.server.close()


class Chain:
    """Owner A landing ``data`` part by part (``land``); relay B fetching it from A into a tmpfs
    file with a relay hook (``start``: B's future once B registered its copy); end node C."""

    def __init__(self, shm, data: bytes) -> None:
        self.data = data
        self.a, self.b, self.c = Node("owner"), Node("relay"), Node("end")
        path_a, self.path_b = shm / "a", shm / "b"
        path_a.write_bytes(b"\0" * CHUNK)
        self.path_b.write_bytes(b"\0" * CHUNK)
        self.fd_a = os.open(path_a, os.O_RDWR)
        self.fd_b = os.open(self.path_b, os.O_RDWR)
        self.mm_b = mmap.mmap(self.fd_b, CHUNK)
        self.g_a = Growing(str(path_a), 0, PARTS)
        self.address = KEYS.address(digest(data))
        self.a.growing.start(self.address, self.g_a)
        self.relays: list[Growing] = []

    def _relay(self) -> Growing:
        g = Growing.relay(str(self.path_b), 0, CHUNK)
        self.relays.append(g)
        self.b.growing.start(self.address, g)
        return g

    def land(self, part: int, upto: int) -> None:
        off, _ = PARTS[part]
        os.pwrite(self.fd_a, self.data[off : off + upto], off)
        self.g_a.landed(part, upto)

    def start(self, part: int, upto: int):
        """B asks A; ``upto`` bytes of ``part`` land; returns B's future once B relays."""
        fut = self.b.pool.submit(self.a.peer, self.address, self.mm_b, 0, CHUNK, digest(self.data),
                                 cut_through=True, relay=self._relay)
        self.land(part, upto)
        _eventually(lambda: bool(self.relays), "the relay to register its copy")
        return fut

    def ask_relay(self, out, length: int = CHUNK, chunk_offset: int = 0, digest_: str | None = None):
        """C asks B for ``length`` bytes at ``chunk_offset`` into ``out``, cut-through."""
        return self.c.pool.submit(self.b.peer, self.address, out, 0, length, digest_ or digest(self.data),
                                  cut_through=True, chunk_offset=chunk_offset)

    def close(self) -> None:
        for n in (self.a, self.b, self.c):
            n.close()
        self.mm_b.close()
        os.close(self.fd_a)
        os.close(self.fd_b)


def test_a_relay_passes_the_bytes_on_while_they_arrive(shm):
    data = os.urandom(CHUNK)
    ch = Chain(shm, data)
    try:
        fut_b = ch.start(1, 256 << 10)
        out_c = bytearray(CHUNK)
        fut_c = ch.ask_relay(out_c)
        # C gets the owner's landed bytes through B before the owner has the rest
        _eventually(lambda: out_c[256 << 10 : 512 << 10] == data[256 << 10 : 512 << 10], "part 1 at the end node")
        for i in range(4):
            ch.land(i, PARTS[i][1])
        _eventually(lambda: out_c[: CHUNK - HOLD_BYTES] == data[: CHUNK - HOLD_BYTES], "all but the held end at C")
        # nobody verified yet: neither B nor C can complete
        assert not fut_b.done() and not fut_c.done()
        assert ch.relays[0].state == "growing"
        ch.g_a.verified()
        res_b, res_c = fut_b.result(120), fut_c.result(120)
        assert res_b.ok and res_b.cut_through, res_b
        assert res_c.ok and res_c.cut_through, res_c
        assert bytes(out_c) == data and ch.mm_b[:] == data
        assert ch.relays[0].state == VERIFIED
        _eventually(lambda: ch.b.server.stats.cut_through == 1, "the relay to count its cut-through answer")
    finally:
        ch.close()


def test_an_owner_copy_that_fails_cuts_the_whole_chain_off(shm):
    data = os.urandom(CHUNK)
    ch = Chain(shm, data)
    try:
        fut_b = ch.start(0, 256 << 10)
        out_c = bytearray(CHUNK)
        fut_c = ch.ask_relay(out_c)
        _eventually(lambda: out_c[: 256 << 10] == data[: 256 << 10], "the landed part at the end node")
        ch.g_a.failed()  # the owner's bucket bytes did not match: its answers are cut off
        res_b, res_c = fut_b.result(120), fut_c.result(120)
        assert res_b.outcome is Outcome.FAILED and res_b.cut_through, res_b
        assert res_c.outcome is Outcome.FAILED and res_c.cut_through, res_c  # blamed on nobody
        assert ch.relays[0].state == FAILED
    finally:
        ch.close()


def test_a_copy_that_fails_before_its_answer_began_is_a_busy_answer(shm):
    """Nothing of the chunk was sent to the asker yet when the relay's (or owner's) copy failed:
    the asker gets BUSY on a stream that stays usable, not a closed connection it would count
    against an honest node."""
    ch = Chain(shm, os.urandom(CHUNK))
    try:
        fut_b = ch.start(0, MIN_PIECE)
        _eventually(lambda: ch.relays[0].wait(-1, 0)[2] == [(0, MIN_PIECE)], "the first piece at the relay")
        # C asks for bytes beyond what landed (nothing to send yet), then the owner's copy fails
        fut_c = ch.ask_relay(bytearray(CHUNK - MIN_PIECE), CHUNK - MIN_PIECE, MIN_PIECE, "cd" * 16)
        _eventually(lambda: len(ch.b.asks) == 1, "the end node's request at the relay")
        ch.g_a.failed()
        assert fut_b.result(120).outcome is Outcome.FAILED
        res_c = fut_c.result(120)
        assert res_c.outcome is Outcome.BUSY, res_c
        assert ch.c.client.streams_open(ch.b.peer) == 1  # kept: the stream is still good
    finally:
        ch.close()


def test_bytes_that_do_not_match_at_the_relay_end_its_copy():
    """A relay that received bytes not matching the digest (a lying owner) fails its own copy:
    what it passed on is cut off, never completed."""
    g = Growing.relay("/nonexistent", 0, 100)
    g.arrived(0, 60)
    g.failed()
    assert g.wait(-1, 0)[1] == FAILED
    g.arrived(60, 40)  # after the end: ignored
    assert g.wait(-1, 0)[2] == [(0, 60)]


def test_relay_ranges_merge_in_any_order():
    g = Growing.relay("/x", 0, 1000)
    g.arrived(500, 100)
    g.arrived(0, 100)
    g.arrived(700, 100)
    assert g.wait(-1, 0)[2] == [(0, 100), (500, 600), (700, 800)]
    g.arrived(600, 100)
    g.arrived(100, 400)
    assert g.wait(-1, 0)[2] == [(0, 800)]
    assert g.relayed and not Growing("/x", 0, [(0, 10)]).relayed


def test_owner_ranges_are_the_landed_prefixes_of_its_parts():
    g = Growing("/x", 0, [(0, 100), (100, 100), (200, 100)])
    g.landed(0, 100)
    g.landed(1, 30)
    g.landed(2, 50)
    assert g.wait(-1, 0)[2] == [(0, 130), (200, 250)]


def test_unsent_is_landed_minus_sent_inside_the_window():
    sent = [[0, 50], [120, 130]]
    assert _unsent([(0, 200)], sent, 0, 150) == [(50, 120), (130, 150)]
    assert _unsent([(0, 40), (60, 200)], sent, 10, 300) == [(60, 120), (130, 200)]
    assert _unsent([(0, 50)], sent, 0, 300) == []


def test_send_growing_holds_small_pieces_unless_they_close_a_gap(shm):
    """What an asker of a relay gets: pieces of at least MIN_PIECE while the chunk grows, a small
    piece that joins two sent ranges at once, and the held end only once verified."""
    import socket

    from bdn.proto import wire
    from bdn.transfer.growing import send_growing

    n = 4 * MIN_PIECE + HOLD_BYTES
    path = shm / "r"
    data = os.urandom(n)
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    g = Growing.relay(str(path), 0, n)
    s1, s2 = socket.socketpair()
    frames: list[tuple[int, int]] = []
    seal = lambda ftype, payload: payload  # noqa: E731 - the frames' bytes are read back raw below

    def run() -> None:
        send_growing(s1, seal, fd, g, 0, n)
        s1.close()

    t = threading.Thread(target=run)
    t.start()
    try:
        def part() -> tuple[int, int]:
            hdr = b""
            while len(hdr) < 16:
                hdr += s2.recv(16 - len(hdr))
            off, ln = wire.decode_part(hdr, n)
            got = 0
            while got < ln:
                got += len(s2.recv(ln - got))
            frames.append((off, ln))
            return off, ln

        g.arrived(MIN_PIECE, MIN_PIECE)
        assert part() == (MIN_PIECE, MIN_PIECE)
        g.arrived(0, MIN_PIECE // 2)  # small and growing: held
        g.arrived(2 * MIN_PIECE, MIN_PIECE)
        assert part() == (2 * MIN_PIECE, MIN_PIECE)
        g.arrived(MIN_PIECE // 2, MIN_PIECE // 2)  # [0, MIN_PIECE) now joins the sent range
        assert part() == (0, MIN_PIECE)
        g.arrived(3 * MIN_PIECE, n - 3 * MIN_PIECE)  # the rest, but the held end stays back
        assert part() == (3 * MIN_PIECE, n - 3 * MIN_PIECE - HOLD_BYTES)
        g.verified()
        assert part() == (n - HOLD_BYTES, HOLD_BYTES)
        t.join(30)
        assert not t.is_alive()
    finally:
        s1.close()
        s2.close()
        os.close(fd)
