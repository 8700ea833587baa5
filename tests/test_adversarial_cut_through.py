"""Trying to break cut-through forwarding (issues 9 and 12) with a sender that holds the swarm
secret and lies on the wire: overlapping or outside PARTs, floods of empty or gapped PARTs, a
PART to an ask that did not accept one, answers that mix DATA and PART. Each must fail that one
fetch (FAILED, or CORRUPT once the parts cover the range with wrong bytes), in bounded memory,
and leave the client able to fetch from an honest server right after."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from bdn.bucket import open_bucket
from bdn.proto import wire
from bdn.proto.errors import ProtocolError
from bdn.publish import publish_full
from bdn.transfer import Outcome, Peer, TransferClient, TransferServer
from bdn.transfer.coverage import MAX_INTERVALS, Coverage
from support.api import wait_for
from support.checkpoints import make_state, write_hf_dir
from support.fliprelay import FlipRelay
from support.growliar import GrowLiar
from support.relay import GateRelay
from support.swarm import SECRET, Daemon, Swarm
from support.transfer import KEYS, accept_ask, make_chunk_file

CHUNK = 1 << 20

Send = Callable[[wire.FrameType, bytes, bytes], None]


class WireLiar:
    """A transfer peer that knows the secret and answers every ask by calling
    ``script(ask, send)``; ``send(type, payload, raw)`` seals one frame and sends the raw
    bytes after it. The connection stays open until the client closes it."""

    def __init__(self, script: Callable[[wire.Ask, Send], None]) -> None:
        self.script = script
        self.ls = socket.create_server(("127.0.0.1", 0))
        self.addr = self.ls.getsockname()
        self.sent_frames = 0
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
            session, ask = accept_ask(sock, "liar")

            def send(ft: wire.FrameType, payload: bytes, raw: bytes = b"") -> None:
                sock.sendall(session.seal(ft, payload) + raw)
                self.sent_frames += 1

            self.script(ask, send)
            sock.recv(1)  # hold it open until the client closes it
        except (OSError, ConnectionError):
            pass
        finally:
            sock.close()

    def close(self) -> None:
        self.ls.close()


def _part(send: Send, off: int, n: int) -> None:
    send(wire.FrameType.PART, wire.encode_part(off, n), os.urandom(n))


def _gapped(ask: wire.Ask, send: Send) -> None:
    """1-byte parts at every other byte, from the end backwards (the worst case for a sorted list)."""
    for off in range(ask.length - 2, -1, -2):
        _part(send, off, 1)


def _empty_flood(ask: wire.Ask, send: Send) -> None:
    """Half the range, then nothing but empty PARTs (keep-alives) as fast as the socket takes them."""
    _part(send, 0, ask.length // 2)
    while True:
        send(wire.FrameType.PART, wire.encode_part(0, 0))


def _data_then_part(ask: wire.Ask, send: Send) -> None:
    send(wire.FrameType.DATA, wire.encode_data(ask.length), os.urandom(ask.length // 2))
    _part(send, ask.length // 2, ask.length - ask.length // 2)


def _part_then_data(ask: wire.Ask, send: Send) -> None:
    _part(send, 0, ask.length // 2)
    send(wire.FrameType.DATA, wire.encode_data(ask.length - ask.length // 2), os.urandom(ask.length // 2))


def _part_then_not_here(ask: wire.Ask, send: Send) -> None:
    _part(send, 0, ask.length // 2)
    send(wire.FrameType.NOT_HERE, b"")


def _huge_offset(ask: wire.Ask, send: Send) -> None:
    send(wire.FrameType.PART, wire.encode_part((1 << 64) - 1, 1), b"x")


def _wraps_around(ask: wire.Ask, send: Send) -> None:
    """offset + length would wrap to a small number in 64-bit arithmetic."""
    send(wire.FrameType.PART, wire.encode_part(ask.length // 2, (1 << 64) - ask.length // 2 + 16), b"")


def _same_part_twice(ask: wire.Ask, send: Send) -> None:
    _part(send, 0, ask.length // 2)
    _part(send, 0, ask.length // 2)


def _covers_then_more(ask: wire.Ask, send: Send) -> None:
    """The whole range (random bytes: CORRUPT), then a PART past the end of the answer."""
    _part(send, 0, ask.length)
    _part(send, 0, 16)


def _empty_then_stall(ask: wire.Ask, send: Send) -> None:
    """A PART header announcing bytes that never come."""
    send(wire.FrameType.PART, wire.encode_part(0, ask.length), b"")


CASES = {
    "gapped 1-byte parts": (_gapped, Outcome.FAILED, "gaps open"),
    "data then part": (_data_then_part, Outcome.CORRUPT, None),  # a DATA body swallows the PART frame as bytes
    "part then data": (_part_then_data, Outcome.FAILED, "DATA frame inside"),
    "part then not here": (_part_then_not_here, Outcome.FAILED, "NOT_HERE frame inside"),
    "huge offset": (_huge_offset, Outcome.FAILED, "outside"),
    "wraps around": (_wraps_around, Outcome.FAILED, "outside"),
    "same part twice": (_same_part_twice, Outcome.FAILED, "overlaps"),
    "covers then more": (_covers_then_more, Outcome.CORRUPT, None),
}


@pytest.fixture
def honest(shm):
    cf = make_chunk_file(shm / "honest", 2 * CHUNK, CHUNK)
    with TransferServer(KEYS, "honest", cf.resolve) as srv:
        yield cf, Peer("honest", *srv.address)


def _honest_fetch_works(client: TransferClient, honest) -> None:
    cf, peer = honest
    out = bytearray(CHUNK)
    res = client.fetch_into(peer, cf.address(1), out, 0, CHUNK, cf.digests[1], cut_through=True)
    assert res.ok, res
    assert bytes(out) == cf.path.read_bytes()[CHUNK:]


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_lying_part_stream_fails_that_fetch_only(case, honest):
    script, outcome, why = CASES[case]
    liar = WireLiar(script)
    client = TransferClient(KEYS, "victim", io_timeout_s=30)
    try:
        res = client.fetch_into(
            Peer("liar", *liar.addr), "ab" * 16, bytearray(CHUNK), 0, CHUNK, "cd" * 16, cut_through=True
        )
        assert res.outcome is outcome, res
        if why is not None:
            assert why in (res.error or ""), res
        _honest_fetch_works(client, honest)
    finally:
        client.close()
        liar.close()


def test_a_flood_of_empty_parts_is_cut_off_by_the_silence_timer(honest):
    """Keep-alives only, after half the range: bounded by ``io_timeout_s`` with no new byte (a
    short one here; the default is 30 s), not by the flood."""
    liar = WireLiar(_empty_flood)
    client = TransferClient(KEYS, "victim", io_timeout_s=1.0)
    try:
        res = client.fetch_into(
            Peer("liar", *liar.addr), "ab" * 16, bytearray(CHUNK), 0, CHUNK, "cd" * 16, cut_through=True
        )
        assert res.outcome is Outcome.FAILED, res
        assert "no new byte" in (res.error or ""), res
        assert liar.sent_frames > 1, liar.sent_frames
    finally:
        client.close()
        liar.close()
    client = TransferClient(KEYS, "victim", io_timeout_s=30)
    try:
        _honest_fetch_works(client, honest)
    finally:
        client.close()


def test_a_header_announcing_bytes_that_never_come_times_out(honest):
    liar = WireLiar(_empty_then_stall)
    client = TransferClient(KEYS, "victim", io_timeout_s=1.0)
    try:
        res = client.fetch_into(
            Peer("liar", *liar.addr), "ab" * 16, bytearray(CHUNK), 0, CHUNK, "cd" * 16, cut_through=True
        )
        assert res.outcome is Outcome.FAILED, res
    finally:
        client.close()
        liar.close()


def test_coverage_keeps_at_most_max_intervals_open():
    n = 4 * MAX_INTERVALS
    c = Coverage(n)
    for off in range(0, 2 * MAX_INTERVALS, 2):  # MAX_INTERVALS disjoint 1-byte intervals
        c.add(off, 1)
    with pytest.raises(ProtocolError, match="gaps open"):
        c.add(n - 1, 1)
    c.add(1, 1)  # closing a gap is always allowed: it merges two intervals into one
    c.add(n - 1, 1)  # and makes room for a new one


def test_coverage_grows_an_interval_downwards_without_a_new_one():
    c = Coverage(MAX_INTERVALS * 4)
    for off in range(MAX_INTERVALS * 4 - 1, -1, -1):  # contiguous, backwards: one interval throughout
        c.add(off, 1)
    assert c.full


# ---- real daemons: the bucket lies, the owner dies ---------------------------------------------

IDENT = "step000001"


def _until(pred, what: str, timeout: float = 120.0) -> None:
    wait_for(pred, timeout, what)  # support.api: the shared poll-a-state helper


def _held_and_parked(relay, swarm) -> None:
    """Until a bucket answer is held half way and every daemon has a request parked at an owner."""
    _until(lambda: relay.held.is_set(), "a bucket read held half way")
    _until(lambda: all(d.status()["inflight"]["peer"] > 0 for d in swarm.daemons), "requests parked at the owners")


def _publish(tmp_path, s3_bucket):
    bucket, endpoint = s3_bucket
    ck = write_hf_dir(tmp_path / "trainer", make_state(0, scale=8), 1)
    b = open_bucket(bucket, endpoint_url=endpoint)
    try:
        m = publish_full(b, IDENT, 1, dir=ck, chunk_size=CHUNK)
    finally:
        b.close()
    return ck, m


def _same_bytes(d, ck) -> None:
    got = Path(d.get(f"/v1/snapshots/{IDENT}")["path"])
    for p in ck.iterdir():
        assert (got / p.name).read_bytes() == p.read_bytes(), (d.node_id, p.name)


def _blamed_peers(daemons) -> dict[str, dict[str, int]]:
    """Who each daemon recorded as a sender of bad bytes, other than the bucket."""
    out = {}
    for d in daemons:
        by = {k: v for k, v in d.status()["verify_failures_by_peer"].items() if k != "bucket"}
        if by:
            out[d.node_id] = by
    return out


def test_bad_bucket_bytes_under_a_cut_through_stream_are_re_read_and_blame_nobody(tmp_path, s3_bucket):
    """One ranged bucket answer has a flipped byte at 64 KiB (before the point where every answer
    is held, so the bad bytes land and go on to the parked askers). The owner's hash fails, its
    askers are cut off, it reads the chunk again: every daemon ends with the trainer's bytes,
    only the bucket is counted as a bad source, no peer is penalised."""
    ck, m = _publish(tmp_path, s3_bucket)
    u = urlsplit(s3_bucket[1])
    relay = FlipRelay((u.hostname, u.port), flips=1, at=64 << 10, after=256 << 10)
    env = {"BDN_ENDPOINT_URL": relay.url, "BDN_LOAD_STARTUP": "false", "BDN_BUCKET_CONCURRENCY": "2"}
    try:
        with Swarm(tmp_path / "nodes", 3, s3_bucket[0], extra_env=env) as swarm:
            for d in swarm.daemons:
                assert d.prefetch(IDENT)[0] == 202
            _held_and_parked(relay, swarm)
            relay.release()
            for d in swarm.daemons:
                d.wait_ready(IDENT, 120)
                _same_bytes(d, ck)
            assert relay.flipped == 1
            statuses = [d.status() for d in swarm.daemons]
            assert sum(s["verify_failures_by_peer"].get("bucket", 0) for s in statuses) == 1, statuses
            assert _blamed_peers(swarm.daemons) == {}
            logs = "".join(d.log_path.read_text(errors="replace") for d in swarm.daemons)
            assert "sent bad bytes" not in logs and "penalised" not in logs
    finally:
        relay.close()


def _wait_failed(d, timeout: float = 120.0) -> str:
    """The error of ``d``'s snapshot once it failed (AssertionError if it ends READY)."""
    _, body = wait_for(
        lambda: d.request("GET", f"/v1/snapshots/{IDENT}/wait?state=ready&timeout=10"),
        timeout,
        f"{d.node_id}: {IDENT} to fail, never READY (its bucket's bytes do not match the manifest)",
        0.1,
        until=lambda answer: answer[0] == 409,
        meanwhile=lambda answer: answer[0] != 200,
        detail=d.log,
    )
    return str(body.get("error"))


def test_an_object_replaced_under_the_manifest_fails_clearly_and_blames_nobody(tmp_path, s3_bucket):
    """Every stored object of the snapshot rewritten (same size, one byte flipped) after it was
    published: no owner can ever verify a chunk, so every copy in flight is cut off. No daemon
    may end READY; each fails naming the digest mismatch; no peer is blamed."""
    import boto3

    ck, m = _publish(tmp_path, s3_bucket)
    bucket, endpoint = s3_bucket
    name, prefix = bucket.removeprefix("s3://").split("/", 1)
    s3 = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    replaced = 0
    for f in m.files:
        key = f"{prefix}/{IDENT}/{f.path}"
        body = bytearray(s3.get_object(Bucket=name, Key=key)["Body"].read())
        if not body:
            continue
        body[len(body) // 2] ^= 0xFF
        s3.put_object(Bucket=name, Key=key, Body=bytes(body))
        replaced += 1
    assert replaced
    env = {"BDN_ENDPOINT_URL": endpoint, "BDN_LOAD_STARTUP": "false", "BDN_BUCKET_CONCURRENCY": "2"}
    with Swarm(tmp_path / "nodes", 3, bucket, extra_env=env) as swarm:
        for d in swarm.daemons:
            assert d.prefetch(IDENT)[0] == 202
        errors = [_wait_failed(d) for d in swarm.daemons]
        for e in errors:
            assert "does not match the manifest" in e, errors
        assert _blamed_peers(swarm.daemons) == {}
        logs = "".join(d.log_path.read_text(errors="replace") for d in swarm.daemons)
        assert "sent bad bytes" not in logs


def test_an_owner_killed_while_it_streams_growing_chunks_leaves_the_survivors_whole(tmp_path, s3_bucket):
    """Every bucket answer is held after 256 KiB, the askers are parked on the owners and get
    the landed parts; one owner is killed -9 mid-stream, then the bucket goes on. The survivors
    end with the trainer's bytes (the dead owner's chunks from someone else or the bucket)."""
    ck, m = _publish(tmp_path, s3_bucket)
    u = urlsplit(s3_bucket[1])
    relay = GateRelay((u.hostname, u.port), after=256 << 10)
    env = {"BDN_ENDPOINT_URL": relay.url, "BDN_LOAD_STARTUP": "false", "BDN_BUCKET_CONCURRENCY": "2"}
    try:
        with Swarm(tmp_path / "nodes", 3, s3_bucket[0], extra_env=env) as swarm:
            for d in swarm.daemons:
                assert d.prefetch(IDENT)[0] == 202
            _held_and_parked(relay, swarm)
            victim, survivors = swarm.daemons[0], swarm.daemons[1:]
            victim.kill()
            relay.release()
            for d in survivors:
                d.wait_ready(IDENT, 120)
                _same_bytes(d, ck)
            assert _blamed_peers(survivors) == {}
            assert sum(d.status()["counters"]["chunk_verify_failures"] for d in survivors) == 0
    finally:
        relay.close()


@pytest.mark.parametrize("mode", ["not-here", "keepalive"])
def test_a_peer_announcing_every_chunk_growing_does_not_hold_up_the_victims(tmp_path, mode):
    """A secret holder announces every stored chunk growing (HAVE_GROWING) on each HAVE
    subscription and holds none; asked cut-through it says NOT_HERE, or keeps the ask alive with
    keep-alive PARTs of a chunk that never lands. What bounds the victims: a NOT_HERE costs a
    round trip; a keep-alive-only answer ends after ``peer_timeout_s`` without a new byte (3 s
    here), and the failures take the liar out of the owners and holders (membership FAIL_LIMIT);
    ``haves.MAX_GROWING`` bounds the announced chunks kept. Both victims end with the trainer's
    bytes within the deadline."""
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    ck = write_hf_dir(tmp_path / "trainer", make_state(0, scale=8), 1)
    b = open_bucket(f"file://{bucket}")
    try:
        publish_full(b, IDENT, 1, dir=ck, chunk_size=CHUNK)
    finally:
        b.close()
    liar = GrowLiar(tmp_path, f"file://{bucket}", SECRET, mode).start()
    env = {"BDN_LOAD_STARTUP": "false", "BDN_PEER_TIMEOUT_S": "3"}
    victims = [Daemon(tmp_path / "nodes", f"node{i}", f"file://{bucket}", extra_env=env) for i in range(2)]
    peers = [v.peer_url for v in victims] + [liar.url]
    try:
        for v in victims:
            v.start(peers)
        for v in victims:
            v.wait_healthy()
        _until(
            lambda: all(any(p["node_id"] == "growliar" and p["alive"] for p in v.status()["peers"]) for v in victims),
            "the liar a live member of both victims",
        )
        for v in victims:
            assert v.prefetch(IDENT)[0] == 202
        for v in victims:
            v.wait_ready(IDENT, 120)
            _same_bytes(v, ck)
        assert _blamed_peers(victims) == {}
        log = liar.log()
        assert "announced" in log and "asked" in log, log  # the attack reached the victims
    finally:
        for v in victims:
            v.stop()
        liar.stop()
