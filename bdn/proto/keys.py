"""Keys derived from the partition secret, chunk addresses, and peer request signatures.

Sources: HKDF-SHA256 is RFC 5869 (tested against its appendix A vectors); HMAC-SHA256 is RFC 2104.
HKDF is two HMAC loops over the stdlib's ``hmac`` (a well-kept primitive), so bdn does not take a
compiled crypto dependency for it.

From the partition secret (text, e.g. ``openssl rand -hex 32``; surrounding whitespace ignored):

- ``swarm_id``   16 hex chars, public (URLs, metrics);
- ``auth_key``   32 bytes, signs peer requests;
- ``address_key`` 32 bytes: a chunk's swarm address is ``HMAC-SHA256(address_key, digest)[:16]``
  in hex, so two partitions holding the same bytes use unrelated addresses.

Peer requests carry ``Authorization: BDN-HMAC node=<id>, to=<id>, ts=<unix s>, nonce=<32 hex>,
sig=<64 hex>`` where ``sig = HMAC-SHA256(auth_key, "BDN-HMAC-2\\n" method "\\n" path?query "\\n"
ts "\\n" nonce "\\n" node "\\n" to)``: ``node`` is the signer, ``to`` the node id of the daemon
the request is for (``-`` when the signer does not know it yet). A verifier rejects a bad
signature, a clock skew over 30 s, a nonce already seen, and a request for another daemon
(``WrongTarget``, which tells a validly signed caller who it reached), so a request captured on
its way to one daemon cannot be replayed at another daemon of the swarm.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import re
import time
from dataclasses import dataclass, field
from typing import Protocol

from bdn.proto.errors import AuthError, BdnError

HKDF_SALT = b"bdn/partition/v1"
MIN_SECRET_CHARS = 16
MAX_SKEW_S = 30
SCHEME = "BDN-HMAC"
SIGNATURE_VERSION = "BDN-HMAC-2"  # "-1" had no target: never accepted by this version
NODE_HEADER = "X-BDN-Node"  # a WrongTarget 401 names the daemon reached in this response header
UNKNOWN_TARGET = "-"  # the ``to`` of a request whose signer does not know the target's node id yet
NODE_ID_RE = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9._:-]{0,63}\Z")
# [0-9], not \d: \d also matches non-ASCII digits ("\u0661"), which int() accepts, so one
# signed request would have many spellings.
_HEADER_RE = re.compile(
    r"\ABDN-HMAC node=([A-Za-z0-9][A-Za-z0-9._:-]{0,63}), to=(-|[A-Za-z0-9][A-Za-z0-9._:-]{0,63}), "
    r"ts=([0-9]{1,12}), nonce=([0-9a-f]{32}), sig=([0-9a-f]{64})\Z"
)


def hkdf_extract(salt: bytes, ikm: bytes) -> bytes:
    """RFC 5869 section 2.2: PRK = HMAC-SHA256(salt or zeros, IKM), 32 bytes."""
    return hmac.new(salt or b"\x00" * 32, ikm, hashlib.sha256).digest()


def hkdf_expand(prk: bytes, info: bytes, length: int) -> bytes:
    """RFC 5869 section 2.3: OKM of ``length`` bytes (at most 255*32); ValueError outside 1..8160."""
    if not 0 < length <= 255 * 32:
        raise ValueError(f"HKDF-SHA256 length must be 1..8160, got {length}")
    out, block = b"", b""
    for counter in range(1, -(-length // 32) + 1):
        block = hmac.new(prk, block + info + bytes([counter]), hashlib.sha256).digest()
        out += block
    return out[:length]


def hkdf_sha256(ikm: bytes, salt: bytes, info: bytes, length: int) -> bytes:
    """RFC 5869 HKDF with SHA-256: extract then expand."""
    return hkdf_expand(hkdf_extract(salt, ikm), info, length)


@dataclass(frozen=True)
class SwarmKeys:
    """What a daemon derives from its partition secret. Never log ``auth_key``/``address_key``."""

    swarm_id: str
    auth_key: bytes = field(repr=False)
    address_key: bytes = field(repr=False)

    def address(self, chunk_digest: str) -> str:
        """Swarm address (32 hex chars) of the chunk whose xxh3-128 hex digest is given."""
        return hmac.new(self.address_key, chunk_digest.encode("ascii"), hashlib.sha256).hexdigest()[:32]


def derive_keys(secret: str | bytes) -> SwarmKeys:
    """Derive the swarm id and keys from the partition secret.

    Raises:
        BdnError: the secret is shorter than 16 characters (after stripping whitespace).
    """
    raw = secret.encode("utf-8") if isinstance(secret, str) else bytes(secret)
    raw = raw.strip()
    if len(raw) < MIN_SECRET_CHARS:
        raise BdnError(
            f"partition secret is {len(raw)} characters; at least {MIN_SECRET_CHARS} are required "
            "(make one with: openssl rand -hex 32)"
        )
    prk = hkdf_extract(HKDF_SALT, raw)
    return SwarmKeys(
        swarm_id=hkdf_expand(prk, b"bdn swarm id", 8).hex(),
        auth_key=hkdf_expand(prk, b"bdn peer auth", 32),
        address_key=hkdf_expand(prk, b"bdn chunk address", 32),
    )


def _signature(keys: SwarmKeys, method: str, path_qs: str, ts: int, nonce: str, node: str, to: str) -> str:
    # surrogatepass: servers decode raw request bytes with surrogateescape ("\udcff"); such a
    # path must fail the signature check (401), not raise UnicodeEncodeError (500).
    msg = f"{SIGNATURE_VERSION}\n{method.upper()}\n{path_qs}\n{ts}\n{nonce}\n{node}\n{to}"
    raw = msg.encode("utf-8", "surrogatepass")
    return hmac.new(keys.auth_key, raw, hashlib.sha256).hexdigest()


class WrongTarget(AuthError):
    """A validly signed request for another daemon (``to`` is not the verifier's node id).

    ``me`` is the verifier's node id: the server may tell the caller (it proved it holds the
    partition secret, or replays a request of someone who does; node ids are no secret inside
    the swarm), so that a signer that did not know whom it reached can sign again for it.
    """

    def __init__(self, me: str) -> None:
        super().__init__("request signed for another daemon")
        self.me = me


# The default nonces: ``boot || counter`` (16 + 16 hex) as bdn.control.replay numbers them, so
# the verifier's replay window accepts them; boot is this process's start in microseconds.
# Callers that sign for many daemons pass their own (bdn.control.replay.Counters, per target).
_BOOT = int(time.time() * 1_000_000) * 4 + 3
_COUNTER = itertools.count(1)  # next() is atomic under the GIL: no lock (bdn/proto does no threading)


def default_nonce() -> str:
    """A fresh ``boot || counter`` nonce of this process (32 hex)."""
    return f"{_BOOT & (2**64 - 1):016x}{next(_COUNTER):016x}"


def sign_request(
    keys: SwarmKeys,
    method: str,
    path_qs: str,
    node_id: str,
    *,
    to: str,
    now: float | None = None,
    nonce: str | None = None,
) -> str:
    """The ``Authorization`` header value for a peer request to ``path_qs`` (path plus query).

    ``nonce``: 32 lowercase hex, ``boot || counter`` (``bdn.control.replay``), strictly
    increasing per signer and boot; default :func:`default_nonce`.

    ``node_id`` is the signer; ``to`` the node id of the daemon the request is for (only that
    daemon accepts it), or ``UNKNOWN_TARGET`` when the signer does not know it yet (every daemon
    refuses it with ``WrongTarget``, naming itself).

    Raises:
        BdnError: ``node_id`` or ``to`` does not match ``NODE_ID_RE`` (no verifier could accept it).
    """
    for what, nid in (("node id", node_id), ("target node id", to)):
        if not NODE_ID_RE.match(nid) and not (what == "target node id" and nid == UNKNOWN_TARGET):
            raise BdnError(f"{what} {nid[:80]!r} does not match {NODE_ID_RE.pattern}")
    ts = int(time.time() if now is None else now)
    nonce = default_nonce() if nonce is None else nonce
    sig = _signature(keys, method, path_qs, ts, nonce, node_id, to)
    return f"{SCHEME} node={node_id}, to={to}, ts={ts}, nonce={nonce}, sig={sig}"


class NonceSeen(Protocol):
    """What ``verify_request`` needs of a replay check (the daemon's is ``bdn.daemon.swarm.nonces.ReplayWindows``)."""

    def add(self, nonce: str, now: float, node: str = "", ts: float | None = None) -> bool:
        """Accept ``nonce`` of signer ``node`` (signed at ``ts``, unix s) at ``now``; False if it
        was seen before (a replay) or cannot be told apart from one."""
        ...


def verify_request(
    keys: SwarmKeys,
    header: str | None,
    method: str,
    path_qs: str,
    nonces: NonceSeen,
    *,
    me: str,
    now: float | None = None,
) -> str:
    """Check a peer request's ``Authorization`` header for the daemon ``me``; return the signer's node id.

    Order: grammar, clock skew, signature (constant time), target, nonce: a request for another
    daemon is refused before its nonce is recorded, and a refused request records nothing.

    Raises:
        WrongTarget: a valid signature for another daemon (or for ``UNKNOWN_TARGET``).
        AuthError: missing/malformed header, bad signature, skew over 30 s, or replayed nonce.
            The caller answers 401 with no detail (``WrongTarget``: with its own node id only).
    """
    if not header:
        raise AuthError("missing authorization")
    m = _HEADER_RE.match(header)
    if not m:
        raise AuthError("malformed authorization")
    node, to, ts_s, nonce, sig = m.groups()
    t = time.time() if now is None else now
    ts = int(ts_s)
    if abs(t - ts) > MAX_SKEW_S:
        raise AuthError("clock skew")
    if not hmac.compare_digest(sig, _signature(keys, method, path_qs, ts, nonce, node, to)):
        raise AuthError("bad signature")
    if to != me:
        raise WrongTarget(me)
    if not nonces.add(nonce, t, node, ts):
        raise AuthError("replayed nonce")
    return node
