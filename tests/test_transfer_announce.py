"""HAVE subscriptions on the transfer wire (bdn/transfer/announce.py) over real loopback sockets:
the bitfield once, then HAVEs as chunks are announced, the end of a subscription seen by both
sides, a malformed subscription refused, and an unauthenticated client learning nothing."""

from __future__ import annotations

import threading

from bdn.proto import wire
from bdn.proto.keys import derive_keys
from bdn.transfer import Peer, TransferClient, TransferServer
from bdn.transfer.announce import HaveFeed, HaveSubscriber, frames
from support.api import wait_for
from support.transfer import KEYS

IDENT = "step000007"


class Recorder:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.got: dict[int, set[int]] = {0: set(), 1: set()}
        self.synced = threading.Event()
        self.ended: list[str] = []

    def on_have(self, node: str, identity: str, layer: int, indices: tuple[int, ...]) -> None:
        assert node == "srv" and identity == IDENT
        with self.lock:
            self.got[layer].update(indices)
        if not indices:
            self.synced.set()

    def on_end(self, node: str, identity: str, error: str) -> None:
        self.ended.append(error)


def _nothing(_address: str):
    return None


def test_bitfield_then_haves_then_end():
    held = {0: list(range(0, 20000, 2)), 1: [3]}  # more than one frame's worth of indices
    feed = HaveFeed(lambda ident: held if ident == IDENT else None, keepalive_s=0.2)
    rec = Recorder()
    with TransferServer(KEYS, "srv", _nothing, on_have=feed.serve) as srv:
        client = TransferClient(KEYS, "cli")
        sub = HaveSubscriber(client, rec.on_have, rec.on_end, keepalive_s=0.2)
        peer = Peer("srv", *srv.address)
        try:
            assert sub.subscribe(peer, IDENT) and not sub.subscribe(peer, IDENT)
            assert rec.synced.wait(120)
            assert rec.got[0] == set(held[0]) and rec.got[1] == {3}
            wait_for(lambda: feed.subscribers == 1, 120, "subscribed", 0.01)
            feed.announce(IDENT, 0, 20001)
            feed.announce(IDENT, 1, 4)
            feed.announce("step000008", 0, 5)  # nobody subscribed to it: dropped
            wait_for(lambda: 20001 in rec.got[0] and 4 in rec.got[1], 120, "announced", 0.01)
            assert 5 not in rec.got[0]
            n = sub.frames_in
            wait_for(lambda: sub.frames_in > n + 2, 120, "keep-alives", 0.01)  # an idle feed says it is alive
            sub.unsubscribe(peer, IDENT)
            wait_for(lambda: rec.ended and feed.subscribers == 0, 120, "ended on both sides", 0.01)
            assert not sub.subscribed(peer, IDENT)
        finally:
            sub.close()
            client.close()
            feed.close()


def test_server_closing_ends_the_subscription():
    feed = HaveFeed(lambda ident: {}, keepalive_s=0.2)
    rec = Recorder()
    srv = TransferServer(KEYS, "srv", _nothing, on_have=feed.serve)
    srv.start()
    client = TransferClient(KEYS, "cli")
    sub = HaveSubscriber(client, rec.on_have, rec.on_end, keepalive_s=0.2)
    try:
        sub.subscribe(Peer("srv", *srv.address), IDENT)
        assert rec.synced.wait(120)
        feed.close()
        srv.close()
        wait_for(lambda: rec.ended, 120, "the subscription ended", 0.01)
        assert sub.count() == 0
    finally:
        sub.close()
        client.close()


def test_malformed_subscription_closes_only_that_connection():
    feed = HaveFeed(lambda ident: {0: [1]}, keepalive_s=0.2)
    rec = Recorder()
    with TransferServer(KEYS, "srv", _nothing, on_have=feed.serve) as srv:
        client = TransferClient(KEYS, "cli")
        peer = Peer("srv", *srv.address)
        try:
            stream = client.connect(peer)
            # an identity with a path in it: refused, the connection closed, nothing announced
            bad = b"".join([bytes([9]), b"../../etc", wire._HAVE_FIXED.pack(0, 0)])
            stream.sock.sendall(stream.session.seal(wire.FrameType.HAVE, bad))
            stream.sock.settimeout(120)
            assert stream.sock.recv(1) == b""
            assert srv.stats.protocol_errors == 1 and feed.subscribers == 0
            # the server serves on: a good subscription still works
            sub = HaveSubscriber(client, rec.on_have, rec.on_end, keepalive_s=0.2)
            sub.subscribe(peer, IDENT)
            assert rec.synced.wait(120) and rec.got[0] == {1}
            sub.close()
        finally:
            client.close()
            feed.close()


def test_without_the_secret_no_have_is_learned():
    feed = HaveFeed(lambda ident: {0: [1, 2, 3]})
    rec = Recorder()
    with TransferServer(KEYS, "srv", _nothing, on_have=feed.serve) as srv:
        other = TransferClient(derive_keys(b"another partition secret, 32 bytes!"), "cli")
        sub = HaveSubscriber(other, rec.on_have, rec.on_end)
        try:
            sub.subscribe(Peer("srv", *srv.address), IDENT)
            wait_for(lambda: rec.ended, 120, "refused", 0.01)
            assert "handshake" in rec.ended[0]
            assert rec.got == {0: set(), 1: set()} and not rec.synced.is_set()
            assert srv.stats.handshakes_refused == 1 and feed.subscribers == 0 and feed.frames_out == 0
        finally:
            sub.close()
            other.close()


def test_frames_split_at_the_frame_limit():
    ps = frames(IDENT, 0, range(wire.MAX_HAVE_INDICES + 5))
    assert len(ps) == 2
    assert [len(wire.decode_have(p).indices) for p in ps] == [wire.MAX_HAVE_INDICES, 5]
    assert frames(IDENT, 1, []) == []
