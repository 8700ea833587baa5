"""One fleet simulation: N simulated nodes running bdn's own control policies over simpy.

The policies are not re-implemented here: every node holds a :class:`bdn.control.swim.Swim`,
a :class:`bdn.control.peerset.PeerSet` for the snapshot, an :class:`bdn.control.owners.OwnerCache`
and a :class:`bdn.control.hotload.TargetGossip`, exactly the objects the daemon uses, with
simpy's clock injected; this module only delivers their messages (one-way delay = RTT/2 plus
jitter) and moves chunk bytes over :mod:`bench.fleetsim.net`.

Two chunk-source policies:

- ``today``: a model of today's daemon (bdn/daemon/node.py): every live node is an owner (HRW
  over all), reads its chunks from the bucket ``bucket_concurrency`` (4) at a time in manifest
  order; the other chunks are asked, ``max_inflight`` (16) at a time and at most ``max_per_peer``
  (4) per peer, from a holder known from have-bitfields polled from every peer every 0.5 s, else
  from the owner, which holds the request until it has the chunk; a holder with all
  ``max_uploads`` (8) slots busy, or already sending that chunk to ``uploads_per_chunk`` (2)
  peers, answers 503 and the asker tries again 0.1-0.5 s later. Membership messages are counted
  as today's code sends them (every 2-3 s to every member), not simulated.
- ``fleet``: the new control plane: SWIM membership, bucket readers per snapshot
  (:func:`bdn.control.owners.reader_count`), bounded peer sets with BITFIELD/HAVE and
  rarest-first, hot-load gossip; a node asks a chunk's owner directly only when no peer of its
  set has had it for ``owner_ask_after_s``.

Sizes: the snapshot's bytes are real; the chunk count is scaled down (a simulated chunk stands
for ``g`` real chunks read from the bucket by ``g`` parallel ranged GETs, so its per-connection
cap is ``g`` times the bucket's); see :class:`Scenario`.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import simpy

from bdn.control.hotload import Target, TargetGossip
from bdn.control.owners import OwnerCache, reader_count
from bdn.control.peerset import PeerSet
from bdn.control.swim import Message, Swim
from bench.fleetsim.net import Link, Network

REAL_CHUNK = 16 << 20


@dataclass
class Scenario:
    """One simulated run. Rates in bytes per second, times in seconds."""

    name: str
    n: int
    snapshot_bytes: float
    chunks: int  # simulated chunks (the real snapshot has snapshot_bytes / 16 MiB)
    nic_bps: float
    bucket_bps: float
    bucket_conn_bps: float = 0.0  # 0: no per-connection limit
    rtt_s: float = 0.0002
    jitter_s: float = 0.0001
    policy: str = "fleet"
    kill_frac: float = 0.0
    kill_at_floor: float = 0.5  # deaths at this fraction of the floor
    late_frac: float = 0.0
    late_at_floor: float = 0.25
    seed: int = 1
    # fleet policy knobs
    k: int = 16
    max_peers: int = 32
    reader_slots: int = 4
    download_slots: int = 8
    reader_connections: int = 4
    max_uploads: int = 8
    max_per_peer: int = 2
    upload_queue: int = 8  # requests a holder keeps waiting for a slot before it answers busy
    have_flush_s: float = 0.1
    owner_ask_after_s: float = 2.0
    swim_period_s: float = 1.0
    suspect_mult: float = 4.0
    # today policy knobs (bdn/daemon/config.py defaults)
    bucket_concurrency: int = 4
    max_inflight: int = 16
    uploads_per_chunk: int = 2
    today_per_peer: int = 4
    time_limit_s: float = 3600.0
    data: bool = True  # False: membership and hot-load only (no chunks): the control plane at scale
    min_sim_s: float = 0.0  # run at least this long (control rates over a steady window)

    @property
    def chunk_bytes(self) -> float:
        return self.snapshot_bytes / self.chunks

    @property
    def real_chunks_per_chunk(self) -> float:
        return max(1.0, self.chunk_bytes / REAL_CHUNK)

    @property
    def floor_s(self) -> float:
        """S over the narrower of one NIC and the bucket: no schedule can beat it."""
        return self.snapshot_bytes / min(self.nic_bps, self.bucket_bps)


class SimNode:
    __slots__ = (
        "id", "alive", "up", "down", "swim", "ps", "gossip", "owners", "ctrl_sent", "ctrl_recv",
        "done_at", "joined_at", "uploads", "uploads_by_chunk", "load", "wake", "bucket_queue",
        "reading", "flows", "adopted_at", "owner_wait", "unavail_since", "have_pending", "started",
        "state_peak", "omap", "nreaders", "inherited", "unreachable", "upq", "busy",
    )

    def __init__(self, nid: str, env: simpy.Environment, nic: float) -> None:
        self.id = nid
        self.alive = True
        self.up = Link(nid + "/up", nic)
        self.down = Link(nid + "/down", nic)
        self.ctrl_sent = 0
        self.ctrl_recv = 0
        self.done_at: float | None = None
        self.joined_at = 0.0
        self.uploads = 0
        self.uploads_by_chunk: Counter = Counter()
        self.load: Counter = Counter()
        self.wake: list = []  # idle workers' events
        self.bucket_queue: list[int] = []
        self.reading: set[int] = set()
        self.flows: set = set()
        self.adopted_at: float | None = None
        self.owner_wait: dict[int, list] = {}
        self.unavail_since: dict[int, float] = {}
        self.have_pending = False
        self.started = False
        self.state_peak = 0
        self.omap = None
        self.nreaders = 0
        self.inherited: set[int] = set()
        self.unreachable: set[str] = set()
        self.upq: list = []  # requests held until an upload slot frees (FIFO, bounded)
        self.busy: dict[str, float] = {}  # peer -> until when it said "busy" (skip it)


class FleetSim:
    """Build with a :class:`Scenario`, call :meth:`run`, read the result dict."""

    def __init__(self, sc: Scenario) -> None:
        self.sc = sc
        self.env = simpy.Environment()
        self.net = Network(self.env)
        self.rng = random.Random(sc.seed)
        self.bucket = Link("bucket", sc.bucket_bps)
        conn = sc.bucket_conn_bps * sc.real_chunks_per_chunk if sc.bucket_conn_bps else math.inf
        self.conn_cap = conn
        self.nodes: dict[str, SimNode] = {}
        self.digests = [f"{i:032x}" for i in range(sc.chunks)]
        self.identity = "step000001"
        self.bucket_reads: Counter = Counter()
        self.bucket_bytes = 0.0
        self.log: list[tuple[float, str, str]] = []  # (t, node, event): the run's event log
        self.target = Target(1, 1.7e9, self.identity)
        self.post_at = 0.0
        self.owner_cache_rebuilds = 0
        self._maps: dict[tuple, Any] = {}
        self._forgotten: set[str] = set()
        n_late = int(round(sc.n * sc.late_frac))
        self.initial = [f"n{i:05d}" for i in range(sc.n - n_late)]
        self.late = [f"n{i:05d}" for i in range(sc.n - n_late, sc.n)]

    # ---- plumbing ---------------------------------------------------------------------------
    def delay(self) -> float:
        return self.sc.rtt_s / 2 + self.rng.random() * self.sc.jitter_s

    def later(self, dt: float, fn: Any, *args: Any) -> None:
        ev = self.env.timeout(dt)
        ev.callbacks.append(lambda _e: fn(*args))

    def event(self, node: str, what: str) -> None:
        if len(self.log) < 200_000:
            self.log.append((round(self.env.now, 4), node, what))

    def wake_or(self, nd: SimNode, timeout: float) -> simpy.Event:
        """An event for an idle worker: the node's next kick (one idle worker per kick) or a
        timeout. A woken worker that finds work kicks the next, so all wake only if needed."""
        ev = self.env.event()
        nd.wake.append(ev)
        return ev | self.env.timeout(timeout)

    def kick(self, nd: SimNode) -> None:
        while nd.wake:
            ev = nd.wake.pop()
            if not ev.triggered:
                ev.succeed()
                return

    # ---- membership (fleet) -----------------------------------------------------------------
    def send_swim(self, msgs: list[Message]) -> None:
        for m in msgs:
            src = self.nodes.get(m.src)
            if src is not None:
                src.ctrl_sent += 1
            if self.target is not None and src is not None and src.gossip is not None and src.gossip.current:
                m = Message(m.kind, m.src, m.dst, m.seq, m.target, m.updates, src.gossip.piggyback())
            self.later(self.delay(), self.deliver_swim, m)

    def deliver_swim(self, m: Message) -> None:
        dst = self.nodes.get(m.dst)
        if dst is None or not dst.alive or dst.swim is None:
            return
        dst.ctrl_recv += 1
        before = dst.swim.epoch
        out = dst.swim.receive(m)
        if m.extra is not None:
            self.offer_target(dst, Target.from_wire(m.extra))
        self.send_swim(out)
        if dst.swim.epoch != before:
            self.on_epoch(dst)

    def swim_loop(self, nd: SimNode) -> Any:
        while nd.alive:
            before = nd.swim.epoch
            self.send_swim(nd.swim.tick())
            if nd.swim.epoch != before:
                self.on_epoch(nd)
            yield self.env.timeout(max(1e-4, nd.swim.next_deadline() - self.env.now))

    def on_epoch(self, nd: SimNode) -> None:
        if nd.ps is not None and nd.alive:
            if len(nd.ps.peers) < nd.ps.k or any(not nd.swim.is_live(p) for p in nd.ps.peers):
                self.refresh_peers(nd)
            before = nd.omap
            m = self.owner_map(nd)
            if m is not before:
                self.event(nd.id, "owners moved")
                self.plan_bucket(nd)
            self.kick(nd)

    # ---- hot-load (fleet) -------------------------------------------------------------------
    def offer_target(self, nd: SimNode, t: Target) -> None:
        live = nd.swim.live() if nd.swim else tuple(self.nodes)
        push = nd.gossip.offer(t, live)
        if not push:
            return
        nd.adopted_at = self.env.now
        self.event(nd.id, "hot-load target adopted")
        for p in push:
            nd.ctrl_sent += 1
            self.later(self.delay(), self.deliver_target, p, t)
        if self.sc.data:
            self.start_download(nd)
        else:
            nd.done_at = self.env.now

    def deliver_target(self, dst_id: str, t: Target) -> None:
        dst = self.nodes.get(dst_id)
        if dst is None or not dst.alive or not dst.started:
            return
        dst.ctrl_recv += 1
        self.offer_target(dst, t)

    # ---- the download -----------------------------------------------------------------------
    def owner_map(self, nd: SimNode) -> Any:
        """This node's :class:`OwnerMap` for its current membership view.

        A map stays while the membership changes since it was built leave every owner where it
        was (:meth:`OwnerMap.affected_by`); nodes whose views are identical share one build
        (the map is a pure function of the view: memoising it saves simulator time only).
        """
        sc = self.sc
        if nd.swim is not None:
            changes, nd.swim.changes = nd.swim.changes, []
            if nd.omap is not None and not any(nd.omap.affected_by(c) for c in changes):
                return nd.omap
            live = nd.swim.live()
            epoch = nd.swim.epoch
        else:
            live = tuple(n for n, x in self.nodes.items() if x.alive and x.started and n not in self._forgotten)
            epoch = self._today_epoch
            if nd.omap is not None and nd.omap.epoch == epoch:
                return nd.omap
        if sc.policy == "fleet":
            r = reader_count(len(live), sc.bucket_bps, sc.bucket_conn_bps * sc.real_chunks_per_chunk if sc.bucket_conn_bps else 0,
                             connections_per_reader=sc.reader_connections)
        else:
            r = None
        key = (live, r)
        m = self._maps.get(key)
        if m is None:
            m = nd.owners.get(epoch, live, self.identity, r)
            self.owner_cache_rebuilds += 1
            self._maps[key] = m
            if len(self._maps) > 32:
                self._maps.pop(next(iter(self._maps)))
        nd.omap = m
        return m

    def start_download(self, nd: SimNode) -> None:
        if nd.ps is not None:
            return
        sc = self.sc
        k, mx = (sc.k, sc.max_peers) if sc.policy == "fleet" else (256, 256)  # today: every peer
        nd.ps = PeerSet(nd.id, sc.chunks, lambda: self.env.now, rng=random.Random(self.rng.random()),
                        k=k, max_peers=mx, reader_slots=sc.reader_slots, have_flush_s=sc.have_flush_s)
        self.plan_bucket(nd)
        if sc.policy == "fleet":
            self.refresh_peers(nd)
            for _ in range(sc.download_slots):
                self.env.process(self.fleet_worker(nd))
        else:
            self.env.process(self.today_poller(nd))
            for _ in range(sc.max_inflight):
                self.env.process(self.today_worker(nd))

    def plan_bucket(self, nd: SimNode) -> None:
        """The chunks this node owns now (membership epoch): read them, in order."""
        m = self.owner_map(nd)
        owned = np.zeros(self.sc.chunks, dtype=bool)
        # a joiner with a partial view takes no reader role until its first full sync
        mine = m.owned_by(nd.id, self.digests) if nd.swim is None or nd.swim.synced else []
        owned[mine] = True
        if self.sc.policy == "fleet" and nd.ps.owned is not None and (nd.ps.held.any() or nd.joined_at > 0):
            # chunks that became ours while the snapshot was under way: ask the former owner first
            nd.inherited |= {i for i in mine if not nd.ps.owned[i]}
        nd.ps.owned = owned
        queue = [i for i in mine if not nd.ps.held[i] and i not in nd.reading]
        new = [i for i in queue if i not in set(nd.bucket_queue)]
        nd.bucket_queue = [i for i in nd.bucket_queue if owned[i] and not nd.ps.held[i]] + new
        want = self.sc.bucket_concurrency if self.sc.policy == "today" else self.sc.reader_connections
        while nd.nreaders < want and nd.bucket_queue:
            nd.nreaders += 1
            self.env.process(self.bucket_reader(nd))

    def bucket_reader(self, nd: SimNode) -> Any:
        try:
            yield from self._read_bucket(nd)
        finally:
            nd.nreaders -= 1

    def _read_bucket(self, nd: SimNode) -> Any:
        while nd.alive and nd.bucket_queue:
            i = nd.bucket_queue.pop(0)
            if nd.ps.held[i] or i in nd.reading:
                continue
            if self.sc.policy == "fleet" and nd.ps.avail[i] > 0:
                # A peer holds it already (this node became its owner late: it joined, or the
                # old owner died after reading it): take it from the swarm, not the bucket.
                nd.ps.owned[i] = False
                self.kick(nd)
                continue
            nd.reading.add(i)
            nd.ps.mark_inflight(i)
            if i in nd.inherited:
                nd.inherited.discard(i)
                former = nd.omap.former_owner(self.digests[i], nd.id)
                if former is not None and former not in nd.unreachable:
                    ok = yield from self.ask(nd, former, i, wait=True)
                    if ok or nd.ps.held[i]:
                        nd.reading.discard(i)
                        continue
            if nd.ps.held[i]:
                nd.reading.discard(i)
                continue
            f = self.net.start(self.sc.chunk_bytes, (self.bucket, nd.down), self.conn_cap, tag=("bucket", nd.id, i))
            nd.flows.add(f)
            ok = yield f.done
            nd.flows.discard(f)
            moved = f.size - f.left
            self.bucket_bytes += moved
            nd.reading.discard(i)
            if not ok:
                return
            self.bucket_reads[i] += 1
            self.event(nd.id, f"bucket read {i} done" + (" again" if self.bucket_reads[i] > 1 else ""))
            self.got(nd, i, "bucket")

    def got(self, nd: SimNode, i: int, source: str) -> None:
        if nd.ps.held[i]:
            nd.ps.inflight[i] = False
            return
        nd.ps.got(i)
        nd.unavail_since.pop(i, None)
        for w in nd.owner_wait.pop(i, []):  # requests parked here while this node fetched
            if not w.triggered:
                w.succeed(True)
        if nd.ps.complete and nd.done_at is None:
            nd.done_at = self.env.now
            self.event(nd.id, "snapshot ready")
        if self.sc.policy == "fleet" and not nd.have_pending:
            nd.have_pending = True
            self.later(max(0.0, nd.ps.next_flush() - self.env.now), self.flush_have, nd)
        if nd.ps.complete or nd.ps.held.sum() == self.sc.chunks // 2:
            nd.state_peak = max(nd.state_peak, nd.ps.state_bytes())
        self.kick(nd)

    def flush_have(self, nd: SimNode) -> None:
        nd.have_pending = False
        if not nd.alive:
            return
        out = nd.ps.flush_haves(force=True)
        nd.ctrl_sent += len(out)
        if out:
            self.later(self.delay(), self.deliver_haves, nd.id, out)

    def deliver_haves(self, src: str, out: dict[str, list[int]]) -> None:
        for dst_id, idxs in out.items():
            dst = self.nodes.get(dst_id)
            if dst is None or not dst.alive or dst.ps is None:
                continue
            dst.ctrl_recv += 1
            dst.ps.on_have(src, idxs)
            self.kick(dst)

    def refresh_peers(self, nd: SimNode) -> None:
        m = self.owner_map(nd)
        dial = nd.ps.refresh(nd.swim.live(), m.readers, nd.swim.is_live)
        for p in dial:
            other = self.nodes.get(p)
            nd.ctrl_sent += 1
            if other is None or not other.alive or other.ps is None or not other.ps.accept(nd.id, m.is_reader(nd.id)):
                nd.ps.remove(p)
                continue
            other.ctrl_recv += 1
            other.ctrl_sent += 1
            nd.ctrl_recv += 1
            # BITFIELD each way (one message each, counted above), then HAVEs
            nd.ps.on_bitfield(p, other.ps.held)
            other.ps.on_bitfield(nd.id, nd.ps.held)
            self.kick(other)

    def upload_admit(self, src: SimNode, i: int) -> bool:
        if src.uploads >= self.sc.max_uploads:
            return False
        if self.sc.policy == "today" and src.uploads_by_chunk[i] >= self.sc.uploads_per_chunk:
            return False
        return True

    def transfer(self, src: SimNode, dst: SimNode, i: int) -> Any:
        """Move chunk ``i`` src -> dst (admission already granted); yields the flow's result."""
        src.uploads += 1
        src.uploads_by_chunk[i] += 1
        f = self.net.start(self.sc.chunk_bytes, (src.up, dst.down), tag=("peer", src.id, dst.id, i))
        src.flows.add(f)
        dst.flows.add(f)
        ok = yield f.done
        src.flows.discard(f)
        dst.flows.discard(f)
        src.uploads -= 1
        src.uploads_by_chunk[i] -= 1
        while src.upq and src.alive:
            w = src.upq.pop(0)
            if not w.triggered:
                w.succeed(True)  # the slot goes to the oldest held request
                break
        self.kick(src)  # a slot freed
        return ok

    def fleet_worker(self, nd: SimNode) -> Any:
        sc = self.sc
        while nd.alive and not nd.ps.complete:
            now = self.env.now
            load = nd.load
            if nd.busy:
                load = Counter(nd.load)
                for p, until in list(nd.busy.items()):
                    if until > now:
                        load[p] = sc.max_per_peer
                    else:
                        del nd.busy[p]
            picks = nd.ps.pick(1, load, sc.max_per_peer)
            if not picks:
                # nothing in the peer set: ask an owner for a chunk no peer has had for a while
                now = self.env.now
                idx = None
                om = self.owner_map(nd)
                for j in nd.ps.unavailable()[:64].tolist():
                    t0 = nd.unavail_since.setdefault(j, now)
                    # at once when its owner is known unreachable here (its connection reset)
                    if now - t0 >= sc.owner_ask_after_s or (nd.unreachable and om.owner(self.digests[j]) in nd.unreachable):
                        idx = j
                        break
                if idx is None:
                    yield self.wake_or(nd, sc.owner_ask_after_s)
                    continue
                owner = self.owner_map(nd).acting_owner(self.digests[idx], nd.unreachable)
                if owner is None or owner == nd.id:
                    nd.unavail_since[idx] = now
                    if owner == nd.id and idx not in nd.reading and idx not in nd.bucket_queue:
                        self.take_over(nd, idx)
                    yield self.wake_or(nd, sc.owner_ask_after_s)  # never spin at one instant
                    continue
                nd.ps.mark_inflight(idx)
                ok = yield from self.ask(nd, owner, idx, wait=True)
                if not ok:
                    nd.ps.failed(idx)
                    nd.unavail_since[idx] = self.env.now
                    if not self.nodes[owner].alive:
                        nd.unreachable.add(owner)  # connection refused: try the next reader
                continue
            i, peer = picks[0]
            self.kick(nd)  # there may be more: let one more idle worker look
            nd.load[peer] += 1
            ok = yield from self.ask(nd, peer, i, wait=False)
            nd.load[peer] -= 1
            if not ok:
                nd.ps.failed(i)
                if not (self.nodes[peer].alive):
                    nd.ps.remove(peer)  # connection reset: local knowledge, before SWIM agrees
                    nd.unreachable.add(peer)
                    self.refresh_peers(nd)
                else:
                    yield self.wake_or(nd, 0.05 + 0.1 * self.rng.random())

    def ask(self, nd: SimNode, peer_id: str, i: int, wait: bool) -> Any:
        """Request chunk ``i`` from ``peer_id``: True when it arrived here."""
        yield self.env.timeout(self.delay())
        src = self.nodes.get(peer_id)
        if src is None or not src.alive or src.ps is None:
            yield self.env.timeout(self.delay())
            return False
        if not src.ps.held[i]:
            if not wait:
                yield self.env.timeout(self.delay())
                return False
            if self.sc.policy == "fleet" and i not in src.reading and i not in src.bucket_queue:
                self.plan_bucket(src)
                if i not in src.reading and i not in src.bucket_queue:
                    yield from self.maybe_take_over(src, nd, i)
                if i not in src.reading and i not in src.bucket_queue:
                    yield self.env.timeout(self.delay())
                    return False  # not its chunk in its own view: 404, ask again later
            ev = self.env.event()
            src.owner_wait.setdefault(i, []).append(ev)
            res = yield ev | self.env.timeout(30.0)
            if ev not in res or not src.alive:
                return False
        if not self.upload_admit(src, i):
            if self.sc.policy == "fleet" and len(src.upq) < self.sc.upload_queue:
                ev = self.env.event()
                src.upq.append(ev)
                granted = yield ev
                if not granted or not src.alive or not nd.alive:
                    return False
            else:
                yield self.env.timeout(self.delay())
                nd.busy[peer_id] = self.env.now + 0.05
                return False
        ok = yield from self.transfer(src, nd, i)
        if ok and nd.alive:
            self.got(nd, i, peer_id)
        return bool(ok)

    def maybe_take_over(self, src: SimNode, asker: SimNode, i: int) -> Any:
        """``asker`` found chunk ``i``'s owner unreachable and asks ``src``, the next reader:
        ``src`` checks the owner itself (one probe, as SWIM's indirect ping) and, if it is
        unreachable from here too, reads the chunk from the bucket as its acting owner."""
        m = self.owner_map(src)
        owner = m.owner(self.digests[i])
        if owner is None or owner == src.id or owner not in asker.unreachable:
            return
        if m.acting_owner(self.digests[i], {owner}) != src.id:
            return
        yield self.env.timeout(self.sc.rtt_s)  # the probe
        if not self.nodes[owner].alive:
            src.unreachable.add(owner)
            self.take_over(src, i)

    def take_over(self, nd: SimNode, i: int) -> None:
        if nd.ps.held[i] or i in nd.reading or i in nd.bucket_queue:
            return
        self.event(nd.id, f"takes over chunk {i}")
        nd.ps.owned[i] = True
        nd.ps.inflight[i] = False
        nd.bucket_queue.insert(0, i)
        want = self.sc.reader_connections
        while nd.nreaders < want and nd.bucket_queue:
            nd.nreaders += 1
            self.env.process(self.bucket_reader(nd))

    # ---- today's daemon -------------------------------------------------------------------
    _today_epoch = 0  # today: membership changes seen (owners are recomputed on each)

    def today_poller(self, nd: SimNode) -> Any:
        """Have-bitfields of every live peer every 0.5 s (stale in between), and the counts."""
        holders: dict[str, np.ndarray] = {}
        nd_live = [x for x in self.nodes.values() if x.id != nd.id]
        while nd.alive and not nd.ps.complete:
            for x in nd_live:
                if x.alive and x.ps is not None:
                    holders[x.id] = x.ps.held.copy()
            nd.ps.peers.clear()
            nd.ps.avail[:] = 0
            for pid, h in holders.items():
                if self.nodes[pid].alive:
                    nd.ps.accept(pid)
                    nd.ps.on_bitfield(pid, h)
            self.kick(nd)
            yield self.env.timeout(0.5)

    def today_worker(self, nd: SimNode) -> Any:
        sc = self.sc
        while nd.alive and not nd.ps.complete:
            cand = np.flatnonzero(~nd.ps.held & ~nd.ps.inflight & ~nd.ps.owned)
            if cand.size == 0:
                yield self.wake_or(nd, 0.5)
                continue
            i = int(cand[0])  # tasks run in manifest order
            nd.ps.mark_inflight(i)
            while nd.alive and not nd.ps.held[i]:
                holders = [p for p in nd.ps.holders(i) if nd.load[p] < sc.today_per_peer]
                if holders:
                    holders.sort(key=lambda p: (nd.load[p], self.rng.random()))
                    peer, wait = holders[0], False
                else:
                    peer, wait = self.owner_map(nd).owner(self.digests[i]), True
                    if peer == nd.id or nd.load[peer] >= sc.today_per_peer:
                        yield self.env.timeout(0.1 + 0.4 * self.rng.random())
                        continue
                nd.load[peer] += 1
                ok = yield from self.ask(nd, peer, i, wait=wait)
                nd.load[peer] -= 1
                if not ok:
                    yield self.env.timeout(0.1 + 0.4 * self.rng.random())
            nd.ps.inflight[i] = False

    # ---- faults -------------------------------------------------------------------------------
    def kill(self, nd: SimNode) -> None:
        nd.alive = False
        self.event(nd.id, "killed")
        for f in list(nd.flows):
            self.net.abort(f)
        if self.sc.policy == "fleet" and nd.ps is not None:
            # its peer-set neighbours see their connections to it reset (TCP RST), at once
            for p in list(nd.ps.peers):
                other = self.nodes.get(p)
                if other is not None and other.alive and other.ps is not None:
                    self.later(self.delay(), self._reset_seen, other, nd.id)
        for w in nd.upq:
            if not w.triggered:
                w.succeed(False)
        nd.upq.clear()
        for ws in nd.owner_wait.values():
            for w in ws:
                if not w.triggered:
                    w.succeed(False)
        nd.owner_wait.clear()
        if self.sc.policy == "today":
            # today's membership marks it failed within about two rounds (2-3 s each)
            self.later(2 * 2.5, self._today_forget, nd.id)

    def _reset_seen(self, nd: SimNode, dead: str) -> None:
        if not nd.alive:
            return
        nd.unreachable.add(dead)
        nd.ps.remove(dead)
        self.refresh_peers(nd)
        self.kick(nd)

    def _today_forget(self, nid: str) -> None:
        self._forgotten.add(nid)
        self._today_epoch += 1
        for x in self.nodes.values():
            if x.alive and x.ps is not None:
                self.plan_bucket(x)
                self.kick(x)

    # ---- the run ------------------------------------------------------------------------------
    def add_node(self, nid: str, seeds: list[str]) -> SimNode:
        sc = self.sc
        nd = SimNode(nid, self.env, sc.nic_bps)
        nd.joined_at = self.env.now
        nd.owners = OwnerCache()
        nd.gossip = TargetGossip(nid, lambda: self.env.now, random.Random(self.rng.random()))
        nd.ps = None
        nd.swim = None
        self.nodes[nid] = nd
        nd.started = True
        if sc.policy == "fleet":
            nd.swim = Swim(nid, f"http://{nid}", lambda: self.env.now, rng=random.Random(self.rng.random()),
                           period_s=sc.swim_period_s, suspect_mult=sc.suspect_mult)
            msgs = nd.swim.join({s: f"http://{s}" for s in seeds})
            self.send_swim(msgs)
            self.env.process(self.swim_loop(nd))
        return nd

    def run(self) -> dict[str, Any]:
        sc = self.sc
        self._today_epoch = 0
        # The initial fleet starts from the discovery source every node agrees on (a headless
        # Service's endpoints), so its tables are full at t = 0; late joiners know 3 seeds.
        for nid in self.initial:
            nd = self.add_node(nid, [])
            if nd.swim is not None:
                nd.swim.join({s: f"http://{s}" for s in self.initial if s != nid}, complete=True)
                nd.swim._next_sync = self.env.now + self.rng.uniform(0.5, 1.0) * nd.swim.sync_interval_s
        entry = self.nodes[self.initial[0]]
        if sc.policy == "fleet":
            self.offer_target(entry, self.target)
        else:
            for nd in self.nodes.values():  # today: the POST fans out to every peer
                entry.ctrl_sent += 1
                nd.gossip.offer(self.target, ())
                nd.adopted_at = self.env.now
                self.start_download(nd)
        floor = sc.floor_s
        victims = self.rng.sample(self.initial[1:], int(round(sc.n * sc.kill_frac)))
        self.env.process(self._faults(victims, floor))
        self.env.process(self._late(floor))
        self.env.process(self._meter())
        self.env.process(self._until_done())
        self.env.run(until=sc.time_limit_s)
        return self.result(victims)

    def _faults(self, victims: list[str], floor: float) -> Any:
        if not victims:
            return
        yield self.env.timeout(floor * self.sc.kill_at_floor)
        for v in victims:
            self.kill(self.nodes[v])

    def _late(self, floor: float) -> Any:
        if not self.late:
            return
        yield self.env.timeout(floor * self.sc.late_at_floor)
        live = [n for n in self.initial if self.nodes[n].alive]
        for nid in self.late:
            nd = self.add_node(nid, self.rng.sample(live, 3))
            self.event(nid, "joined late")
            if self.sc.policy == "today":
                nd.gossip.offer(self.target, ())
                nd.adopted_at = self.env.now
                self.start_download(nd)
                self._today_epoch += 1

    def _meter(self) -> Any:
        """Today's control messages, counted as its loops send them (not simulated)."""
        while True:
            yield self.env.timeout(0.5)
            if self.sc.policy != "today":
                continue
            live = [x for x in self.nodes.values() if x.alive]
            n = len(live)
            for x in live:
                per = n - 1
                # membership: a POST to every member every 2.5 s on average (and its answer)
                x.ctrl_sent += per * 0.5 / 2.5
                x.ctrl_recv += per * 0.5 / 2.5
                if x.ps is not None and not x.ps.complete:
                    x.ctrl_sent += per  # have-bitfield GET to every live peer every 0.5 s
                    x.ctrl_recv += per

    def _until_done(self) -> Any:
        while True:
            yield self.env.timeout(0.25)
            live = [x for x in self.nodes.values() if x.alive]
            if len(self.nodes) == self.sc.n and all(x.done_at is not None for x in live) and self.env.now >= self.sc.min_sim_s:
                yield self.env.timeout(self.sc.swim_period_s * 2)  # let gossip settle for the counts
                raise simpy.core.StopSimulation(None)

    def result(self, victims: list[str]) -> dict[str, Any]:
        sc = self.sc
        live = [x for x in self.nodes.values() if x.alive]
        done = [x.done_at for x in live if x.done_at is not None]
        last = max(done) if len(done) == len(live) else None
        end = self.env.now
        rates = [(x.ctrl_sent + x.ctrl_recv) / max(1e-9, end - x.joined_at) for x in live]
        dup = sum(c - 1 for c in self.bucket_reads.values() if c > 1)
        adopted = [x.adopted_at for x in live if x.adopted_at is not None]
        sample = self.rng.sample(live, min(10, len(live)))
        swim_bytes = max((x.swim.state_bytes() for x in sample if x.swim), default=0)
        out = {
            "scenario": asdict(sc),
            "floor_s": round(sc.floor_s, 3),
            "seconds": None if last is None else round(last, 3),
            "x_floor": None if last is None else round(last / sc.floor_s, 4),
            "done_nodes": len(done),
            "live_nodes": len(live),
            "killed": len(victims),
            "late": len(self.late),
            "bucket_egress_over_s": round(self.bucket_bytes / sc.snapshot_bytes, 4),
            "duplicate_bucket_reads": dup,
            "control_msgs_per_node_s_mean": round(float(np.mean(rates)), 3),
            "control_msgs_per_node_s_max": round(float(np.max(rates)), 3),
            "peer_state_bytes_per_node_max": int(max((x.state_peak for x in live), default=0)),
            "member_table_bytes_per_node": int(swim_bytes),
            # the POST reaching every node of the fleet as it was, and joiners after their join
            "hotload_target_spread_s": None if len(adopted) < len(live) else round(
                max(x.adopted_at for x in live if x.joined_at == 0) - self.post_at, 4),
            "hotload_late_joiner_adopt_s": round(max((x.adopted_at - x.joined_at for x in live if x.joined_at > 0
                                                      and x.adopted_at is not None), default=0.0), 4),
            "hotload_done_s": None if last is None else round(last - self.post_at, 3),
            "sim_end_s": round(end, 3),
            "owner_map_rebuilds": self.owner_cache_rebuilds,
        }
        return out
