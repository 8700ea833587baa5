"""bdn.proto.wire (pure): frames, the handshake's refusals, session tags, request/answer payloads."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bdn.proto import handshake, wire
from bdn.proto.errors import AuthError, ProtocolError
from bdn.proto.keys import MAX_SKEW_S, SwarmKeys, derive_keys

KEYS = derive_keys("3f1c0e9a8b7d6c5e4f3a2b1c0d9e8f7a")
OTHER = derive_keys("0123456789abcdef0123456789abcdef")
NOW = 1_780_000_000.0
SN, CN = b"s" * 32, b"c" * 32


def _payload(frame: bytes) -> tuple[wire.FrameType, bytes]:
    ftype, n = wire.parse_header(frame[:5])
    assert len(frame) == 5 + n
    return ftype, frame[5:]


def _hello(
    keys: SwarmKeys = KEYS, target: str = "srv", sn: bytes = SN, now: float = NOW
) -> tuple[bytes, handshake.Session]:
    frame, session = handshake.client_hello(keys, "cli", target, sn, CN, now)
    ftype, payload = _payload(frame)
    assert ftype == wire.FrameType.CLIENT_HELLO
    return payload, session


def test_handshake_round_trip_gives_matching_sessions():
    ftype, body = _payload(handshake.server_hello(SN))
    assert ftype == wire.FrameType.SERVER_HELLO and handshake.parse_server_hello(body) == SN
    hello, cs = _hello()
    accept, ss = handshake.check_client_hello(KEYS, "srv", SN, hello, NOW + MAX_SKEW_S)
    assert ss.peer_node_id == "cli" and cs.peer_node_id == "srv"
    ftype, body = _payload(accept)
    assert ftype == wire.FrameType.ACCEPT
    handshake.check_accept(cs, body)
    assert (cs.send_key, cs.recv_key) == (ss.recv_key, ss.send_key) and cs.send_key != cs.recv_key


def _refusal(fn) -> str:
    with pytest.raises(AuthError) as e:
        fn()
    return str(e.value)


def test_every_handshake_failure_is_the_same_refusal():
    hello, _ = _hello()
    wrong_secret_same_swarm = SwarmKeys(KEYS.swarm_id, OTHER.auth_key, OTHER.address_key)
    cases = {
        "unknown swarm": lambda: handshake.check_client_hello(KEYS, "srv", SN, _hello(OTHER)[0], NOW),
        "wrong secret": lambda: handshake.check_client_hello(KEYS, "srv", SN, _hello(wrong_secret_same_swarm)[0], NOW),
        "replay (other server nonce)": lambda: handshake.check_client_hello(KEYS, "srv", b"t" * 32, hello, NOW),
        "made for another daemon": lambda: handshake.check_client_hello(KEYS, "srv2", SN, hello, NOW),
        "skew behind": lambda: handshake.check_client_hello(KEYS, "srv", SN, _hello(now=NOW - MAX_SKEW_S - 1)[0], NOW),
        "skew ahead": lambda: handshake.check_client_hello(KEYS, "srv", SN, _hello(now=NOW + MAX_SKEW_S + 1)[0], NOW),
        "truncated": lambda: handshake.check_client_hello(KEYS, "srv", SN, hello[:-1], NOW),
        "garbage": lambda: handshake.check_client_hello(KEYS, "srv", SN, os.urandom(80), NOW),
        "empty": lambda: handshake.check_client_hello(KEYS, "srv", SN, b"", NOW),
        "flipped mac bit": lambda: handshake.check_client_hello(
            KEYS, "srv", SN, hello[:-1] + bytes([hello[-1] ^ 1]), NOW
        ),
    }
    answers = {name: _refusal(fn) for name, fn in cases.items()}
    assert set(answers.values()) == {"transfer handshake refused"}, answers


def test_accept_from_a_server_without_the_secret_is_refused():
    _, cs = _hello()
    bad_server = SwarmKeys(KEYS.swarm_id, OTHER.auth_key, OTHER.address_key)
    # a server without the key cannot compute the accept MAC; any other 32 bytes fail too
    with pytest.raises(AuthError):
        handshake.check_accept(cs, handshake.handshake_key(bad_server)[:32])
    with pytest.raises(AuthError):
        handshake.check_accept(cs, b"")


def _sessions() -> tuple[handshake.Session, handshake.Session]:
    hello, cs = _hello()
    _, ss = handshake.check_client_hello(KEYS, "srv", SN, hello, NOW)
    return cs, ss


def test_session_tags_reject_replay_reorder_and_cross_connection_frames():
    cs, ss = _sessions()
    f1 = cs.seal(wire.FrameType.ASK, b"one")
    f2 = cs.seal(wire.FrameType.ASK, b"two")
    t, body = _payload(f1)
    assert bytes(ss.open(t, body)) == b"one"
    with pytest.raises(AuthError):
        ss.open(t, body)  # the same frame again: the receive sequence moved on
    t, body2 = _payload(f2)
    assert bytes(ss.open(t, body2)) == b"two"
    # a frame of another connection (fresh nonces) fails even at the same sequence number
    other_hello, _ = handshake.client_hello(KEYS, "cli", "srv", b"u" * 32, CN, NOW)
    _, other_ss = handshake.check_client_hello(KEYS, "srv", b"u" * 32, _payload(other_hello)[1], NOW)
    with pytest.raises(AuthError):
        other_ss.open(*_payload(f1))
    # the type byte is covered: an ASK cannot be passed off as a HAVE
    f3 = cs.seal(wire.FrameType.ASK, b"three")
    with pytest.raises(AuthError):
        ss.open(wire.FrameType.HAVE, _payload(f3)[1])


def test_answers_are_tagged_the_other_way():
    cs, ss = _sessions()
    frame = ss.seal(wire.FrameType.DATA, wire.encode_data(123))
    t, body = _payload(frame)
    assert wire.decode_data(cs.open(t, body)) == 123
    with pytest.raises(AuthError):
        ss.open(t, body)  # a server's own frame reflected back at it


def test_header_limits():
    assert wire.parse_header(wire.HEADER.pack(wire.MAX_FRAME, wire.FrameType.ASK)) == (
        wire.FrameType.ASK,
        wire.MAX_FRAME - 1,
    )
    for length, ftype in ((wire.MAX_FRAME + 1, 0x10), (0xFFFFFFFF, 0x10), (0, 0x10), (10, 0x7F)):
        with pytest.raises(ProtocolError):
            wire.parse_header(wire.HEADER.pack(length, ftype))


def test_ask_round_trip_and_limits():
    a = wire.Ask("00112233445566778899aabbccddeeff", 4096, 16 << 20, 5000, "step000002")
    assert wire.decode_ask(wire.encode_ask(a)) == a
    assert wire.decode_ask(wire.encode_ask(wire.Ask("ff" * 16, 0, 1))) == wire.Ask("ff" * 16, 0, 1)
    for bad in (
        wire.Ask("zz" * 16, 0, 1),
        wire.Ask("00" * 15, 0, 1),
        wire.Ask("00" * 16, 0, 0),
        wire.Ask("00" * 16, 0, wire.MAX_LENGTH + 1),
        wire.Ask("00" * 16, 0, 1, wire.MAX_WAIT_MS + 1),
    ):
        with pytest.raises(ProtocolError):
            wire.encode_ask(bad)


def test_busy_data_have_round_trip():
    assert wire.decode_busy(wire.encode_busy(0.25)) == 0.25
    assert wire.decode_busy(wire.encode_busy(1e9)) == 60.0
    assert wire.decode_data(wire.encode_data(wire.MAX_LENGTH)) == wire.MAX_LENGTH
    with pytest.raises(ProtocolError):
        wire.decode_data(wire.encode_data(wire.MAX_LENGTH + 1))
    h = wire.Have("step000002", 1, (0, 5, 2**32 - 1))
    assert wire.decode_have(wire.encode_have(h)) == h
    with pytest.raises(ProtocolError):
        wire.encode_have(wire.Have("x", 0, (2**32,)))
    with pytest.raises(ProtocolError):
        wire.encode_have(wire.Have("x", 0, tuple(range(wire.MAX_HAVE_INDICES + 1))))
    big = wire.Have("x" * 255, 0, tuple(range(wire.MAX_HAVE_INDICES)))
    _, ss = _sessions()
    assert len(ss.seal(wire.FrameType.HAVE, wire.encode_have(big))) <= wire.HEADER.size + wire.MAX_FRAME


def test_take_and_give_round_trip_and_limits():
    t = wire.Take("step000002", 2**32 - 1)
    assert wire.decode_take(wire.encode_take(t)) == t
    assert wire.decode_give(wire.encode_give(True)) is True
    assert wire.decode_give(wire.encode_give(False)) is False
    for bad in (
        wire.Take("", 0),
        wire.Take("x" * 256, 0),
        wire.Take("x", -1),
        wire.Take("x", 2**32),
        wire.Take("st\u00e9p", 0),
    ):
        with pytest.raises(ProtocolError):
            wire.encode_take(bad)
    for raw in (b"", b"\x00\x00\x00\x00\x00", b"\x01x\x00\x00\x00", b"\x01x\x00\x00\x00\x00\x00", b"\x01\xff\0\0\0\0"):
        with pytest.raises(ProtocolError):
            wire.decode_take(raw)
    for raw in (b"", b"\x02", b"\x01\x01"):
        with pytest.raises(ProtocolError):
            wire.decode_give(raw)
    # a TAKE is a client's frame and a GIVE a server's: each side refuses the other's
    assert wire.FrameType.TAKE in wire.CLIENT_FRAMES and wire.FrameType.TAKE not in wire.SERVER_FRAMES
    assert wire.FrameType.GIVE in wire.SERVER_FRAMES and wire.FrameType.GIVE not in wire.CLIENT_FRAMES


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_decoders_fail_only_with_protocol_errors(raw):
    for decode in (
        wire.decode_ask,
        wire.decode_data,
        wire.decode_busy,
        wire.decode_have,
        wire.decode_take,
        wire.decode_give,
        handshake.parse_server_hello,
    ):
        try:
            decode(raw)
        except ProtocolError:
            pass
    with pytest.raises(AuthError):
        handshake.check_client_hello(KEYS, "srv", SN, raw, NOW)
