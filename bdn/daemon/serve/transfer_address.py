"""A member's transfer address: what its membership payload says as ``transfer`` (``"host:port"``
of its TransferServer, bdn.daemon.serve.wire_peer), checked as untrusted input, kept in
``Member.extra["transfer"]`` and turned into the ``bdn.transfer.Peer`` the fetcher dials.
Chunks move between daemons only over the transfer wire: a member without a valid address
(a malformed advertisement) is no chunk peer (``wired``).
"""

from __future__ import annotations

import re

from bdn.daemon.swarm.membership import Member
from bdn.transfer import Peer

MAX_ADDRESS = 300
_HOST_RE = re.compile(r"\A[0-9A-Za-z.:_-]{1,253}\Z")


def parse_address(v: object) -> tuple[str, int] | None:
    """A peer's advertised transfer address (untrusted): ``(host, port)``, or None when absent
    or malformed (the peer is then asked for no chunk)."""
    if not isinstance(v, str) or len(v) > MAX_ADDRESS:
        return None
    host, sep, port = v.rpartition(":")
    host = host.strip("[]")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536 or not _HOST_RE.match(host):
        return None
    return host, int(port)


def peer_of(m: Member) -> Peer | None:
    """The transfer peer of member ``m``, or None when it advertises no transfer server."""
    addr = m.extra.get("transfer")
    if addr is None or not m.node_id:
        return None
    return Peer(m.node_id, addr[0], addr[1])


def wired(members: list[Member]) -> list[Member]:
    """The members of ``members`` that can be asked for chunks: those with a transfer address."""
    return [m for m in members if peer_of(m) is not None]


def learn(m: Member | None, payload: object) -> None:
    """Event: member ``m`` sent ``payload`` (a membership exchange): record its transfer address
    (or that it has none: it is then asked for no chunk)."""
    if m is not None and isinstance(payload, dict):
        m.extra["transfer"] = parse_address(payload.get("transfer"))


__all__ = ["learn", "parse_address", "peer_of", "wired"]
