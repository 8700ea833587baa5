"""Membership rounds: every 2-3 s each member gets our view (``POST members``: node id, url,
the members we know, our hot-load target) and answers with its own. A member that answers is
alive; one that fails ``Membership.FAIL_LIMIT`` rounds in a row leaves HRW. A target heard in
an exchange is adopted if it is later than ours. ``peers_dns`` (e.g. a Kubernetes headless
Service) is re-resolved every ``peers_dns_interval_s`` and its addresses are static members.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
from typing import Any

from bdn.daemon import transfer_address
from bdn.daemon.clock import Clock
from bdn.daemon.config import Config, split_hostport
from bdn.daemon.membership import Member, Membership
from bdn.daemon.peer_client import PeerClient, PeerError
from bdn.daemon.replica.target import Target
from bdn.daemon.replica.view import ReplicaView
from bdn.proto.errors import ProtocolError

log = logging.getLogger("bdn.gossip")
SETTLE_POLL_S = 0.25
MAX_URL = 512
MAX_NODE_ID = 64
MAX_LISTED = 256


class Gossip:
    """Membership rounds, the members endpoint's answer, startup settling and DNS discovery."""

    def __init__(
        self, cfg: Config, membership: Membership, peers: PeerClient, replica: ReplicaView, clock: Clock,
    ) -> None:
        self.cfg = cfg
        self.membership = membership
        self.peers = peers
        self.replica = replica
        self.clock = clock
        self.closing = False
        self.transfer: str | None = None  # our transfer server's "host:port" (bdn.daemon.wire_peer)

    def payload(self) -> dict[str, Any]:
        """Our side of a members exchange."""
        t = self.replica.target
        return {
            "node_id": self.cfg.node_id,
            "url": self.cfg.advertise_url,
            "members": [{"node_id": m.node_id, "url": m.url} for m in self.membership.live()],
            "target": t.wire() if t is not None and t.seq > 0 else None,
            "transfer": self.transfer,
        }

    async def _adopt_from(self, obj: Any, who: str) -> None:
        """A peer's hot-load target, seen in a membership exchange: adopt it if it is later."""
        t = Target.from_wire(obj.get("target"), self.clock.time_ns()) if isinstance(obj, dict) else None
        if t is not None and (self.replica.target is None or t.order > self.replica.target.order):
            await self.replica.adopt(t, source=f"peer {who}")

    async def round(self) -> None:
        """One exchange with every known member, all at once."""
        payload = self.payload()

        async def one(m: Member) -> None:
            try:
                ans = await self.peers.exchange_members(m.url, payload)
            except PeerError as e:
                if m.alive:
                    log.warning("peer %s: health check failed: %s", m.url, e, extra={"peer": m.node_id or m.url})
                elif "answered 401" in str(e) and not m.extra.get("warned_401"):
                    m.extra["warned_401"] = True
                    log.warning("peer %s refuses our signed requests (401): a different partition "
                                "secret, or a clock skew over 30 s", m.url)
                self.membership.mark_failed(m.url)
                return
            self.membership.mark_ok(m.url, ans["node_id"])
            transfer_address.learn(m, ans)
            await self._adopt_from(ans, m.url)
            for other in ans.get("members") or []:
                if isinstance(other, dict) and isinstance(other.get("url"), str):
                    self.membership.learn(other["url"], str(other.get("node_id") or ""))

        await asyncio.gather(*(one(m) for m in list(self.membership.members.values())))

    async def loop(self) -> None:
        """Rounds every 2-3 s (jittered) until closed; one failing round does not stop it."""
        while not self.closing:
            await asyncio.sleep(2.0 + random.random())
            try:
                await self.round()
            except Exception:  # keep the loop alive whatever one round met
                log.exception("membership round failed")

    async def settle(self) -> None:
        """At start: rounds every 0.25 s until every static peer answered or ``startup_settle_s``
        passed. The daemons behind ``peers_dns`` are static peers too, resolved first, so a late
        joiner that finds the fleet by DNS learns its target before it loads STARTUP_SNAPSHOT."""
        deadline = self.clock.monotonic() + self.cfg.startup_settle_s
        if self.cfg.peers_dns:
            await self.resolve_dns()
        while True:
            await self.round()
            static = [m for m in self.membership.members.values() if m.static]
            if all(m.alive for m in static) or self.clock.monotonic() >= deadline:
                return
            await asyncio.sleep(SETTLE_POLL_S)

    async def handle(self, body: Any) -> dict[str, Any]:
        """A peer's POST members (untrusted map): learn it and what it knows; answer with our view.

        Raises:
            ProtocolError: the body has no string ``node_id`` and ``url``.
        """
        if not (isinstance(body, dict) and isinstance(body.get("url"), str) and isinstance(body.get("node_id"), str)):
            raise ProtocolError("members body must have node_id and url")
        await self._adopt_from(body, body["url"][:MAX_URL])
        # The caller proved it holds the secret. A URL we already know (configured, or heard
        # of) is marked alive at once, so a fleet starting together agrees on owners quickly;
        # an unknown one is only learned, and counts once our own health check reaches it.
        url, nid = body["url"][:MAX_URL].rstrip("/"), body["node_id"][:MAX_NODE_ID]
        if url in self.membership.members:
            self.membership.mark_ok(url, nid)
        else:
            self.membership.learn(url, nid)
        transfer_address.learn(self.membership.members.get(url), body)
        others = body.get("members")
        for other in (others if isinstance(others, list) else [])[:MAX_LISTED]:
            if isinstance(other, dict) and isinstance(other.get("url"), str):
                self.membership.learn(other["url"][:MAX_URL], str(other.get("node_id") or "")[:MAX_NODE_ID])
        return self.payload()

    async def resolve_dns(self) -> int:
        """Resolve ``peers_dns`` once; every address it names becomes a static member (it stays
        one until DNS drops it). The number of addresses, 0 when resolution failed (logged)."""
        host, port = split_hostport(self.cfg.peers_dns)
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as e:
            log.warning("peers_dns %s: %s", self.cfg.peers_dns, e)
            return 0
        for fam, _, _, _, addr in infos:
            ip = addr[0]
            url = f"http://[{ip}]:{port}" if fam == socket.AF_INET6 else f"http://{ip}:{port}"
            m = self.membership.learn(url)
            if m is not None:
                m.static = True
        return len(infos)

    async def dns_loop(self) -> None:
        """Learn every daemon behind ``peers_dns`` (e.g. a Kubernetes headless Service)."""
        while not self.closing:
            await self.resolve_dns()
            await asyncio.sleep(self.cfg.peers_dns_interval_s)
