"""Swarm membership: who the live peers are, for HRW ownership and for asking chunks.

Sources of members: the static peer list and ``peers_dns`` from the config (the seeds), plus
what SWIM (``bdn.control.swim``, driven by ``bdn.daemon.swarm.gossip``) learns from authenticated
peers. SWIM decides alive and dead (``mark_ok`` / ``mark_dead``); failed chunk requests
(``mark_failed``, ``FAIL_LIMIT`` in a row) and bad bytes (``penalise``) take a member out of
the live set locally at once, before SWIM agrees.

The live set and the HRW node list are computed once per membership **epoch** (``epoch``
increments whenever the usable set changes), not per chunk request; there is no fixed table
limit below SWIM's own (``MAX_MEMBERS``, the largest table a ``sync`` may carry).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from bdn.control.owners import OwnerCache, OwnerMap
from bdn.daemon.process.clock import SYSTEM, Clock


@dataclass
class Member:
    """A peer daemon, keyed by its advertised URL; ``node_id`` is learned from its answers."""

    url: str
    node_id: str = ""
    alive: bool = False
    failures: int = 0
    last_seen: float = 0.0
    penalty_until: float = 0.0
    inflight: int = 0
    static: bool = False
    extra: dict = field(default_factory=dict)
    requests: set = field(default_factory=set)  # asyncio tasks of chunk requests in flight to it

    def usable(self, now: float) -> bool:
        """Alive, with a known node id, and not penalised at ``now`` (monotonic s)."""
        return self.alive and bool(self.node_id) and now >= self.penalty_until


class Membership:
    """The member table of one daemon (itself excluded); time from ``clock`` (monotonic s).

    The only writers of a member's liveness are the events ``learn`` (heard of it), ``mark_ok``
    (it answered), ``mark_failed`` (it did not; after ``FAIL_LIMIT`` in a row it leaves HRW and
    its parked requests are cancelled) and ``penalise`` (it sent bad bytes).
    """

    FAIL_LIMIT = 2
    FORGET_AFTER = 30  # failed requests in a row before a learned (non-static) member is dropped
    MAX_MEMBERS = 100_000  # = bdn.control.swim.MAX_SYNC_ENTRIES: the whole fleet, one entry each

    def __init__(self, self_id: str, self_url: str, static: list[str], clock: Clock = SYSTEM) -> None:
        self.clock = clock
        self.self_id = self_id
        self.self_url = self_url.rstrip("/")
        self.members: dict[str, Member] = {}
        self.epoch = 0  # increments whenever the usable set changes (see live())
        self._version = 0  # increments on every transition; the cache below is keyed to it
        self._cache: tuple[int, float, list[Member]] | None = None  # (version, valid until, live)
        self._cache_ids: tuple[str, ...] = ()
        self._owners = OwnerCache()
        for u in static:
            u = u.rstrip("/")
            if u != self.self_url:
                self.members[u] = Member(url=u, static=True)

    def learn(self, url: str, node_id: str = "") -> Member | None:
        """Add a member heard of from a peer (ignored if it is this daemon)."""
        url = url.rstrip("/")
        if url == self.self_url or node_id == self.self_id or not url.startswith(("http://", "https://")):
            return None
        m = self.members.get(url)
        if m is None:
            if len(self.members) >= self.MAX_MEMBERS:
                return None  # a flood of made-up members cannot grow the table without bound
            m = self.members[url] = Member(url=url)
            self._version += 1
        if node_id and not m.node_id:
            m.node_id = node_id
            self._version += 1
        return m

    def mark_ok(self, url: str, node_id: str) -> None:
        """Event: the member at ``url`` is alive (it answered, or SWIM says so)."""
        m = self.learn(url, node_id)
        if m is not None:
            if not m.alive or m.node_id != node_id:
                self._version += 1
            m.node_id = node_id
            m.alive, m.failures, m.last_seen = True, 0, self.clock.monotonic()

    def _down(self, m: Member) -> None:
        if m.alive:
            m.alive = False
            m.extra["down_at"] = self.clock.monotonic()
            self._version += 1
            # Requests still waiting on a member that just left HRW would otherwise sit out
            # their timeouts (a request parked at a dead owner: wait + 10 s of silence).
            for t in list(m.requests):
                t.cancel()

    def mark_failed(self, url: str) -> None:
        """Event: a request to the member failed; ``FAIL_LIMIT`` in a row take it out of HRW."""
        m = self.members.get(url.rstrip("/"))
        if m is not None:
            m.failures += 1
            if m.failures >= self.FAIL_LIMIT:
                self._down(m)
            if m.failures >= self.FORGET_AFTER and not m.static:
                del self.members[m.url]
                self._version += 1

    def mark_dead(self, url: str) -> None:
        """Event: SWIM confirmed the member dead (or forgot it): out of HRW at once."""
        m = self.members.get(url.rstrip("/"))
        if m is not None:
            m.failures = max(m.failures, self.FAIL_LIMIT)
            self._down(m)

    def forget(self, url: str) -> None:
        """Drop a learned member (SWIM forgot it); static ones stay, not alive."""
        m = self.members.get(url.rstrip("/"))
        if m is not None:
            self._down(m)
            if not m.static:
                del self.members[m.url]
                self._version += 1

    def penalise(self, url: str, seconds: float) -> None:
        """Event: the member sent bad bytes. It leaves the live set for ``seconds``, and every
        chunk request in flight to it is cancelled at once (the askers go elsewhere); requests
        still queued for it see :meth:`Member.penalised` and go elsewhere too."""
        m = self.members.get(url.rstrip("/"))
        if m is not None:
            m.penalty_until = self.clock.monotonic() + seconds
            self._version += 1
            for t in list(m.requests):
                t.cancel()

    def redirected(self, m: Member) -> bool:
        """True when requests queued for ``m`` must go elsewhere: penalised, or out of the live set."""
        return not m.usable(self.clock.monotonic())

    def node_of(self, url: str) -> str:
        """The node id known for the member at ``url`` ("" if none)."""
        m = self.members.get(url.rstrip("/"))
        return m.node_id if m is not None else ""

    def live(self) -> list[Member]:
        """The usable members, one per node id: a daemon reached under two URLs (a static peer
        URL and the URL it advertises, e.g. an IP and a host name) is one member for HRW, for
        the counts and for the exchanges; the static entry, else the one seen last, speaks for it.

        Computed once per transition (and when a penalty expires), not per call: callers ask
        per chunk request."""
        now = self.clock.monotonic()
        c = self._cache
        if c is not None and c[0] == self._version and now < c[1]:
            return list(c[2])
        best: dict[str, Member] = {}
        valid_until = float("inf")
        for m in self.members.values():
            if m.penalty_until > now:
                valid_until = min(valid_until, m.penalty_until)
            if not m.usable(now):
                continue
            cur = best.get(m.node_id)
            if cur is None or (m.static, m.last_seen) > (cur.static, cur.last_seen):
                best[m.node_id] = m
        live = list(best.values())
        ids = tuple(sorted(best))
        if ids != self._cache_ids:
            self._cache_ids = ids
            self.epoch += 1
        self._cache = (self._version, valid_until, live)
        return list(live)

    def by_node(self) -> dict[str, Member]:
        return {m.node_id: m for m in self.live()}

    def hrw_nodes(self) -> list[str]:
        """Node ids that take part in HRW: this daemon and every live member."""
        return [self.self_id] + [m.node_id for m in self.live()]

    def owner_map(self, identity: str, readers: int | None = None, digests: Sequence[str] | None = None) -> OwnerMap:
        """HRW owners of ``identity``'s chunks over this epoch's live set (this daemon included),
        built once per epoch and memoised per chunk (``bdn.control.owners``): what the fetcher
        and the serving side can ask per chunk instead of ranking every node each time.
        ``readers``: how many of the live nodes read the bucket (None: all); ``digests`` (manifest
        order): bounded loads among them (the fetcher's rule, ``bdn.control.owners.owner_table``)."""
        nodes = self.hrw_nodes()  # refreshes the epoch
        return self._owners.get(self.epoch, nodes, identity, readers, digests)

    def describe(self) -> list[dict]:
        """The members for ``/v1/status`` and ``bdnctl peers``, one row per node id (a daemon
        reached under two URLs is one row, its other URLs under ``also``; members that never
        answered are listed by URL): ``{node_id, url, alive, penalised, also}``, sorted by URL."""
        now = self.clock.monotonic()
        groups: dict[str, list[Member]] = {}
        for m in self.members.values():
            groups.setdefault(m.node_id or "\0" + m.url, []).append(m)
        rows = []
        for ms in groups.values():
            head = max(ms, key=lambda m: (m.alive, m.static, m.last_seen))
            rows.append(
                {
                    "node_id": head.node_id,
                    "url": head.url,
                    "alive": any(m.alive for m in ms),
                    "penalised": any(now < m.penalty_until for m in ms),
                    "also": sorted(m.url for m in ms if m is not head),
                }
            )
        return sorted(rows, key=lambda r: r["url"])
