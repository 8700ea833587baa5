"""What the live peers hold of each snapshot: their have-bitfields.

Two ways in, per peer, for a download in progress:

- *pushed* (the transfer wire, ``bdn.transfer.announce``): the node subscribes, per snapshot, to
  the peers of a bounded peer set (``bdn.control.peerset.PeerSet``: at most ``k`` peers, chosen
  at random among the live ones with a transfer address, dropped when they left or stayed
  useless); each sends its bitfield once, then a HAVE as chunks are verified there, so the
  fetcher learns of a new holder within one round trip and a waiting acquisition is woken
  (:meth:`wait_holder`) instead of sleeping and polling;
- *polled* (``GET snapshots/{identity}/have``): once when a download starts (every live peer),
  then every ``POLL_S`` only for the peers without a synchronised subscription (no transfer
  address, or its subscription is (re)connecting).

Untrusted: a bitfield that does not fit the manifest's chunk counts is dropped, and so is a
subscription that announces an index outside them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from bdn.control.peerset import PeerSet
from bdn.daemon.observe.stats import Stats
from bdn.daemon.serve.transfer_address import peer_of
from bdn.daemon.snapshots.snapshot import STORED, SnapshotJob
from bdn.daemon.store.bitfield import Bitfield
from bdn.daemon.swarm.membership import Member, Membership
from bdn.daemon.swarm.peer_client import PeerClient, PeerError
from bdn.proto.wire import HAVE_GROWING
from bdn.transfer import Peer
from bdn.transfer.announce import OnEnd, OnHave

log = logging.getLogger("bdn.fetch")
POLL_S = 0.5
#: Chunks per snapshot tracked as growing at some peer (bounds what a lying peer can add).
MAX_GROWING = 4096
#: Peers one node subscribes to per snapshot (so control state and messages per node are O(K), not O(N)).
PEERSET_K = 24


class Subscriptions(Protocol):
    """HAVE subscriptions to peers over the transfer wire (``bdn.transfer.announce.HaveSubscriber``)."""

    def subscribed(self, peer: Peer, identity: str) -> bool:
        """Whether a subscription to ``peer`` for ``identity`` is open."""
        ...

    def subscribe(self, peer: Peer, identity: str) -> bool:
        """Open one (its frames go to the ``on_have``/``on_end`` it was made with)."""
        ...

    def unsubscribe(self, peer: Peer, identity: str) -> None:
        """Close that subscription."""
        ...

    def close(self) -> None:
        """Close every subscription."""
        ...


class Haves:
    """Per snapshot identity, per peer url: ``(stored, result)`` bitfields as last reported.

    ``subscriptions(on_have, on_end)`` makes the HAVE subscriber whose frames feed these
    bitfields (None: every peer is polled; bdnd always passes its wire's); ``stats`` counts have
    polls and HAVE frames as control requests."""

    def __init__(
        self,
        peers: PeerClient,
        membership: Membership,
        k: int = PEERSET_K,
        stats: Stats | None = None,
        subscriptions: Callable[[OnHave, OnEnd], Subscriptions] | None = None,
    ) -> None:
        self.peers = peers
        self.stats = stats
        self.membership = membership
        self.k = k
        self._by_identity: dict[str, dict[str, tuple[Bitfield, Bitfield]]] = {}
        self._sizes: dict[str, tuple[int, int]] = {}
        self._sets: dict[str, PeerSet] = {}
        self._synced: set[tuple[str, str]] = set()  # (identity, node id): bitfield received, HAVEs flowing
        self._waiters: dict[tuple[str, str, int], asyncio.Event] = {}
        #: identity -> chunk index -> urls of the peers that stored chunk lands at now (its owner's
        #: bucket read; HAVE of layer ``wire.HAVE_GROWING``): cut-through candidates until
        #: they hold it
        self._growing: dict[str, dict[int, set[str]]] = {}
        #: identity -> growing chunks announced while no acquisition of ours waited for them
        #: (the fetcher's cut-through workers take them at once: :meth:`next_growing`)
        self._fresh: dict[str, asyncio.Queue[int]] = {}
        self.subscriber = subscriptions(self.on_have, self.on_end) if subscriptions is not None else None
        #: The event loop the subscriber's threads hand frames to (taken at the first subscription).
        self.loop: asyncio.AbstractEventLoop | None = None
        self.polls = 0  # have requests sent over HTTP (a metric)
        self.pushed = 0  # chunk indices learned from HAVE frames

    # ---- polled -------------------------------------------------------------------------------
    async def refresh(self, job: SnapshotJob, need_result: bool = False, only_unsynced: bool = False) -> bool:
        """Ask the live peers what they hold of ``job`` (``only_unsynced``: those without a
        synchronised subscription); True if ``need_result`` and one holds every rebuilt chunk
        (result mode only pays off when some peer rebuilt the whole target)."""
        haves = self._by_identity.setdefault(job.identity, {})
        ns, nr = len(job.stored_refs), len(job.result_refs)
        self._sizes[job.identity] = (ns, nr)

        async def one(m: Member) -> None:
            self.polls += 1
            if self.stats is not None:
                self.stats.control_request("sent", "have_poll")
            try:
                h = await self.peers.get_have(m.url, job.identity)
            except PeerError:
                return
            if not h:
                return
            try:
                if h.get("ns") != ns or h.get("nr") != nr:
                    return
                got = (Bitfield(ns, h.get("stored")), Bitfield(nr, h.get("result")))
            except (ValueError, TypeError):
                return
            old = haves.get(m.url)
            if old is not None and (job.identity, m.node_id) in self._synced:
                return  # pushed HAVEs are newer than this answer
            haves[m.url] = got
            self._wake_all(job.identity, got)

        live = self.membership.live()
        if only_unsynced:
            live = [m for m in live if (job.identity, m.node_id) not in self._synced]
        await asyncio.gather(*(one(m) for m in live))
        return any(r.complete for _, r in haves.values()) if need_result else False

    async def poll(self, job: SnapshotJob) -> None:
        """Keep the bitfields for ``job`` fresh until cancelled: subscriptions kept to the peer
        set, the others polled every ``POLL_S``."""
        self.loop = asyncio.get_running_loop()  # where the subscriber's threads hand frames to
        try:
            self.subscribe(job)  # at once: the HAVEs flow from the download's first chunk on
        except Exception:
            log.debug("have subscription failed", exc_info=True)
        while True:
            await asyncio.sleep(POLL_S)
            try:
                self.subscribe(job)
                await self.refresh(job, only_unsynced=self.subscriber is not None)
            except Exception:
                log.debug("have refresh failed", exc_info=True)

    def forget(self, identity: str) -> None:
        """Drop what peers reported of ``identity`` (its download ended) and its subscriptions."""
        self._by_identity.pop(identity, None)
        self._sizes.pop(identity, None)
        self._growing.pop(identity, None)
        self._fresh.pop(identity, None)
        ps = self._sets.pop(identity, None)
        if ps is not None and self.subscriber is not None:
            by_node = self.membership.by_node()
            for node in ps.peers:
                m = by_node.get(node)
                p = peer_of(m) if m is not None else None
                if p is not None:
                    self.subscriber.unsubscribe(p, identity)
        self._synced = {s for s in self._synced if s[0] != identity}

    def close(self) -> None:
        """Close every HAVE subscription (the daemon stops; its fetches end)."""
        if self.subscriber is not None:
            self.subscriber.close()

    @property
    def tracked(self) -> int:
        """How many snapshots' bitfields are held (one per download in progress)."""
        return len(self._by_identity)

    def holding(self, job: SnapshotJob, layer: str, index: int) -> list[str]:
        """Urls of the peers whose last bitfield of ``layer`` shows chunk ``index`` of ``job``."""
        out = []
        for url, h in self._by_identity.get(job.identity, {}).items():
            bits = h[0] if layer == STORED else h[1]
            if bits.n > index and bits[index]:
                out.append(url)
        return out

    async def next_growing(self, job: SnapshotJob) -> int:
        """The next stored chunk of ``job`` a peer announced growing while no acquisition here
        waited for it (waits until there is one; the fetcher's cut-through workers)."""
        q = self._fresh.get(job.identity)
        if q is None:
            q = self._fresh[job.identity] = asyncio.Queue()
        return await q.get()

    def not_growing(self, job: SnapshotJob, index: int, url: str) -> None:
        """Forget that ``url`` grows stored chunk ``index`` of ``job`` (asked, it did not send
        it): a wrong or stale announcement is asked once, not first in every round."""
        grow = self._growing.get(job.identity)
        at = grow.get(index) if grow else None
        if grow and at is not None:
            at.discard(url)
            if not at:
                del grow[index]

    def synced(self, job: SnapshotJob, node_id: str) -> bool:
        """Whether ``node_id``'s HAVE subscription for ``job`` is synchronised (its HAVEs and
        HAVE_GROWINGs reach this node as they happen)."""
        return (job.identity, node_id) in self._synced

    def growing_at(self, job: SnapshotJob, layer: str, index: int) -> list[str]:
        """Urls of the peers that announced stored chunk ``index`` of ``job`` landing there now
        (its owner reading it from the bucket) and do not hold
        it yet: they answer a cut-through ASK at once."""
        if layer != STORED:
            return []
        return list(self._growing.get(job.identity, {}).get(index, ()))

    # ---- pushed -------------------------------------------------------------------------------
    def subscribe(self, job: SnapshotJob) -> None:
        """Keep HAVE subscriptions for ``job`` to the peers of its peer set (no-op without the wire)."""
        sub = self.subscriber
        if sub is None or job.foreign is not None:
            return
        ident = job.identity
        ns, nr = len(job.stored_refs), len(job.result_refs)
        self._sizes[ident] = (ns, nr)
        ps = self._sets.get(ident)
        if ps is None:
            ps = self._sets[ident] = PeerSet(
                self.membership.self_id,
                max(ns, 1),
                self.membership.clock.monotonic,
                k=self.k,
                max_peers=max(self.k, 32),
                reader_slots=0,
                idle_s=1e9,
            )
        by_node = {m.node_id: m for m in self.membership.live() if peer_of(m) is not None}
        before = set(ps.peers)
        ps.refresh(list(by_node), is_live=by_node.__contains__)
        for node in before - set(ps.peers):
            self._synced.discard((ident, node))
        haves = self._by_identity.setdefault(ident, {})
        for node in ps.peers:
            m = by_node.get(node)
            p = peer_of(m) if m is not None else None
            if m is not None and p is not None and not sub.subscribed(p, ident):
                haves.setdefault(m.url, (Bitfield(ns), Bitfield(nr)))
                sub.subscribe(p, ident)

    def on_have(self, node_id: str, identity: str, layer: int, indices: tuple[int, ...]) -> None:
        """A HAVE frame from ``node_id`` (subscription thread): handled on the event loop."""
        loop = self.loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._have, node_id, identity, layer, indices)

    def on_end(self, node_id: str, identity: str, error: str) -> None:
        """A subscription ended (subscription thread): its peer is polled again until it resubscribes."""
        loop = self.loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._synced.discard, (identity, node_id))

    def _have(self, node_id: str, identity: str, layer: int, indices: tuple[int, ...]) -> None:
        haves = self._by_identity.get(identity)
        m = self.membership.by_node().get(node_id)
        if self.stats is not None:
            self.stats.control_request("received", "have_frame")
        if haves is None or m is None:
            return
        if not indices:
            self._synced.add((identity, node_id))  # the bitfield was sent whole; HAVEs follow
            return
        ns, nr = self._sizes.get(identity, (0, 0))
        entry = haves.setdefault(m.url, (Bitfield(ns), Bitfield(nr)))
        bits = entry[1] if layer == 1 else entry[0]
        if layer == 1 and bits.n == 0:
            # rebuilt chunks of a snapshot this node takes only the stored layer of (a delta it
            # folds): nothing to track, and no lie (dropping the subscription here lost the
            # stored HAVEs of every peer that rebuilds it: tests/test_swarm.py)
            return
        if max(indices) >= bits.n:
            log.debug(
                "peer %s announced chunk %d of %s outside the manifest; subscription dropped",
                node_id,
                max(indices),
                identity,
            )
            p = peer_of(m)
            if p is not None and self.subscriber is not None:
                self.subscriber.unsubscribe(p, identity)
            return
        if layer == HAVE_GROWING:
            self._grow(identity, m.url, ns, indices)
            return
        lay = STORED if layer == 0 else "result"
        ps = self._sets.get(identity)
        grow = self._growing.get(identity) if layer == 0 else None
        for i in indices:
            if grow:
                at = grow.get(i)
                if at is not None:
                    at.discard(m.url)
                    if not at:
                        del grow[i]
            if bits.set(i):
                self.pushed += 1
                ev = self._waiters.get((identity, lay, i))
                if ev is not None:
                    ev.set()
        if ps is not None and layer == 0 and node_id in ps.peers:
            ps.on_have(node_id, [int(i) for i in indices])

    def _grow(self, identity: str, url: str, ns: int, indices: tuple[int, ...]) -> None:
        """Peer ``url`` reads ``indices`` from the bucket now: cut-through candidates; wake the
        acquisitions waiting for them. At most ``MAX_GROWING`` chunks tracked per snapshot (an
        honest owner has a few in flight; more are dropped, they still arrive as HAVEs)."""
        grow = self._growing.setdefault(identity, {})
        for i in indices:
            if i >= ns or (i not in grow and len(grow) >= MAX_GROWING):
                continue
            grow.setdefault(i, set()).add(url)
            ev = self._waiters.get((identity, STORED, i))
            if ev is not None:
                ev.set()
            else:
                q = self._fresh.get(identity)
                if q is not None and q.qsize() < MAX_GROWING:
                    q.put_nowait(i)

    def _wake_all(self, identity: str, got: tuple[Bitfield, Bitfield]) -> None:
        for (ident, lay, i), ev in self._waiters.items():
            bits = got[0] if lay == STORED else got[1]
            if ident == identity and i < bits.n and bits[i]:
                ev.set()

    def wake(self, key: tuple[str, str, int]) -> None:
        """End the :meth:`wait_holder` sleep of ``(identity, layer, index)``, if one sleeps."""
        ev = self._waiters.get(key)
        if ev is not None:
            ev.set()

    async def wait_holder(self, job: SnapshotJob, layer: str, index: int, timeout: float) -> None:
        """Sleep up to ``timeout`` s, less if a peer announces chunk ``index`` of ``layer`` meanwhile."""
        key = (job.identity, layer, index)
        ev = self._waiters.get(key)
        if ev is None:
            ev = self._waiters[key] = asyncio.Event()
        try:
            await asyncio.wait_for(ev.wait(), timeout)
        except TimeoutError:
            pass
        finally:
            if self._waiters.get(key) is ev:
                del self._waiters[key]
