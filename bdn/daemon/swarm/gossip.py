"""Membership over SWIM (``bdn.control.swim``): the daemon's transport for the pure protocol.

Every SWIM message is one signed ``POST members`` (DESIGN.md, "Membership"): the body is
msgpack ``{"m": message}``, the answer ``{"node_id", "url", "m": [messages for the caller]}``,
so a ``ping`` and its ``ack`` are one request, a ``ping_req`` is one request to the helper plus
the helper's own ping and its ack back to the asker. Per period each daemon sends one ping
(and ``2 * swim_indirect_k`` more on a missed ack), plus one table ``sync`` every
``swim_sync_interval_s``: O(1) requests per node per period, whatever N. Every message also
carries this daemon's hot-load target (``x``), adopted by the receiver if it is later.

The static ``peers`` and ``peers_dns`` are the **seeds**: at start (and every ``SEED_RETRY_S``
for a seed not alive) the daemon sends each a ``sync`` addressed by URL (its node id is not
known yet), and learns the whole table from the answer. SWIM decides alive/dead; its changes
are applied to :class:`~bdn.daemon.swarm.membership.Membership` (the table the fetcher, HRW and the
hot-load read). A member's SWIM address is ``"<url>"`` or ``"<url> <transfer host:port>"``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
from collections.abc import Coroutine
from typing import Any

from bdn.control import swim as swimp
from bdn.control.swim import Message, Swim, SwimError, Update
from bdn.daemon.config import Config, split_hostport
from bdn.daemon.observe.problems import Problems
from bdn.daemon.observe.stats import Stats
from bdn.daemon.process.clock import Clock
from bdn.daemon.replica.target import Target
from bdn.daemon.replica.view import ReplicaView
from bdn.daemon.serve import transfer_address
from bdn.daemon.swarm.membership import Membership
from bdn.daemon.swarm.peer_client import PeerClient, PeerError
from bdn.proto.errors import ProtocolError
from bdn.proto.keys import NODE_ID_RE

log = logging.getLogger("bdn.gossip")
SETTLE_POLL_S = 0.25
SEED_RETRY_S = 10.0  # a seed (static peer, DNS record) not alive is sent a sync this often
REVIVE_S = 5.0  # a member taken out locally (failed chunk requests) while SWIM counts it live returns after this
MAX_URL = 512
MAX_REPLIES = 8


def encode_addr(url: str, transfer: str | None) -> str:
    return f"{url} {transfer}" if transfer else url


def decode_addr(addr: str) -> tuple[str, str | None]:
    """``(url, transfer or None)`` of a SWIM address (untrusted: the URL is checked by the caller)."""
    url, _, transfer = addr.partition(" ")
    return url[:MAX_URL].rstrip("/"), transfer or None


def message_wire(msg: Message, extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"k": msg.kind, "s": msg.src, "d": msg.dst, "q": msg.seq}
    if msg.target:
        out["t"] = msg.target
    if msg.updates:
        out["u"] = [u.wire() for u in msg.updates]
    if extra is not None:
        out["x"] = extra
    return out


def parse_message(obj: Any, src: str, me: str) -> tuple[Message, Any]:
    """A SWIM message from the wire (untrusted), sent by the authenticated node ``src`` to ``me``.

    Returns ``(message, extra)``. Raises ProtocolError naming the first bad field.
    """
    if not isinstance(obj, dict):
        raise ProtocolError("membership message must be a map")
    kind, s, d, seq, target = obj.get("k"), obj.get("s"), obj.get("d", ""), obj.get("q", 0), obj.get("t", "")
    if kind not in swimp.KINDS:
        raise ProtocolError(f"membership message kind must be one of {', '.join(swimp.KINDS)}")
    if s != src:
        raise ProtocolError("membership message src is not its signer")
    if d not in ("", me):
        raise ProtocolError("membership message is for another daemon")
    if d == "" and kind != "sync":
        raise ProtocolError("only a sync may be sent to a daemon whose node id is not known")
    if not isinstance(seq, int) or isinstance(seq, bool) or not 0 <= seq < 2**63:
        raise ProtocolError("membership message seq must be an integer in [0, 2^63)")
    if not isinstance(target, str) or (target and not NODE_ID_RE.match(target)):
        raise ProtocolError("membership message target must be a node id")
    raw = obj.get("u") or []
    cap = swimp.MAX_SYNC_ENTRIES if kind in ("sync", "sync_ack") else swimp.MAX_UPDATES_PER_MESSAGE
    if not isinstance(raw, list) or len(raw) > cap:
        raise ProtocolError(f"membership message updates must be a list of at most {cap}")
    try:
        updates = tuple(Update.from_wire(u) for u in raw)
    except SwimError as e:
        raise ProtocolError(str(e)) from None
    return Message(kind, s, me, seq, target, updates), obj.get("x")


class Gossip:
    """Runs SWIM for this daemon: the period loop, the members endpoint, seeds, DNS discovery."""

    def __init__(
        self,
        cfg: Config,
        membership: Membership,
        peers: PeerClient,
        replica: ReplicaView,
        clock: Clock,
        stats: Stats | None = None,
        problems: Problems | None = None,
    ) -> None:
        self.cfg = cfg
        self.problems = problems or Problems(clock)  # misconfigurations seen (readiness reads them)
        self.membership = membership
        self.peers = peers
        self.replica = replica
        self.clock = clock
        self.stats = stats or Stats()
        self.closing = False
        self._transfer: str | None = None  # our transfer server's "host:port" (bdn.daemon.serve.wire_peer)
        self.swim = Swim(
            cfg.node_id,
            cfg.advertise_url,
            clock.monotonic,
            period_s=cfg.swim_period_s,
            ack_timeout_s=cfg.swim_ack_timeout_s,
            indirect_k=cfg.swim_indirect_k,
            suspect_mult=cfg.swim_suspect_mult,
            sync_interval_s=cfg.swim_sync_interval_s,
        )
        self.swim.join({})
        self._tasks: set[asyncio.Task[Any]] = set()
        self._next_seed = 0.0
        self._next_revive = 0.0

    # ---- our address -----------------------------------------------------------------------
    @property
    def transfer(self) -> str | None:
        """Our transfer server's advertised ``host:port`` (None: not listening, or off)."""
        return self._transfer

    def transfer_listening(self, address: str) -> None:
        """Event: our transfer server listens at ``address``: every member learns it with our
        next SWIM entry."""
        self._transfer = address
        self.swim.readvertise(encode_addr(self.cfg.advertise_url, address))

    def _extra(self) -> Any:
        t = self.replica.target
        return {"target": t.wire()} if t is not None and t.seq > 0 else None

    # ---- sending ---------------------------------------------------------------------------
    def _url_of(self, node: str) -> str | None:
        addr = self.swim.addr(node)
        return decode_addr(addr)[0] if addr else None

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def send(self, msg: Message, url: str | None = None) -> bool:
        """POST one message (to ``url``, else to ``msg.dst``'s address); handle the replies.
        False when the peer could not be reached (SWIM's timers judge it)."""
        url = url or self._url_of(msg.dst)
        if not url:
            return False
        self.stats.control_request("sent", msg.kind)
        self.stats.control_request("messages_sent", msg.kind)
        try:
            ans = await self.peers.exchange_members(url, {"m": message_wire(msg, self._extra())})
        except PeerError as e:
            if "answered 401" in str(e):  # readiness, the log (once) and the metrics say so
                self.problems.report(
                    "partition_secret",
                    url,
                    (
                        f"peer {url} refuses this daemon's signed requests (401): its partition secret "
                        "differs from this daemon's, or the clocks are more than 30 s apart"
                    ),
                )
            log.debug("membership %s to %s failed: %s", msg.kind, url, e)
            return False
        self.problems.clear("partition_secret", url)
        node = ans["node_id"]
        if node == self.cfg.node_id and str(ans.get("url", "")).rstrip("/") != self.membership.self_url:  # not us
            # a daemon never talks to itself by another URL: two daemons share one node id
            # (it defaults to the host name: two daemons on one host), and each ignores the
            # other for ever; say so instead of running alone without a word (new-user report)
            self.problems.report(
                "duplicate_node_id",
                url,
                (
                    f"peer {url} has this daemon's node id {node!r}: node ids must be unique in a swarm "
                    "(set node_id, BDN_NODE_ID); it is ignored"
                ),
            )
            return False
        self.problems.clear("duplicate_node_id", url)
        if not NODE_ID_RE.match(node):
            return False
        if msg.dst == "":  # a seed named itself
            self.membership.mark_ok(url, node)
        replies = ans.get("m")
        for r in (replies if isinstance(replies, list) else [])[:MAX_REPLIES]:
            try:
                reply, extra = parse_message(r, node, self.cfg.node_id)
            except ProtocolError as e:
                log.warning("peer %s: bad membership answer: %s", url, e)
                continue
            self.stats.control_request("messages_received", reply.kind)
            for out in await self._receive(reply, extra):
                self._spawn(self.send(out))
        return True

    async def _receive(self, msg: Message, extra: Any) -> list[Message]:
        if isinstance(extra, dict):
            await self._adopt_from(extra, msg.src)
        out = self.swim.receive(msg)
        self._heard(msg.src)
        self.apply_changes()
        return out

    def _heard(self, node: str) -> None:
        """Direct evidence that ``node`` is alive (it sent us a message)."""
        addr = self.swim.addr(node)
        if addr and self.swim.is_live(node):
            url, _ = decode_addr(addr)
            m = self.membership.members.get(url)
            if m is not None and not m.alive:
                self.membership.mark_ok(url, node)

    def apply_changes(self) -> None:
        """SWIM's changes of standing -> the member table (live: alive, with its transfer address)."""
        if not self.swim.changes:
            return
        changed, self.swim.changes = self.swim.changes, []
        for node in dict.fromkeys(changed):
            addr = self.swim.addr(node)
            if self.swim.is_live(node) and addr:
                url, transfer = decode_addr(addr)
                if not url.startswith(("http://", "https://")):
                    continue
                self.membership.mark_ok(url, node)
                transfer_address.learn(self.membership.members.get(url), {"transfer": transfer})
            else:
                for m in [m for m in self.membership.members.values() if m.node_id == node]:
                    if addr is None:
                        self.membership.forget(m.url)
                    else:
                        self.membership.mark_dead(m.url)

    async def _adopt_from(self, extra: dict[str, Any], who: str) -> None:
        """A peer's hot-load target, piggybacked on a membership message: adopt it if later."""
        t = Target.from_wire(extra.get("target"), self.clock.time_ns())
        if t is not None and (self.replica.target is None or t.order > self.replica.target.order):
            await self.replica.adopt(t, source=f"peer {who}")

    # ---- the period loop ---------------------------------------------------------------------
    def _seeds(self) -> list[str]:
        """Static members (configured or from DNS) not alive: their node id may be unknown."""
        return [m.url for m in self.membership.members.values() if m.static and not m.alive]

    async def seed_round(self) -> None:
        """A sync to every seed that is not alive, all at once (at start; then every SEED_RETRY_S)."""
        await asyncio.gather(
            *(
                self.send(self.swim.sync_to(self.membership.node_of(u) if self._known(u) else ""), u)
                for u in self._seeds()
            )
        )

    def _known(self, url: str) -> bool:
        node = self.membership.node_of(url)
        return bool(node) and self.swim.addr(node) is not None

    def _revive(self) -> None:
        now = self.clock.monotonic()
        for m in list(self.membership.members.values()):
            if (
                not m.alive
                and m.node_id
                and self.swim.is_live(m.node_id)
                and now - m.extra.get("down_at", now) >= REVIVE_S
                and self._url_of(m.node_id) == m.url
            ):
                self.membership.mark_ok(m.url, m.node_id)

    async def step(self) -> None:
        """What is due now: SWIM's timers (probes, indirect probes, syncs), seeds, revivals."""
        out = self.swim.tick()
        self.apply_changes()
        self.stats.membership.update(
            periods=self.swim.periods,
            members=self.swim.table_size(),
            epoch=self.membership.epoch,
            state_bytes=self.swim.state_bytes(),
            incarnation=self.swim.incarnation,
            newcomers_waiting=len(self.swim.newcomers),
            newcomers_refused=self.swim.newcomers.refused,
            newcomers_confirmed=self.swim.newcomers.confirmed,
        )
        for msg in out:
            self._spawn(self.send(msg))
        now = self.clock.monotonic()
        if now >= self._next_seed:
            self._next_seed = now + SEED_RETRY_S
            if self._seeds():
                self._spawn(self.seed_round())
        if now >= self._next_revive:
            self._next_revive = now + REVIVE_S
            self._revive()

    async def loop(self) -> None:
        """Run SWIM until closed; one failing step does not stop it."""
        while not self.closing:
            delay = self.swim.next_deadline() - self.clock.monotonic()
            await asyncio.sleep(min(max(delay, 0.005), 1.0) + random.random() * 0.005)
            try:
                await self.step()
            except Exception:  # keep the loop alive whatever one step met
                log.exception("membership step failed")

    async def settle(self) -> None:
        """At start: syncs to the seeds every 0.25 s until every static peer answered or
        ``startup_settle_s`` passed. The daemons behind ``peers_dns`` are seeds too, resolved
        first, so a late joiner found by DNS learns the fleet's target before it loads
        STARTUP_SNAPSHOT. The only step whose requests grow with the seed list; once."""
        deadline = self.clock.monotonic() + self.cfg.startup_settle_s
        if self.cfg.peers_dns:
            await self.resolve_dns()
        while True:
            await self.seed_round()
            if not self._seeds() or self.clock.monotonic() >= deadline:
                self._next_seed = self.clock.monotonic() + SEED_RETRY_S
                return
            await asyncio.sleep(SETTLE_POLL_S)

    async def handle(self, body: Any, peer: str = "") -> dict[str, Any]:
        """A peer's POST members (untrusted map ``{"m": message}`` signed by node ``peer``):
        the answer ``{"node_id", "url", "m": [replies to the caller]}``.

        Raises:
            ProtocolError: the body is not a membership message from ``peer`` to this daemon.
        """
        if not isinstance(body, dict) or "m" not in body:
            raise ProtocolError("members body must be a map with a membership message m")
        msg, extra = parse_message(body["m"], peer, self.cfg.node_id)
        self.stats.control_request("received", msg.kind)
        self.stats.control_request("messages_received", msg.kind)
        replies: list[Message] = []
        for out in await self._receive(msg, extra):
            if out.dst == msg.src:
                replies.append(out)
            else:
                self._spawn(self.send(out))
        if msg.kind == "sync":  # the sync's sender is in our table now: no seed round for it
            self.apply_changes()
        x = self._extra()
        for r in replies[:MAX_REPLIES]:
            self.stats.control_request("messages_sent", r.kind)
        return {
            "node_id": self.cfg.node_id,
            "url": self.cfg.advertise_url,
            "m": [message_wire(r, x) for r in replies[:MAX_REPLIES]],
        }

    async def close(self) -> None:
        self.closing = True
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # ---- DNS -------------------------------------------------------------------------------
    async def resolve_dns(self) -> int:
        """Resolve ``peers_dns`` once; every address it names becomes a static member (a seed).
        The number of addresses, 0 when resolution failed (logged)."""
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
