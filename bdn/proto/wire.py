"""The transfer wire: frames and the handshake of bdn's chunk transport (pure, no I/O).

Source: DESIGN.md ("The transfer wire": bulk chunk bytes on a dedicated transfer layer with
the swarm's isolation properties). Keys come from the partition secret (bdn.proto.keys);
HMAC-SHA256 is RFC 2104, HKDF-SHA256 RFC 5869. The record layout (implicit per-direction sequence
numbers in every tag, so no nonce has to travel or be remembered) follows TLS 1.3 (RFC 8446, 5.3)
and SSH (RFC 4253, 6.4).

Every frame is ``u32 length | u8 type | payload`` in network byte order; ``length`` counts the
type byte and the payload and is at most ``MAX_FRAME`` (a frame that claims more is a protocol
error: the reader closes the connection without allocating). A DATA frame is followed by
``length`` raw chunk bytes that are not part of the frame (they go straight into the receiver's
mapping; the receiver checks them against the manifest digest, never trusts them).

The handshake and the session tags that seal every frame after it are bdn.proto.handshake.

Frames after the handshake (payloads, before the tag):

- ``ASK`` (client): ``address[16] | offset u64 | length u64 | wait_ms u32 | hint_len u8 | hint
  [| flags u8]``: ``length`` bytes at ``offset`` inside the chunk at swarm ``address`` (the
  32-hex swarm address as 16 raw bytes); the server may hold the request up to ``wait_ms`` while
  it fetches the chunk; ``hint`` is an optional snapshot identity. ``flags`` (absent = 0; unknown
  bits ignored): bit 0 ``ASK_CUT_THROUGH``, the client accepts a PART answer.
- ``DATA`` (server): ``length u64``, then ``length`` raw bytes.
- ``PART`` (server, only to an ASK with ``ASK_CUT_THROUGH``): ``offset u64 | length u64``
  (within the asked range), then ``length`` raw bytes: a *cut-through* answer is a sequence of
  PARTs, in any order, never overlapping, that ends when they cover the asked range; a PART of
  length 0 is a keep-alive. The server sends it for a chunk it is still reading from the bucket
  (bdn.transfer.growing): the bytes it has,
  as they land, and the range's last bytes only after it verified the whole chunk, so a
  completed answer is still one its sender checked.
- ``BUSY`` (server): ``retry_after_ms u32`` (upload slots full, or still fetching).
- ``NOT_HERE`` (server): empty.
- ``HAVE`` (either side, for announcements): ``identity_len u8 | identity | layer u8 | count u32
  | count x u32 chunk indices``. From a client, a HAVE with no indices is a *subscription* to
  ``identity`` (that connection then carries no chunk requests); the server answers with its
  bitfield of the snapshot as HAVEs of layer 0 (stored) and 1 (rebuilt), then a HAVE whenever
  chunks are indexed, a HAVE of layer 2 (``HAVE_GROWING``) when stored chunks start landing
  there from the bucket (an asker may take them cut-through at once; bytes still arriving from a peer are never announced nor passed on), and an empty one as a keep-alive
  (bdn.transfer.announce).
- ``TAKE`` (client): ``identity_len u8 | identity | index u32``: the client asks to read stored
  chunk ``index`` of ``identity`` from the bucket *instead of* the server, the chunk's owner
  (a read taken over at the end of a slow owner's list). The owner decides on its own event
  loop, where its bucket reads decide too: ``GIVE`` (server): ``u8`` 1 = the read is the
  client's (the owner will not start it while the grant lasts), 0 = refused (the owner reads
  it, or holds it, or does not know the snapshot). The grant is what keeps a chunk read from
  the bucket once: two announcements crossing each other could not (both reads would start).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

from bdn.proto.errors import ProtocolError

MAGIC = b"BDNT"
VERSION = 1
TAG_BYTES = 16
#: Largest frame (type byte plus payload) either side accepts; chunk bodies travel outside frames.
MAX_FRAME = 64 << 10
#: Largest number of chunk indices one HAVE frame carries.
MAX_HAVE_INDICES = (MAX_FRAME - 1 - 1 - 255 - 1 - 4 - TAG_BYTES) // 4
MAX_WAIT_MS = 60_000
MAX_LENGTH = 1 << 30  # bdn.proto.chunks.MAX_CHUNK_SIZE: no request or answer is larger

HEADER = struct.Struct("!IB")  # length (type + payload), type
_ASK_FIXED = struct.Struct("!16sQQIB")
_DATA = struct.Struct("!Q")
_PART = struct.Struct("!QQ")
_BUSY = struct.Struct("!I")
_HAVE_FIXED = struct.Struct("!BI")
_INDEX = struct.Struct("!I")


class FrameType(IntEnum):
    """The one-byte frame types."""

    SERVER_HELLO = 0x01
    CLIENT_HELLO = 0x02
    ACCEPT = 0x03
    ASK = 0x10
    DATA = 0x11
    BUSY = 0x12
    NOT_HERE = 0x13
    PART = 0x14
    HAVE = 0x20
    TAKE = 0x15
    GIVE = 0x16


_TYPES = frozenset(int(t) for t in FrameType)
#: Frames a server accepts from a client after the handshake, and a client from a server.
CLIENT_FRAMES = frozenset({FrameType.ASK, FrameType.HAVE, FrameType.TAKE})
SERVER_FRAMES = frozenset(
    {
        FrameType.DATA,
        FrameType.BUSY,
        FrameType.NOT_HERE,
        FrameType.PART,
        FrameType.HAVE,
        FrameType.GIVE,
    }
)
#: HAVE layer: the sender is reading these stored chunks from the bucket now (cut-through).
HAVE_GROWING = 2
#: ASK flag: the client accepts a cut-through answer (PART frames).
ASK_CUT_THROUGH = 0x01


def parse_header(header: bytes | bytearray | memoryview) -> tuple[FrameType, int]:
    """``(type, payload_length)`` of a 5-byte frame header.

    Raises:
        ProtocolError: the frame claims more than ``MAX_FRAME`` bytes, none, or an unknown type.
    """
    length, ftype = HEADER.unpack(header)
    if not 1 <= length <= MAX_FRAME:
        raise ProtocolError(f"transfer frame of {length} bytes (at most {MAX_FRAME})")
    if ftype not in _TYPES:
        raise ProtocolError(f"unknown transfer frame type 0x{ftype:02x}")
    return FrameType(ftype), length - 1


def frame(ftype: FrameType, payload: bytes) -> bytes:
    """An untagged frame (the handshake's): ``u32 length | u8 type | payload``."""
    return HEADER.pack(len(payload) + 1, ftype) + payload


# ---- requests and answers ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ask:
    """A request for ``length`` bytes at ``offset`` inside the chunk at swarm ``address``
    (32 lowercase hex chars); the server may hold it ``wait_ms`` while it fetches the chunk."""

    address: str
    offset: int
    length: int
    wait_ms: int = 0
    snapshot: str | None = None
    flags: int = 0

    @property
    def cut_through(self) -> bool:
        """The client accepts a cut-through answer (PART frames)."""
        return bool(self.flags & ASK_CUT_THROUGH)


def encode_ask(ask: Ask) -> bytes:
    """The ASK payload (to be sealed by the client's session).

    Raises:
        ProtocolError: a field is out of range (address not 32 hex, length 0 or over 1 GiB, ...).
    """
    try:
        address = bytes.fromhex(ask.address)
    except ValueError:
        address = b""
    if len(address) != 16:
        raise ProtocolError("chunk address must be 32 hex characters")
    if not (0 <= ask.offset < MAX_LENGTH and 0 < ask.length <= MAX_LENGTH and 0 <= ask.wait_ms <= MAX_WAIT_MS):
        raise ProtocolError(f"ask out of range: offset {ask.offset}, length {ask.length}, wait {ask.wait_ms} ms")
    hint = (ask.snapshot or "").encode("ascii")
    if len(hint) > 255:
        raise ProtocolError("snapshot hint longer than 255 characters")
    if not 0 <= ask.flags <= 0xFF:
        raise ProtocolError(f"ask flags {ask.flags} out of range")
    tail = bytes([ask.flags]) if ask.flags else b""
    return _ASK_FIXED.pack(address, ask.offset, ask.length, ask.wait_ms, len(hint)) + hint + tail


def decode_ask(payload: bytes | bytearray | memoryview) -> Ask:
    """Parse an ASK payload (already checked by ``Session.open``).

    Raises:
        ProtocolError: wrong size or a field out of range.
    """
    n = len(payload)
    if n < _ASK_FIXED.size:
        raise ProtocolError("ask frame too short")
    address, offset, length, wait_ms, hint_len = _ASK_FIXED.unpack_from(payload)
    if n not in (_ASK_FIXED.size + hint_len, _ASK_FIXED.size + hint_len + 1):
        raise ProtocolError("ask frame of the wrong size")
    flags = payload[n - 1] if n == _ASK_FIXED.size + hint_len + 1 else 0
    if not (offset < MAX_LENGTH and 0 < length <= MAX_LENGTH and wait_ms <= MAX_WAIT_MS):
        raise ProtocolError(f"ask out of range: offset {offset}, length {length}, wait {wait_ms} ms")
    try:
        hint = bytes(payload[_ASK_FIXED.size : _ASK_FIXED.size + hint_len]).decode("ascii") or None
    except UnicodeDecodeError:
        raise ProtocolError("snapshot hint is not ascii") from None
    return Ask(address.hex(), offset, length, wait_ms, hint, flags)


def encode_data(length: int) -> bytes:
    """The DATA payload announcing ``length`` raw bytes after the frame."""
    return _DATA.pack(length)


def decode_data(payload: bytes | bytearray | memoryview) -> int:
    """The body length a DATA payload announces.

    Raises:
        ProtocolError: wrong size, or a length over ``MAX_LENGTH``.
    """
    if len(payload) != _DATA.size:
        raise ProtocolError("data frame of the wrong size")
    (length,) = _DATA.unpack(payload)
    if length > MAX_LENGTH:
        raise ProtocolError(f"data frame announces {length} bytes (at most {MAX_LENGTH})")
    return length


def encode_part(offset: int, length: int) -> bytes:
    """The PART payload: ``length`` raw bytes at ``offset`` of the asked range follow the frame."""
    return _PART.pack(offset, length)


def decode_part(payload: bytes | bytearray | memoryview, asked: int) -> tuple[int, int]:
    """``(offset, length)`` of a PART payload inside an asked range of ``asked`` bytes.

    Raises:
        ProtocolError: wrong size, or a range outside ``[0, asked)``.
    """
    if len(payload) != _PART.size:
        raise ProtocolError("part frame of the wrong size")
    offset, length = _PART.unpack(payload)
    if offset + length > asked:
        raise ProtocolError(f"part frame {offset}+{length} outside the {asked}-byte range asked")
    return offset, length


def encode_busy(retry_after_s: float) -> bytes:
    """The BUSY payload: ask again after ``retry_after_s`` seconds (clamped to 0..60 s)."""
    return _BUSY.pack(int(min(max(retry_after_s, 0.0), 60.0) * 1000))


def decode_busy(payload: bytes | bytearray | memoryview) -> float:
    """Seconds to wait before asking again, from a BUSY payload (clamped to 0..60 s).

    Raises:
        ProtocolError: wrong size.
    """
    if len(payload) != _BUSY.size:
        raise ProtocolError("busy frame of the wrong size")
    return min(_BUSY.unpack(payload)[0], 60_000) / 1000.0


@dataclass(frozen=True, slots=True)
class Have:
    """An announcement that the sender now holds chunks ``indices`` of ``identity``'s ``layer``
    (0 stored, 1 reconstructed), or (``HAVE_GROWING``, 2) that those stored chunks are landing
    there now from the bucket (never bytes still arriving from a peer): an asker may take them cut-through
    (a PART answer) at once."""

    identity: str
    layer: int
    indices: tuple[int, ...]


def encode_have(have: Have) -> bytes:
    """The HAVE payload.

    Raises:
        ProtocolError: identity longer than 255, layer not 0/1, too many or out-of-range indices.
    """
    ident = have.identity.encode("ascii")
    if not 0 < len(ident) <= 255 or have.layer not in (0, 1, HAVE_GROWING):
        raise ProtocolError("have frame needs an identity of 1..255 chars and layer 0, 1 or 2")
    if len(have.indices) > MAX_HAVE_INDICES:
        raise ProtocolError(f"have frame with {len(have.indices)} indices (at most {MAX_HAVE_INDICES})")
    try:
        body = struct.pack(f"!{len(have.indices)}I", *have.indices)
    except struct.error:
        raise ProtocolError("have index out of range") from None
    return bytes([len(ident)]) + ident + _HAVE_FIXED.pack(have.layer, len(have.indices)) + body


def decode_have(payload: bytes | bytearray | memoryview) -> Have:
    """Parse a HAVE payload. The caller validates the identity and bounds the indices by the
    manifest it holds.

    Raises:
        ProtocolError: wrong size, layer not 0/1, or identity not ascii.
    """
    raw = bytes(payload)
    if not raw or len(raw) < 1 + raw[0] + _HAVE_FIXED.size:
        raise ProtocolError("have frame too short")
    n_ident = raw[0]
    try:
        ident = raw[1 : 1 + n_ident].decode("ascii")
    except UnicodeDecodeError:
        raise ProtocolError("have identity is not ascii") from None
    layer, count = _HAVE_FIXED.unpack_from(raw, 1 + n_ident)
    start = 1 + n_ident + _HAVE_FIXED.size
    if layer not in (0, 1, HAVE_GROWING) or len(raw) != start + 4 * count or not ident:
        raise ProtocolError("have frame malformed")
    return Have(ident, layer, struct.unpack_from(f"!{count}I", raw, start))


@dataclass(frozen=True, slots=True)
class Take:
    """A request to read stored chunk ``index`` of ``identity`` from the bucket instead of the
    server (its owner): answered by ``GIVE`` (see the module docstring)."""

    identity: str
    index: int


def encode_take(take: Take) -> bytes:
    """The TAKE payload.

    Raises:
        ProtocolError: identity not 1..255 ascii characters, or index outside 0..2^32-1.
    """
    try:
        ident = take.identity.encode("ascii")
    except UnicodeEncodeError:
        raise ProtocolError("take identity is not ascii") from None
    if not 0 < len(ident) <= 255 or not 0 <= take.index <= 0xFFFFFFFF:
        raise ProtocolError("take frame needs an identity of 1..255 chars and an index below 2^32")
    return bytes([len(ident)]) + ident + _INDEX.pack(take.index)


def decode_take(payload: bytes | bytearray | memoryview) -> Take:
    """Parse a TAKE payload. The caller validates the identity and bounds the index by the
    manifest it holds.

    Raises:
        ProtocolError: wrong size, or an identity that is empty or not ascii.
    """
    raw = bytes(payload)
    if not raw or len(raw) != 1 + raw[0] + _INDEX.size or raw[0] == 0:
        raise ProtocolError("take frame malformed")
    try:
        ident = raw[1 : 1 + raw[0]].decode("ascii")
    except UnicodeDecodeError:
        raise ProtocolError("take identity is not ascii") from None
    return Take(ident, _INDEX.unpack_from(raw, 1 + raw[0])[0])


def encode_give(granted: bool) -> bytes:
    """The GIVE payload: 1 when the read is the asker's, 0 when refused."""
    return b"\x01" if granted else b"\x00"


def decode_give(payload: bytes | bytearray | memoryview) -> bool:
    """Whether a GIVE payload grants the read.

    Raises:
        ProtocolError: not exactly one byte of 0 or 1.
    """
    if len(payload) != 1 or payload[0] > 1:
        raise ProtocolError("give frame malformed")
    return payload[0] == 1
