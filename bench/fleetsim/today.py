"""Today's bdnd as a chunk-source policy for bench/fleetsim (the validation against bench/swarm).

A model of bdn/daemon's fetch path with its config defaults: every live node is an owner (HRW
over all), reads its chunks from the bucket ``bucket_concurrency`` (4) at a time in manifest
order; the other chunks are asked, ``max_inflight`` (16) at a time and at most
``today_per_peer`` (4) per peer, from a holder known from have-bitfields polled from every
peer every 0.5 s, else from the owner, which holds the request until it has the chunk; a
holder with all ``max_uploads`` (8) slots busy, or already sending that chunk to
``uploads_per_chunk`` (2) peers, answers 503 and the asker tries again 0.1-0.5 s later.
Membership messages are counted as today's code sends them (every 2-3 s to every member), not
simulated; a dead member is forgotten after about two rounds (5 s).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from bdn.control.hotload import TargetGossip
from bdn.control.owners import OwnerCache
from bdn.control.peerset import PeerSet
from bdn.daemon.serve.uploads import Uploads
from bench.fleetsim.sim import FleetSim, SimNode


class TodaySim(FleetSim):
    policy = "today"

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self._epoch = 0  # membership changes seen (owners are recomputed on each)
        self._forgotten: set[str] = set()

    def reader_count(self, live_n: int) -> int | None:
        return None  # every live node reads

    def synced(self, nd: SimNode) -> bool:
        return True

    def owner_map(self, nd: SimNode) -> Any:
        if nd.omap is not None and nd.omap.epoch == self._epoch:
            return nd.omap
        live = tuple(n for n, x in self.nodes.items() if x.alive and n not in self._forgotten)
        return self._map_for(nd, self._epoch, live)

    # ---- nodes and the run ------------------------------------------------------------------
    def add_node(self, nid: str, seeds: list[str]) -> SimNode:
        nd = SimNode(nid, self.sc.nic_bps * self.sc.wire_payload)
        nd.joined_at = self.env.now
        nd.owners = OwnerCache()
        nd.upl = Uploads(self.sc.max_uploads, self.sc.uploads_per_chunk)
        nd.gossip = TargetGossip(nid, lambda: self.env.now, random.Random(self.rng.random()))
        self.nodes[nid] = nd
        self.n_live += 1
        return nd

    def begin(self) -> None:
        for nid in self.initial:
            self.add_node(nid, [])
        entry = self.nodes[self.initial[0]]
        for nd in self.nodes.values():  # the POST fans out to every peer
            entry.ctrl_sent += 1
            self._adopt(nd)
        self.env.process(self._meter())

    def join_late(self, nid: str, live: list[str]) -> None:
        nd = self.add_node(nid, [])
        self._epoch += 1
        self._adopt(nd)

    def _adopt(self, nd: SimNode) -> None:
        nd.gossip.offer(self.target, ())
        nd.adopted_at = self.env.now
        self.start_download(nd)

    def start_download(self, nd: SimNode) -> None:
        sc = self.sc
        nd.ps = PeerSet(
            nd.id,
            sc.chunks,
            lambda: self.env.now,
            rng=random.Random(self.rng.random()),
            k=256,
            max_peers=256,
            reader_slots=0,
        )  # today: every peer
        nd.unavail_t = np.full(sc.chunks, np.inf)
        self.plan_bucket(nd)
        self.env.process(self._poller(nd))
        self.kick(nd)

    # ---- today's fetch loop ---------------------------------------------------------------
    def _poller(self, nd: SimNode) -> Any:
        """Have-bitfields of every live peer every 0.5 s (stale in between), and the counts."""
        holders: dict[str, np.ndarray] = {}
        while nd.alive and not nd.ps.complete:
            for x in self.nodes.values():
                if x is not nd and x.alive and x.ps is not None:
                    holders[x.id] = x.ps.held.copy()
            nd.ps.peers.clear()
            nd.ps.avail[:] = 0
            for pid, h in holders.items():
                if self.nodes[pid].alive:
                    nd.ps.accept(pid)
                    nd.ps.on_bitfield(pid, h)
            self.kick(nd)
            yield self.env.timeout(0.5)

    def fill(self, nd: SimNode) -> None:
        """``max_inflight`` tasks, each a chunk in manifest order, retried until it arrives."""
        ps = nd.ps
        while len(nd.tasks) < self.sc.max_inflight:
            cand = np.flatnonzero(~ps.held & ~ps.inflight & ~ps.owned)
            if cand.size == 0:
                return
            i = int(cand[0])
            ps.mark_inflight(i)
            nd.tasks.add(i)
            self._try(nd, i)

    def _try(self, nd: SimNode, i: int) -> None:
        sc, ps = self.sc, nd.ps
        if not nd.alive:
            return
        if ps.held[i]:
            nd.tasks.discard(i)
            ps.inflight[i] = False
            self.kick(nd)
            return
        holders = [p for p in ps.holders(i) if nd.load[p] < sc.today_per_peer]
        if holders:
            holders.sort(key=lambda p: (nd.load[p], self.rng.random()))
            peer, wait = holders[0], False
        else:
            peer, wait = self.owner_map(nd).owner(self.digests[i]), True
            if peer == nd.id or nd.load[peer] >= sc.today_per_peer:
                self.later(0.1 + 0.4 * self.rng.random(), self._try, nd, i)
                return
        self.request(nd, peer, i, wait, lambda ok, nd=nd, i=i: self._done(nd, i, ok))

    def _done(self, nd: SimNode, i: int, ok: bool) -> None:
        if ok or nd.ps.held[i]:
            nd.tasks.discard(i)
            nd.ps.inflight[i] = False
            return
        nd.ps.mark_inflight(i)  # the task keeps its chunk and tries again
        self.later(0.1 + 0.4 * self.rng.random(), self._try, nd, i)

    # ---- faults and counts ------------------------------------------------------------------
    def kill(self, nd: SimNode) -> None:
        super().kill(nd)
        self.later(2 * 2.5, self._forget, nd.id)

    def _forget(self, nid: str) -> None:
        self._forgotten.add(nid)
        self._epoch += 1
        for x in self.nodes.values():
            if x.alive and x.ps is not None:
                self.plan_bucket(x)
                self.kick(x)

    def _meter(self) -> Any:
        """Today's control messages, counted as its loops send them (not simulated)."""
        while True:
            yield self.env.timeout(0.5)
            live = [x for x in self.nodes.values() if x.alive]
            per = len(live) - 1
            for x in live:
                # membership: a POST to every member every 2.5 s on average (and its answer)
                x.ctrl_sent += per * 0.5 / 2.5
                x.ctrl_recv += per * 0.5 / 2.5
                if x.ps is not None and not x.ps.complete:
                    x.ctrl_sent += per  # have-bitfield GET to every live peer every 0.5 s
                    x.ctrl_recv += per
