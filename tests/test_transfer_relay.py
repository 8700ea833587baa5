"""Relays (bdn.transfer.growing, ``TransferClient.fetch_into(..., relay=)``) on real sockets: a
node receiving a chunk cut-through from its owner passes the bytes on, cut-through, to a third
node while they still arrive; that node completes only once the relay verified the chunk, which
needs the owner's verification first; an owner's copy that fails cuts the whole chain off
(FAILED at every link, never CORRUPT). Plus the pure parts: the relay's landed ranges and what
``send_growing`` sends of them."""

from __future__ import annotations

import os
import threading

from support.transfer import KEYS
from test_transfer_cut_through import _eventually

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


def _chain(shm, data: bytes):
    """Owner A landing ``data`` part by part; relay B and end C each with a tmpfs file."""
    a, b, c = Node("owner"), Node("relay"), Node("end")
    path_a = shm / "a"
    path_a.write_bytes(b"\0" * CHUNK)
    fd_a = os.open(path_a, os.O_RDWR)
    g_a = Growing(str(path_a), 0, PARTS)
    address = KEYS.address(digest(data))
    a.growing.start(address, g_a)
    path_b = shm / "b"
    path_b.write_bytes(b"\0" * CHUNK)
    fd_b = os.open(path_b, os.O_RDWR)
    import mmap

    mm_b = mmap.mmap(fd_b, CHUNK)
    relays: list[Growing] = []

    def relay() -> Growing:
        g = Growing.relay(str(path_b), 0, CHUNK)
        relays.append(g)
        b.growing.start(address, g)
        return g

    def land(part: int, upto: int) -> None:
        off, _ = PARTS[part]
        os.pwrite(fd_a, data[off : off + upto], off)
        g_a.landed(part, upto)

    def close() -> None:
        for n in (a, b, c):
            n.close()
        mm_b.close()
        os.close(fd_a)
        os.close(fd_b)

    return a, b, c, g_a, address, mm_b, relay, relays, land, close


def test_a_relay_passes_the_bytes_on_while_they_arrive(shm):
    data = os.urandom(CHUNK)
    a, b, c, g_a, address, mm_b, relay, relays, land, close = _chain(shm, data)
    try:
        fut_b = b.pool.submit(a.peer, address, mm_b, 0, CHUNK, digest(data), cut_through=True, relay=relay)
        land(1, 256 << 10)
        _eventually(lambda: bool(relays), "the relay to register its copy")
        out_c = bytearray(CHUNK)
        fut_c = c.pool.submit(b.peer, address, out_c, 0, CHUNK, digest(data), cut_through=True)
        # C gets the owner's landed bytes through B before the owner has the rest
        _eventually(lambda: out_c[256 << 10 : 512 << 10] == data[256 << 10 : 512 << 10], "part 1 at the end node")
        for i in range(4):
            land(i, PARTS[i][1])
        _eventually(lambda: out_c[: CHUNK - HOLD_BYTES] == data[: CHUNK - HOLD_BYTES], "all but the held end at C")
        # nobody verified yet: neither B nor C can complete
        assert not fut_b.done() and not fut_c.done()
        assert relays[0].state == "growing"
        g_a.verified()
        res_b, res_c = fut_b.result(120), fut_c.result(120)
        assert res_b.ok and res_b.cut_through, res_b
        assert res_c.ok and res_c.cut_through, res_c
        assert bytes(out_c) == data and mm_b[:] == data
        assert relays[0].state == VERIFIED
        _eventually(lambda: b.server.stats.cut_through == 1, "the relay to count its cut-through answer")
    finally:
        close()


def test_an_owner_copy_that_fails_cuts_the_whole_chain_off(shm):
    data = os.urandom(CHUNK)
    a, b, c, g_a, address, mm_b, relay, relays, land, close = _chain(shm, data)
    try:
        fut_b = b.pool.submit(a.peer, address, mm_b, 0, CHUNK, digest(data), cut_through=True, relay=relay)
        land(0, 256 << 10)
        _eventually(lambda: bool(relays), "the relay to register its copy")
        out_c = bytearray(CHUNK)
        fut_c = c.pool.submit(b.peer, address, out_c, 0, CHUNK, digest(data), cut_through=True)
        _eventually(lambda: out_c[: 256 << 10] == data[: 256 << 10], "the landed part at the end node")
        g_a.failed()  # the owner's bucket bytes did not match: its answers are cut off
        res_b, res_c = fut_b.result(120), fut_c.result(120)
        assert res_b.outcome is Outcome.FAILED and res_b.cut_through, res_b
        assert res_c.outcome is Outcome.FAILED and res_c.cut_through, res_c  # blamed on nobody
        assert relays[0].state == FAILED
    finally:
        close()


def test_a_copy_that_fails_before_its_answer_began_is_a_busy_answer(shm):
    """Nothing of the chunk was sent to the asker yet when the relay's (or owner's) copy failed:
    the asker gets BUSY on a stream that stays usable, not a closed connection it would count
    against an honest node."""
    data = os.urandom(CHUNK)
    a, b, c, g_a, address, mm_b, relay, relays, land, close = _chain(shm, data)
    try:
        fut_b = b.pool.submit(a.peer, address, mm_b, 0, CHUNK, digest(data), cut_through=True, relay=relay)
        land(0, MIN_PIECE)
        _eventually(lambda: bool(relays), "the relay to register its copy")
        _eventually(lambda: relays[0].wait(-1, 0)[2] == [(0, MIN_PIECE)], "the first piece at the relay")
        # C asks for bytes beyond what landed (nothing to send yet), then the owner's copy fails
        fut_c = c.pool.submit(b.peer, address, bytearray(CHUNK - MIN_PIECE), 0, CHUNK - MIN_PIECE, "cd" * 16,
                              cut_through=True, chunk_offset=MIN_PIECE)
        _eventually(lambda: len(b.asks) == 1, "the end node's request at the relay")
        g_a.failed()
        assert fut_b.result(120).outcome is Outcome.FAILED
        res_c = fut_c.result(120)
        assert res_c.outcome is Outcome.BUSY, res_c
        assert c.client.streams_open(b.peer) == 1  # kept: the stream is still good
    finally:
        close()



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

    from bdn.transfer.growing import send_growing
    from bdn.proto import wire

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
