"""The transfer wire's handshake and session tags (pure, no I/O).

Source: DESIGN.md ("The transfer wire"). Keys come from the partition secret
(bdn.proto.keys); HMAC-SHA256 is RFC 2104, HKDF-SHA256 RFC 5869. The record layout (implicit
per-direction sequence numbers in every tag, so no nonce has to travel or be remembered) follows
TLS 1.3 (RFC 8446, 5.3) and SSH (RFC 4253, 6.4). Frames themselves (header, types, request and
answer codecs) are bdn.proto.wire; this module builds on it, never the other way round.

Handshake (one per connection; a connection then carries any number of requests):

1. server -> client ``SERVER_HELLO``: ``magic "BDNT" | version u8 | server_nonce[32]``. Sent to
   anyone who connects, before anything is known about them; it says nothing about the swarm.
2. client -> server ``CLIENT_HELLO``: ``magic | version | swarm_id[8] | ts u64 (unix s) |
   client_nonce[32] | node_len u8 | node id (ascii, NODE_ID_RE) | mac[32]`` with
   ``mac = HMAC(hs_key, "bdn-transfer-1 hello" | swarm_id | ts | server_nonce | client_nonce |
   len-prefixed client node id | len-prefixed *target* node id)``. The target's node id and the
   server's fresh nonce are in the MAC: a captured hello is refused by the same server (new
   nonce) and by any other daemon of the swarm (other node id), with no nonce cache.
3. server -> client ``ACCEPT``: ``mac_s[32] = HMAC(hs_key, "bdn-transfer-1 accept" | mac)``:
   the client learns the server holds the key too. On any failure (unknown swarm, wrong secret,
   replay, clock skew over ``MAX_SKEW_S``, malformed hello) the server sends nothing and closes
   the connection: the same answer whatever was wrong and whatever was asked for.

Session: ``HKDF-SHA256(hs_key, salt=server_nonce|client_nonce, info="bdn transfer session" |
mac)`` gives 64 bytes, the client-to-server and server-to-client tag keys. Every later frame ends
in ``tag[16] = HMAC(direction key, seq u64 | u32 length | u8 type | payload)[:16]`` where ``seq``
counts that direction's frames from 0 and is never sent: a replayed, reordered, dropped or
cross-connection frame fails its tag.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass

from bdn.proto.errors import AuthError, ProtocolError
from bdn.proto.keys import MAX_SKEW_S, NODE_ID_RE, SwarmKeys, hkdf_sha256
from bdn.proto.wire import HEADER, MAGIC, TAG_BYTES, VERSION, FrameType, frame

NONCE_BYTES = 32
MAC_BYTES = 32

_SEQ = struct.Struct("!Q")
_SERVER_HELLO = struct.Struct(f"!4sB{NONCE_BYTES}s")
_CLIENT_HELLO_FIXED = struct.Struct(f"!4sB8sQ{NONCE_BYTES}sB")


def handshake_key(keys: SwarmKeys) -> bytes:
    """The 32-byte key of the transfer handshake, derived from the swarm's ``auth_key`` (HKDF,
    its own label, so a transfer MAC can never stand for a BDN-HMAC request signature)."""
    return hkdf_sha256(keys.auth_key, b"bdn/transfer/v1", b"bdn transfer handshake", 32)


def server_hello(server_nonce: bytes) -> bytes:
    """The SERVER_HELLO frame carrying a fresh 32-byte ``server_nonce`` (from the caller's CSPRNG)."""
    if len(server_nonce) != NONCE_BYTES:
        raise ValueError(f"server nonce must be {NONCE_BYTES} bytes")
    return frame(FrameType.SERVER_HELLO, _SERVER_HELLO.pack(MAGIC, VERSION, server_nonce))


def parse_server_hello(payload: bytes | bytearray | memoryview) -> bytes:
    """The server nonce of a SERVER_HELLO payload.

    Raises:
        ProtocolError: wrong size, magic or version (not a bdn transfer port of this version).
    """
    if len(payload) != _SERVER_HELLO.size:
        raise ProtocolError("not a bdn transfer server (hello of the wrong size)")
    magic, version, nonce = _SERVER_HELLO.unpack(payload)
    if magic != MAGIC or version != VERSION:
        raise ProtocolError("not a bdn transfer server of version 1")
    return bytes(nonce)


def _lp(s: str) -> bytes:
    raw = s.encode("ascii")
    return bytes([len(raw)]) + raw


def _hello_mac(
    hs_key: bytes, swarm: bytes, ts: int, server_nonce: bytes, client_nonce: bytes, client: str, target: str
) -> bytes:
    msg = b"".join(
        (
            b"bdn-transfer-1 hello",
            swarm,
            _SEQ.pack(ts),
            server_nonce,
            client_nonce,
            _lp(client),
            _lp(target),
        )
    )
    return hmac.digest(hs_key, msg, hashlib.sha256)


@dataclass
class Session:
    """One authenticated connection's tag keys and sequence numbers (one per direction).

    ``seal`` and ``open`` are for the side given by ``is_client``. Not thread-safe: one
    connection is used by one thread at a time.
    """

    is_client: bool
    send_key: bytes
    recv_key: bytes
    peer_node_id: str
    accept_mac: bytes
    send_seq: int = 0
    recv_seq: int = 0

    def seal(self, ftype: FrameType, payload: bytes) -> bytes:
        """The complete frame ``ftype`` carrying ``payload``, tagged with the next send sequence."""
        frame = HEADER.pack(len(payload) + 1 + TAG_BYTES, ftype) + payload
        tag = hmac.digest(self.send_key, _SEQ.pack(self.send_seq) + frame, hashlib.sha256)[:TAG_BYTES]
        self.send_seq += 1
        return frame + tag

    def open(self, ftype: FrameType, body: bytes | bytearray | memoryview) -> memoryview:
        """Check the tag of a received frame (``body`` = payload + tag, as framed); the payload.

        Raises:
            AuthError: the tag does not match (forged, replayed, reordered or truncated frame).
        """
        n = len(body)
        if n < TAG_BYTES:
            raise AuthError("frame without tag")
        view = memoryview(body)
        header = HEADER.pack(n + 1, ftype)
        h = hmac.new(self.recv_key, _SEQ.pack(self.recv_seq) + header, hashlib.sha256)
        h.update(view[: n - TAG_BYTES])
        if not hmac.compare_digest(h.digest()[:TAG_BYTES], view[n - TAG_BYTES :]):
            raise AuthError("bad frame tag")
        self.recv_seq += 1
        return view[: n - TAG_BYTES]


def _session(
    hs_key: bytes, server_nonce: bytes, client_nonce: bytes, mac: bytes, *, is_client: bool, peer: str
) -> Session:
    okm = hkdf_sha256(hs_key, server_nonce + client_nonce, b"bdn transfer session" + mac, 64)
    c2s, s2c = okm[:32], okm[32:]
    accept = hmac.digest(hs_key, b"bdn-transfer-1 accept" + mac, hashlib.sha256)
    if is_client:
        return Session(True, c2s, s2c, peer, accept)
    return Session(False, s2c, c2s, peer, accept)


def client_hello(
    keys: SwarmKeys, node_id: str, target_node_id: str, server_nonce: bytes, client_nonce: bytes, now: float
) -> tuple[bytes, Session]:
    """The CLIENT_HELLO frame from ``node_id`` to the daemon ``target_node_id`` and the session it
    opens (valid once the server's ACCEPT checks out, see ``check_accept``).

    ``now`` is unix seconds (injected clock); ``client_nonce`` 32 bytes from a CSPRNG.

    Raises:
        ProtocolError: a node id does not match ``NODE_ID_RE``, or a nonce is not 32 bytes.
    """
    for n in (node_id, target_node_id):
        if not NODE_ID_RE.match(n):
            raise ProtocolError(f"node id {n[:80]!r} does not match {NODE_ID_RE.pattern}")
    if len(server_nonce) != NONCE_BYTES or len(client_nonce) != NONCE_BYTES:
        raise ProtocolError(f"handshake nonces must be {NONCE_BYTES} bytes")
    hs_key = handshake_key(keys)
    swarm = bytes.fromhex(keys.swarm_id)
    ts = int(now)
    mac = _hello_mac(hs_key, swarm, ts, server_nonce, client_nonce, node_id, target_node_id)
    payload = _CLIENT_HELLO_FIXED.pack(MAGIC, VERSION, swarm, ts, client_nonce, len(node_id)) + node_id.encode() + mac
    session = _session(hs_key, server_nonce, client_nonce, mac, is_client=True, peer=target_node_id)
    return frame(FrameType.CLIENT_HELLO, payload), session


def check_client_hello(
    keys: SwarmKeys, my_node_id: str, server_nonce: bytes, payload: bytes | bytearray | memoryview, now: float
) -> tuple[bytes, Session]:
    """Verify a CLIENT_HELLO payload received by daemon ``my_node_id`` after it sent
    ``server_nonce``; return the ACCEPT frame to send and the server side's session.

    Every check runs whatever fails first (the MAC is always computed), and every failure raises
    the same ``AuthError("transfer handshake refused")``: the caller closes the connection and
    says nothing, so nobody learns whether the swarm, the secret or the clock was wrong.

    Raises:
        AuthError: malformed hello, unknown swarm, wrong secret (bad MAC), a hello made for
            another daemon or another server nonce (replay), or ``|now - ts| > MAX_SKEW_S``.
    """
    raw = bytes(payload)
    fixed = _CLIENT_HELLO_FIXED.size
    ok = len(raw) >= fixed + 1 + MAC_BYTES
    if ok:
        magic, version, swarm, ts, client_nonce, node_len = _CLIENT_HELLO_FIXED.unpack_from(raw)
        ok = len(raw) == fixed + node_len + MAC_BYTES and magic == MAGIC and version == VERSION
    if not ok:
        # still compute one MAC so a malformed hello costs what a well-formed one does
        _hello_mac(handshake_key(keys), b"\0" * 8, 0, server_nonce, b"\0" * 32, "x", my_node_id)
        raise AuthError("transfer handshake refused")
    node_raw = raw[fixed : fixed + node_len]
    mac = raw[fixed + node_len :]
    try:
        node = node_raw.decode("ascii")
    except UnicodeDecodeError:
        node = ""
    good_node = bool(NODE_ID_RE.match(node))
    hs_key = handshake_key(keys)
    want = _hello_mac(hs_key, swarm, ts, server_nonce, client_nonce, node if good_node else "x", my_node_id)
    good = hmac.compare_digest(want, mac)
    good &= good_node
    good &= hmac.compare_digest(swarm, bytes.fromhex(keys.swarm_id))
    good &= abs(now - ts) <= MAX_SKEW_S
    if not good:
        raise AuthError("transfer handshake refused")
    session = _session(hs_key, server_nonce, client_nonce, mac, is_client=False, peer=node)
    return frame(FrameType.ACCEPT, session.accept_mac), session


def check_accept(session: Session, payload: bytes | bytearray | memoryview) -> None:
    """Check the server's ACCEPT payload against the client's session.

    Raises:
        AuthError: the server does not hold the partition secret (or is not the target daemon).
    """
    if not hmac.compare_digest(bytes(payload), session.accept_mac):
        raise AuthError("transfer server failed to prove the partition secret")
