"""One fleet simulation: N simulated nodes running bdn's own policies over simpy.

The policies are not re-implemented here: every node holds a :class:`bdn.control.swim.Swim`,
a :class:`bdn.control.peerset.PeerSet` for the snapshot, an :class:`bdn.control.owners.OwnerCache`
and a :class:`bdn.control.hotload.TargetGossip`, exactly the objects the daemon uses, and the
daemon's fetch policy (:mod:`bdn.daemon.fetch.policy`: the endgame rule, the holder ranking
``holder_key``, a :class:`SourceBook` per node that records each peer's rate and refusals and
says whom to penalise) and upload admission (:class:`bdn.daemon.serve.uploads.Uploads`: upload
slots, per-chunk fan-out, cut-through slots), with simpy's clock injected; this module only
delivers their messages (one-way delay = RTT/2 plus jitter) and moves chunk bytes over
:mod:`bench.fleetsim.net` (max-min fair flows). tests/test_fleetsim_policy.py fails if it stops.

The ``fleet`` policy (this module): SWIM membership, bucket readers per snapshot
(:func:`bdn.control.owners.reader_count` with the daemon's ``bucket_concurrency`` connections
per reader), bounded peer sets with BITFIELD/HAVE picking chunks in bdnd's order
(``policy.chunk_order``: each owner's next chunk first), hot-load gossip; a node
asks a chunk's owner directly only when no peer of its set has had it for
``owner_ask_after_s``. ``today`` (today's bdnd, for the validation): bench/fleetsim/today.py.

Mechanics (why N = 10,000 runs): no simpy process per request or transfer. A request is a
chain of callbacks (ask -> admit or queue at the holder -> flow -> done); a node's download
slots are filled by one ``fill`` per instant however many HAVEs, slot releases and arrivals
woke it (:meth:`FleetSim.kick` coalesces), and one timer per node stands for all its waits.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np
import simpy

from bdn.control.hotload import Target, TargetGossip
from bdn.control.members import MemberBase
from bdn.control.owners import OwnerCache, reader_count, reader_slots
from bdn.control.peerset import PeerSet
from bdn.control.swim import Message, Swim
from bdn.daemon.fetch.policy import SourceBook, owner_places
from bdn.daemon.serve.uploads import Admission, Uploads
from bdn.proto import hrw
from bench.fleetsim.forward import Forwarding
from bench.fleetsim.net import Link, Network, call_later
from bench.fleetsim.report import result
from bench.fleetsim.scenario import Scenario


class SimClock:
    """simpy's clock as the daemon's ``Clock`` (``bdn.daemon.process.clock``): ``monotonic()`` is
    ``env.now``; ``time()``/``time_ns()`` the same seconds (nothing here needs the epoch)."""

    def __init__(self, env: simpy.Environment) -> None:
        self.env = env

    def monotonic(self) -> float:
        return float(self.env.now)

    def time(self) -> float:
        return float(self.env.now)

    def time_ns(self) -> int:
        return int(self.env.now * 1e9)


class _LazyLive(Sequence):
    """``swim.live()``, built only when read: :meth:`PeerSet.refresh` reads the live list only
    when it dials, and rebuilding a sorted tuple of N ids at every epoch change of every node
    cost O(N^2) per membership change at N = 10,000 (simulator time only)."""

    __slots__ = ("_ids", "swim")

    def __init__(self, swim: Swim) -> None:
        self.swim = swim
        self._ids: tuple[str, ...] | None = None

    def _get(self) -> tuple[str, ...]:
        if self._ids is None:
            self._ids = self.swim.live()
        return self._ids

    def __len__(self) -> int:
        return len(self._get())

    def __getitem__(self, i):  # type: ignore[override]
        return self._get()[i]

    def __iter__(self):  # type: ignore[override]
        return iter(self._get())


class _SlowMemo:
    """``SourceBook.slow`` (the daemon's rule, called as is) remembered per peer until the book's
    next rate sample: :meth:`PeerSet.pick` asks it for every peer of the set at every pick, and
    each answer sorts the other peers' rates (O(k^2 log k) per pick, a quarter of a run's CPU at
    N = 100). A rate changes only in ``delivered`` (the simulator calls no ``lagging``), so the
    answers are the same; simulator time only."""

    __slots__ = ("book", "memo")

    def __init__(self, book: SourceBook) -> None:
        self.book = book
        self.memo: dict[str, bool] = {}

    def __call__(self, src: str) -> bool:
        v = self.memo.get(src)
        if v is None:
            v = self.memo[src] = self.book.slow(src)
        return v

    def delivered(self, src: str, nbytes: int, seconds: float | None) -> None:
        self.memo.clear()
        self.book.delivered(src, nbytes, seconds)


class SimNode:
    __slots__ = (
        "id",
        "alive",
        "up",
        "down",
        "swim",
        "ps",
        "gossip",
        "owners",
        "ctrl_sent",
        "ctrl_recv",
        "done_at",
        "joined_at",
        "uploads",
        "uploads_by_chunk",
        "load",
        "bucket_queue",
        "reading",
        "flows",
        "adopted_at",
        "owner_wait",
        "unavail_t",
        "ask_at",
        "have_pending",
        "state_peak",
        "omap",
        "prev_omap",
        "nreads",
        "inherited",
        "unreachable",
        "busy",
        "nreq",
        "timer",
        "tasks",
        "dirty",
        "sent_by_chunk",
        "partial",
        "upl",
        "book",
        "slow",
        "penalised",
    )

    def __init__(self, nid: str, nic: float) -> None:
        self.id = nid
        self.alive = True
        self.up = Link(nid + "/up", nic)
        self.down = Link(nid + "/down", nic)
        self.ctrl_sent = 0.0
        self.ctrl_recv = 0.0
        self.done_at: float | None = None
        self.joined_at = 0.0
        self.uploads = 0
        self.uploads_by_chunk: Counter = Counter()
        self.sent_by_chunk: Counter = Counter()  # uploads started per chunk, ever
        self.load: Counter = Counter()  # requests in flight per peer (from this node)
        self.bucket_queue: list[int] = []
        self.reading: set[int] = set()
        self.flows: dict = {}  # its flows, insertion-ordered: a kill aborts them in the same order every run
        self.adopted_at: float | None = None
        self.owner_wait: dict[int, list] = {}  # requests parked until this owner holds the chunk
        self.ask_at: Any = None
        self.unavail_t: Any = None  # per chunk: since when no peer of the set has it (inf: tracked not)
        self.have_pending = False
        self.state_peak = 0
        self.omap: Any = None
        self.prev_omap: Any = None  # the map before the last change: who owned a chunk before
        self.nreads = 0  # bucket reads in flight
        self.inherited: set[int] = set()
        self.unreachable: set[str] = set()
        self.upl: Uploads | None = None  # the daemon's upload admission (bdn.daemon.serve.uploads)
        self.book: SourceBook | None = None  # the daemon's record of each peer (bdn.daemon.fetch.policy)
        self.slow: _SlowMemo | None = None  # book.slow, remembered between rate samples
        self.penalised = 0  # peers this node penalised (SourceBook.refused)
        self.busy: dict[str, float] = {}  # peer -> until when it said "busy" (skip it)
        self.nreq = 0  # requests in flight from this node
        self.timer: float | None = None  # when this node's one pending wake-up fires
        self.tasks: set[int] = set()  # today: chunks its workers hold
        self.dirty = False
        self.partial: dict[int, Any] = {}  # chunk -> incoming copy, announced and served while it arrives
        self.swim: Swim | None = None
        self.ps: PeerSet | None = None
        self.gossip: TargetGossip | None = None
        self.owners: OwnerCache | None = None


class FleetSim:
    """Build with a :class:`Scenario`, call :meth:`run`, read the result dict."""

    policy = "fleet"

    def __init__(self, sc: Scenario) -> None:
        self.sc = sc
        self.env = simpy.Environment()
        self.clock = SimClock(self.env)
        self.net = Network(self.env)
        self.fwd = Forwarding(sc.forward, sc.chunk_bytes, self.env, self.net.abort)
        self.rng = random.Random(sc.seed)
        self.bucket = Link("bucket", sc.bucket_bps * sc.wire_payload)
        self.nodes: dict[str, SimNode] = {}
        self.digests = [f"{i:032x}" for i in range(sc.chunks)]
        self.identity = "step000001"
        self.bucket_reads: Counter = Counter()
        self.bucket_bytes = 0.0
        self.log: list[tuple[float, str, str]] = []  # (t, node, event): the run's event log
        self.target = Target(1, 1.7e9, self.identity)
        self.post_at = 0.0
        self.owner_cache_rebuilds = 0
        self.n_done = 0  # live nodes holding the snapshot
        self.n_live = 0
        self.requests = 0  # chunk requests sent (a cost metric)
        self._maps: dict[tuple, Any] = {}
        self._place_of: dict[int, tuple[Any, np.ndarray]] = {}  # id(owner map) -> (map, places)
        self._reader_scores: dict[tuple[str, str], int] = {}  # (node, slot key) -> HRW score
        self._readers_of_view: dict[int, tuple] = {}  # id(live tuple) -> (live, r, readers)
        self._dirty: list[SimNode] = []
        #: (t, node, chunk, source) per chunk arrival when set to a list (bench/fleetsim/timeline.py)
        self.arrivals: list[tuple[float, str, int, str]] | None = None
        self._stop = self.env.event()
        self.admitted_99: dict[str, float] = {}  # joiner -> s until 99 % of members count it (control runs)
        n_late = int(round(sc.n * sc.late_frac))
        self.initial = [f"n{i:05d}" for i in range(sc.n - n_late)]
        self.late = [f"n{i:05d}" for i in range(sc.n - n_late, sc.n)]

    # ---- plumbing ---------------------------------------------------------------------------
    def delay(self) -> float:
        return self.sc.rtt_s / 2 + self.rng.random() * self.sc.jitter_s

    def later(self, dt: float, fn: Any, *args: Any) -> None:
        call_later(self.env, dt, fn, *args)

    def event(self, node: str, what: str) -> None:
        if len(self.log) < 200_000:
            self.log.append((round(self.env.now, 4), node, what))

    def kick(self, nd: SimNode) -> None:
        """Fill ``nd``'s download slots once, at the end of this instant."""
        if nd.dirty:
            return
        nd.dirty = True
        if not self._dirty:
            self.later(0.0, self._drain)
        self._dirty.append(nd)

    def _drain(self) -> None:
        todo, self._dirty = self._dirty, []
        for nd in todo:
            nd.dirty = False
            if nd.alive and nd.ps is not None and not nd.ps.complete:
                self.fill(nd)

    def wake_at(self, nd: SimNode, t: float) -> None:
        """One timer per node: keep the earliest wake-up (a fill re-arms what it still needs)."""
        if nd.timer is not None and nd.timer <= t:
            return
        nd.timer = t
        self.later(t - self.env.now, self._timer, nd, t)

    def _timer(self, nd: SimNode, t: float) -> None:
        if nd.timer == t:
            nd.timer = None
            self.kick(nd)

    # ---- membership -------------------------------------------------------------------------
    def send_swim(self, msgs: list[Message]) -> None:
        for m in msgs:
            src = self.nodes.get(m.src)
            if src is not None:
                src.ctrl_sent += 1
                if src.gossip is not None and src.gossip.current:
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

    def swim_tick(self, nd: SimNode) -> None:
        if not nd.alive:
            return
        before = nd.swim.epoch
        self.send_swim(nd.swim.tick())
        if nd.swim.epoch != before:
            self.on_epoch(nd)
        self.later(max(1e-4, nd.swim.next_deadline() - self.env.now), self.swim_tick, nd)

    def on_epoch(self, nd: SimNode) -> None:
        if nd.ps is not None and nd.alive:
            if len(nd.ps.peers) < nd.ps.k or any(not nd.swim.is_live(p) for p in nd.ps.peers):
                self.refresh_peers(nd)
            before = nd.omap
            if self.owner_map(nd) is not before:
                self.event(nd.id, "owners moved")
                self.plan_bucket(nd)
            self.kick(nd)

    # ---- hot-load ---------------------------------------------------------------------------
    def offer_target(self, nd: SimNode, t: Target) -> None:
        push = nd.gossip.offer(t, nd.swim.live if nd.swim else tuple(self.nodes))  # live(): only on adoption
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
            self.mark_done(nd)

    def deliver_target(self, dst_id: str, t: Target) -> None:
        dst = self.nodes.get(dst_id)
        if dst is None or not dst.alive:
            return
        dst.ctrl_recv += 1
        self.offer_target(dst, t)

    # ---- owners and bucket reads ------------------------------------------------------------
    def reader_count(self, live_n: int) -> int | None:
        sc = self.sc
        return reader_count(live_n, sc.bucket_bps, sc.bucket_conn_bps, connections_per_reader=sc.bucket_concurrency)

    def owner_map(self, nd: SimNode) -> Any:
        """This node's :class:`OwnerMap` for its current membership view.

        A map stays while the membership changes since it was built leave every owner where it
        was (:meth:`OwnerMap.affected_by`); nodes whose views are identical share one build
        (the map is a pure function of the view: memoising it saves simulator time only).
        """
        changes, nd.swim.changes = nd.swim.changes, []
        if nd.omap is not None and not any(nd.omap.affected_by(c) for c in changes):
            return nd.omap
        return self._map_for(nd, nd.swim.epoch, nd.swim.live())

    def _map_for(self, nd: SimNode, epoch: int, live: tuple[str, ...]) -> Any:
        r = self.reader_count(len(live))
        if r is not None and 0 < r < len(live):
            # a map over a subset of readers depends on the view only through its readers
            # (plain HRW among them; bdn.control.owners.readers_and_rule): views that differ in
            # other members share one (simulator time only: an O(N) ranking per view at N = 10,000)
            key: tuple = ("readers", self._top_readers(live, r))
        else:
            key = (live, r)
        m = self._maps.get(key)
        if m is None:
            m = nd.owners.get(epoch, live, self.identity, r, self.digests)  # bdnd's owner rule
            self.owner_cache_rebuilds += 1
            self._maps[key] = m
            if len(self._maps) > 32:
                self._maps.pop(next(iter(self._maps)))
        if nd.omap is not m:
            nd.prev_omap = nd.omap
        nd.omap = m
        return m

    def _top_readers(self, live: tuple[str, ...], r: int) -> tuple[str, ...]:
        """The holders of the snapshot's reader slots (:func:`bdn.control.owners.reader_slots`,
        the policy's own function), with each node's slot scores computed once."""
        hit = self._readers_of_view.get(id(live))
        if hit is not None and hit[0] is live and hit[1] == r:
            return hit[2]  # the same tuple object: views that share the fleet list (MemberBase)
        sc = self._reader_scores

        def score(n: str, key: str) -> int:
            v = sc.get((n, key))
            if v is None:
                v = sc[(n, key)] = hrw.score(n, key)
            return v

        cands = reader_slots(self.identity, live, r, score=score)
        top = tuple(tuple(c) for c in cands)  # the map's key: each slot's holder and next candidates
        if len(self._readers_of_view) > 64:
            self._readers_of_view.clear()
        self._readers_of_view[id(live)] = (live, r, top)
        return top

    def synced(self, nd: SimNode) -> bool:
        return nd.swim is None or nd.swim.synced

    def plan_bucket(self, nd: SimNode) -> None:
        """The chunks this node owns now (membership epoch): read them, in order."""
        m = self.owner_map(nd)
        owned = np.zeros(self.sc.chunks, dtype=bool)
        # a joiner with a partial view takes no reader role until its first full sync
        mine = m.owned_by(nd.id, self.digests) if self.synced(nd) else []
        owned[mine] = True
        if self.policy == "fleet" and (nd.ps.held.any() or nd.joined_at > 0):
            # chunks that became ours while the snapshot was under way: ask the former owner first
            nd.inherited |= {i for i in mine if not nd.ps.owned[i]}
        nd.ps.owned = owned
        nd.ps.place = self._places(m)
        queued = set(nd.bucket_queue)
        new = [i for i in mine if not nd.ps.held[i] and i not in nd.reading and i not in queued]
        nd.bucket_queue = [i for i in nd.bucket_queue if owned[i] and not nd.ps.held[i]] + new
        self.start_reads(nd)

    def _places(self, m: Any) -> np.ndarray:
        """Each chunk's place in its owner's read list under map ``m`` (``policy.owner_places``,
        as bdnd's fetcher computes it), built once per map."""
        hit = self._place_of.get(id(m))
        if hit is not None and hit[0] is m:
            return hit[1]
        place = owner_places(m.owner(d) for d in self.digests)
        if len(self._place_of) > 64:
            self._place_of.clear()
        self._place_of[id(m)] = (m, place)
        return place

    def start_reads(self, nd: SimNode) -> None:
        """Keep ``reads_per_reader`` simulated chunk reads (``bucket_concurrency`` connections) going."""
        sc = self.sc
        while nd.alive and nd.nreads < sc.reads_per_reader and nd.bucket_queue:
            i = nd.bucket_queue.pop(0)
            if nd.ps.held[i] or i in nd.reading:
                continue
            if self.policy == "fleet" and nd.ps.avail[i] > 0:
                # A peer holds it already (this node became its owner late: it joined, or the
                # old owner died after reading it): take it from the swarm, not the bucket.
                nd.ps.owned[i] = False
                self.kick(nd)
                continue
            nd.reading.add(i)
            nd.ps.mark_inflight(i)
            nd.nreads += 1
            if i in nd.inherited:
                nd.inherited.discard(i)
                former = self.former_owner(nd, i)
                if former is not None and former not in nd.unreachable:
                    self.request(nd, former, i, True, lambda ok, nd=nd, i=i: self._inherited_done(nd, i, ok))
                    continue
            f = self.net.start(
                sc.chunk_bytes,
                (self.bucket, nd.down),
                sc.read_cap_bps,
                ("bucket", nd.id, i),
                lambda f, ok, nd=nd, i=i: self.fwd.ended(f, ok, lambda ok2: self._read_done(nd, i, f, ok2)),
            )
            nd.flows[f] = None
            self._incoming(nd, i, f, True)

    def former_owner(self, nd: SimNode, i: int) -> str | None:
        """Who owned chunk ``i`` before it became ``nd``'s: the owner in ``nd``'s previous map
        (with bounded loads a change can move a chunk between two surviving readers, which HRW
        rank alone does not tell), else the reader ranked below ``nd``."""
        d = self.digests[i]
        if nd.prev_omap is not None:
            o = nd.prev_omap.owner(d)
            if o is not None and o != nd.id and nd.swim.is_live(o):
                return o
        return nd.omap.former_owner(d, nd.id)

    def _inherited_done(self, nd: SimNode, i: int, ok: bool) -> None:
        nd.nreads -= 1
        nd.reading.discard(i)
        if nd.alive and not nd.ps.held[i]:
            nd.bucket_queue.insert(0, i)  # the former owner had nothing: read it ourselves
        self.start_reads(nd)

    def _incoming(self, nd: SimNode, i: int, f: Any, bucket: bool) -> None:
        """``f`` brings chunk ``i`` to ``nd``: when forwarding is pipelined (:mod:`bench.fleetsim.forward`)
        ``nd`` announces and serves it once the first granule arrived."""
        if f.ended:
            return
        self.fwd.incoming(f, bucket)
        dt = self.fwd.announce_after(f, bucket)
        if dt is not None:
            self.later(dt, self._announce, nd, i, f)

    def _announce(self, nd: SimNode, i: int, f: Any) -> None:
        if f.ended or not nd.alive or nd.ps is None or nd.ps.held[i]:
            return
        nd.partial[i] = f
        nd.ps.announce(i)
        if self.policy == "fleet" and not nd.have_pending:
            nd.have_pending = True
            self.later(nd.ps.next_flush() - self.env.now, self.flush_have, nd)
        for req in nd.owner_wait.pop(i, []):  # cut-through to the requests parked here
            if req[0].alive:
                self.admit(nd, *req)

    def _in_done(self, nd: SimNode, i: int, f: Any, ok: bool) -> None:
        """An incoming copy is complete or failed: the copies made from it follow; a failed
        copy that was announced is withdrawn from the peers (they stop counting this node)."""
        if nd.partial.get(i) is f:
            del nd.partial[i]
            if not ok and nd.alive and nd.ps is not None and not nd.ps.held[i]:
                nd.ps.withdraw(i)
                nd.ctrl_sent += len(nd.ps.peers)
                self.later(self.delay(), self._withdrawn, nd.id, list(nd.ps.peers), i)
        self.fwd.source_done(f, ok)

    def _withdrawn(self, src: str, peers: list[str], i: int) -> None:
        for p in peers:
            dst = self.nodes.get(p)
            if dst is not None and dst.alive and dst.ps is not None:
                dst.ctrl_recv += 1
                dst.ps.on_withdraw(src, i)
                self.kick(dst)

    def _read_done(self, nd: SimNode, i: int, f: Any, ok: bool) -> None:
        self._in_done(nd, i, f, ok)
        nd.flows.pop(f, None)
        nd.nreads -= 1
        self.bucket_bytes += f.moved
        nd.reading.discard(i)
        if not ok or not nd.alive:
            return
        self.bucket_reads[i] += 1
        self.event(nd.id, f"bucket read {i} done" + (" again" if self.bucket_reads[i] > 1 else ""))
        self.got(nd, i, "bucket")
        self.start_reads(nd)

    def take_over(self, nd: SimNode, i: int) -> None:
        if nd.ps.held[i] or i in nd.reading or i in nd.bucket_queue:
            return
        self.event(nd.id, f"takes over chunk {i}")
        nd.ps.owned[i] = True
        nd.ps.inflight[i] = False
        nd.bucket_queue.insert(0, i)
        self.start_reads(nd)

    # ---- chunk arrival, HAVE, peer set ------------------------------------------------------
    def got(self, nd: SimNode, i: int, source: str) -> None:
        ps = nd.ps
        if ps.held[i]:
            ps.inflight[i] = False
            return
        legs = ps.asked.get(i)
        ps.got(i)
        if legs is not None and len(legs) > 1:
            self.cancel_legs(nd, i, [p for p in legs if p != source])
        nd.unavail_t[i] = np.inf
        if self.arrivals is not None:
            self.arrivals.append((self.env.now, nd.id, i, source))
        for req in nd.owner_wait.pop(i, []):  # requests parked here while this node fetched
            if req[0].alive:
                self.admit(nd, *req)
        if ps.complete:
            self.mark_done(nd)
        if self.policy == "fleet" and source == "bucket" and self.sc.have_at_once_after_read:
            self.flush_have(nd, keep_pending=True)  # a bucket read is announced at once (readers: few nodes)
        elif self.policy == "fleet" and not nd.have_pending:
            nd.have_pending = True
            self.later(ps.next_flush() - self.env.now, self.flush_have, nd)
        if ps.complete or int(ps.held.sum()) == self.sc.chunks // 2:
            nd.state_peak = max(nd.state_peak, ps.state_bytes())
        self.kick(nd)

    def cancel_legs(self, nd: SimNode, i: int, peers: list[str]) -> None:
        """``nd`` holds chunk ``i`` now: the other legs of its endgame race are cancelled (a
        request still queued at its holder leaves the queue; a copy on the wire stops, unless
        ``nd`` already forwards it to others: then it is let finish)."""
        for p in peers:
            src = self.nodes.get(p)
            if src is None:
                continue
            for f in list(nd.flows):
                if f.tag == ("peer", p, nd.id, i) and not f.ended and not self.fwd.children.get(f):
                    self.net.abort(f)

    def mark_done(self, nd: SimNode) -> None:
        if nd.done_at is None:
            nd.done_at = self.env.now
            self.n_done += 1
            self.event(nd.id, "snapshot ready")
            self.check_end()

    def flush_have(self, nd: SimNode, keep_pending: bool = False) -> None:
        if not keep_pending:
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
            ps = dst.ps
            if src not in ps.peers:
                continue
            ps.on_have(src, idxs)
            # a fill can only pick something new when a HAVE names a chunk still wanted and not
            # in flight here (the others change no candidate: simulator time only, the picks
            # are the same)
            if ps.complete:
                continue
            held, infl, owned = ps.held, ps.inflight, ps.owned
            for i in idxs:
                if not (held[i] or infl[i] or owned[i]):
                    self.kick(dst)
                    break

    def refresh_peers(self, nd: SimNode) -> None:
        m = self.owner_map(nd)
        before = list(nd.ps.peers)
        dial = nd.ps.refresh(_LazyLive(nd.swim), m.readers, nd.swim.is_live)
        for p in before:
            if p not in nd.ps.peers:  # dropped here: the other side sees its connection close
                other = self.nodes.get(p)
                if other is not None and other.alive and other.ps is not None and nd.id in other.ps.peers:
                    self.later(self.delay(), self._reset_seen, other, nd.id, False)
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
            nd.ps.on_bitfield(p, other.ps.have_bits())
            other.ps.on_bitfield(nd.id, nd.ps.have_bits())
            self.kick(other)

    # ---- requests ---------------------------------------------------------------------------
    def request(self, nd: SimNode, pid: str, i: int, wait: bool, cb: Any = None) -> None:
        """Ask ``pid`` for chunk ``i`` (``wait``: it is the owner, which holds the request until
        it has the chunk). Ends in :meth:`finish`, which calls ``cb(ok)`` when given."""
        nd.nreq += 1
        nd.load[pid] += 1
        self.requests += 1
        self.later(self.delay(), self._arrive, nd, pid, i, wait, cb)

    def _arrive(self, nd: SimNode, pid: str, i: int, wait: bool, cb: Any) -> None:
        src = self.nodes.get(pid)
        if src is None or not src.alive or src.ps is None:
            self.later(self.delay(), self.finish, nd, pid, i, False, cb)  # refused / reset
            return
        if self._cancelled(nd, i):  # the asker got the chunk meanwhile (an endgame race's loser)
            self.later(self.delay(), self.finish, nd, pid, i, False, cb)
            return
        if not src.ps.held[i] and i not in src.partial:
            if wait and self.policy == "fleet" and i not in src.reading and i not in src.bucket_queue:
                self.plan_bucket(src)
                if i not in src.reading and i not in src.bucket_queue:
                    self.maybe_take_over(src, nd, i)
            if not wait or (self.policy == "fleet" and i not in src.reading and i not in src.bucket_queue):
                self.later(self.delay(), self.finish, nd, pid, i, False, cb)  # 404: not (yet) here
                return
            src.owner_wait.setdefault(i, []).append((nd, i, cb))
            return
        self.admit(src, nd, i, cb)

    def upload_admit(self, src: SimNode, i: int) -> bool:
        """bdnd's upload admission (:class:`bdn.daemon.serve.uploads.Uploads`): a held chunk takes an
        upload slot within the per-chunk fan-out, a chunk still arriving here (forwarded while
        it lands) a cut-through slot. Books the slot (:meth:`_sent` gives it back)."""
        key = self.digests[i]
        d = src.upl.admit(key, True, False, False) if src.ps.held[i] else src.upl.admit_growing(key)
        return d is Admission.SEND

    def _cancelled(self, nd: SimNode, i: int) -> bool:
        """A request of ``nd`` for chunk ``i`` that ``nd`` no longer needs: it holds the chunk
        (the other leg of an endgame race won), so it cancelled this one."""
        return nd.ps is not None and bool(nd.ps.held[i])

    def admit(self, src: SimNode, nd: SimNode, i: int, cb: Any) -> None:
        if self._cancelled(nd, i):
            self.later(self.delay(), self.finish, nd, src.id, i, False, cb)
            return
        if self.upload_admit(src, i):
            self.transfer(src, nd, i, cb)
        else:
            nd.busy[src.id] = self.env.now + self.sc.busy_backoff_s
            self.later(self.delay(), self.finish, nd, src.id, i, False, cb, True)  # 503 busy

    def transfer(self, src: SimNode, nd: SimNode, i: int, cb: Any) -> None:
        t0 = self.env.now
        src.uploads += 1
        src.uploads_by_chunk[i] += 1
        src.sent_by_chunk[i] += 1
        source = None if src.ps.held[i] else src.partial.get(i)
        f = self.net.start(
            self.sc.chunk_bytes,
            (src.up, nd.down),
            tag=("peer", src.id, nd.id, i),
            on_done=lambda f, ok: self.fwd.ended(f, ok, lambda ok2: self._sent(src, nd, i, cb, f, ok2, t0)),
        )
        src.flows[f] = None
        nd.flows[f] = None
        self.fwd.copy(f, source)
        self._incoming(nd, i, f, False)

    def _sent(self, src: SimNode, nd: SimNode, i: int, cb: Any, f: Any, ok: bool, t0: float) -> None:
        self._in_done(nd, i, f, ok)
        src.flows.pop(f, None)
        nd.flows.pop(f, None)
        src.uploads -= 1
        src.uploads_by_chunk[i] -= 1
        src.upl.done(self.digests[i])
        if ok and nd.book is not None and cb is None:  # a holder's whole copy: a rate sample
            nd.slow.delivered(src.id, int(self.sc.chunk_bytes), self.env.now - t0)
        self.kick(src)
        self.finish(nd, src.id, i, ok, cb)

    def finish(self, nd: SimNode, pid: str, i: int, ok: bool, cb: Any, busy: bool = False) -> None:
        nd.nreq -= 1
        nd.load[pid] -= 1
        if not nd.alive:
            return
        if ok:
            self.got(nd, i, pid)
        elif nd.ps.held[i]:
            nd.ps.failed(i, pid)  # a cancelled endgame leg: nothing failed
        else:
            nd.ps.failed(i, pid)
            if cb is None:
                self.failed(nd, pid, i, busy)
        if cb is not None:
            cb(ok)
        self.kick(nd)

    def failed(self, nd: SimNode, pid: str, i: int, busy: bool = False) -> None:
        """A fleet request failed: a dead peer leaves the set at once; a live one is skipped
        for a moment (busy) so the slots go elsewhere, and a busy answer to a pick (the
        peer's have-list invited it) is a refusal the node's :class:`SourceBook` judges, as
        bdnd's does (``bdn.daemon.fetch.watch``): penalised, the peer is skipped ``penalty_s``."""
        if busy and nd.book is not None and nd.ps.avail[i] > 0 and nd.book.refused(pid):
            nd.penalised += 1
            self.event(nd.id, f"penalised {pid}")
            until = self.env.now + self.sc.penalty_s
            nd.busy[pid] = max(nd.busy.get(pid, 0.0), until)
            self.wake_at(nd, until)
            return
        if not self.nodes[pid].alive:
            nd.unreachable.add(pid)  # connection refused / reset: local knowledge, before SWIM
            if pid in nd.ps.peers:
                nd.ps.remove(pid)
                self.refresh_peers(nd)
        else:
            if nd.ps.avail[i] == 0:  # an owner ask: 404 (its view differs) - ask again a little later
                nd.ask_at[i] = self.env.now + 0.05 + 0.1 * self.rng.random()
            until = self.env.now + self.sc.busy_backoff_s * (1 + 2 * self.rng.random())
            nd.busy[pid] = max(nd.busy.get(pid, 0.0), until)
            self.wake_at(nd, until)

    def maybe_take_over(self, src: SimNode, asker: SimNode, i: int) -> None:
        """``asker`` found chunk ``i``'s owner unreachable and asks ``src``, the next reader:
        ``src`` checks the owner itself (one probe, as SWIM's indirect ping) and, if it is
        unreachable from here too, reads the chunk from the bucket as its acting owner."""
        if not self.synced(src):
            return
        m = self.owner_map(src)
        owner = m.owner(self.digests[i])
        if owner is None or owner == src.id or owner not in asker.unreachable:
            return
        if m.acting_owner(self.digests[i], {owner}) == src.id and not self.nodes[owner].alive:
            src.unreachable.add(owner)
            self.take_over(src, i)

    # ---- the fleet node's download slots ----------------------------------------------------
    def start_download(self, nd: SimNode) -> None:
        if nd.ps is not None:
            return
        sc = self.sc
        nd.ps = PeerSet(
            nd.id,
            sc.chunks,
            lambda: self.env.now,
            rng=random.Random(self.rng.random()),
            k=sc.k,
            max_peers=sc.max_peers,
            reader_slots=sc.reader_slots,
            have_flush_s=sc.have_flush_s,
            endgame_chunks=sc.endgame_chunks,
        )
        nd.book = SourceBook(self.clock)
        nd.slow = _SlowMemo(nd.book)
        nd.unavail_t = np.full(sc.chunks, np.inf)
        nd.ask_at = np.zeros(sc.chunks)  # per chunk: no owner ask before (a failed one backs off)
        self.plan_bucket(nd)
        self.refresh_peers(nd)
        self.kick(nd)

    def fill(self, nd: SimNode) -> None:
        """Up to ``download_slots`` requests: from the peer set in bdnd's chunk order; a chunk no peer
        has had for ``owner_ask_after_s`` (at once when its owner's connection reset) from its
        owner, or read from the bucket when this node is now its acting owner."""
        sc, ps, now = self.sc, nd.ps, self.env.now
        free = sc.download_slots - nd.nreq
        if free <= 0:
            return
        load = nd.load
        if nd.busy:
            load = Counter(nd.load)
            for p, until in list(nd.busy.items()):
                if until > now:
                    load[p] = sc.max_per_peer
                else:
                    del nd.busy[p]
        picks = ps.pick(free, load, sc.max_per_peer, slow=nd.slow)
        for i, peer in picks:
            self.request(nd, peer, i, False)
        free -= len(picks)
        if free <= 0 or picks:
            return
        unav = ps.unavailable()
        if unav.size == 0:
            return
        t0 = nd.unavail_t[unav]
        fresh = np.isinf(t0)
        if fresh.any():
            nd.unavail_t[unav[fresh]] = now
            t0 = nd.unavail_t[unav]
        due_at = t0 + sc.owner_ask_after_s
        om = self.owner_map(nd)
        if nd.unreachable:  # at once when its owner is known unreachable here (its connection reset)
            gone = np.array([om.owner(self.digests[j]) in nd.unreachable for j in unav[:256].tolist()], dtype=bool)
            due_at[: gone.size][gone] = now
        due_at = np.maximum(due_at, nd.ask_at[unav])
        due = unav[due_at <= now]
        for j in due[:64].tolist():
            owner = om.acting_owner(self.digests[j], nd.unreachable)
            if owner is None or owner == nd.id:
                nd.unavail_t[j] = now
                if owner == nd.id and self.synced(nd) and j not in nd.reading and j not in nd.bucket_queue:
                    self.take_over(nd, j)  # (a joiner's partial view takes no reader role)
                continue
            ps.mark_inflight(j)
            self.request(nd, owner, j, True)
            free -= 1
            if free <= 0:
                return
        later_ = due_at[due_at > now]
        if later_.size:
            self.wake_at(nd, float(later_.min()))

    # ---- faults -------------------------------------------------------------------------------
    def kill(self, nd: SimNode) -> None:
        nd.alive = False
        self.n_live -= 1
        self.event(nd.id, "killed")
        if nd.done_at is not None:
            self.n_done -= 1
        self.fwd.fail_waiting(nd.flows)
        for f in list(nd.flows):
            self.net.abort(f)
        if nd.ps is not None and self.policy == "fleet":
            # its peer-set neighbours see their connections to it reset (TCP RST), at once
            for p in list(nd.ps.peers):
                other = self.nodes.get(p)
                if other is not None and other.alive and other.ps is not None:
                    self.later(self.delay(), self._reset_seen, other, nd.id)
        parked = [r for rs in nd.owner_wait.values() for r in rs]
        nd.owner_wait.clear()
        for a, i, cb in parked:
            self.later(self.delay(), self.finish, a, nd.id, i, False, cb)
        self.check_end()

    def _reset_seen(self, nd: SimNode, dead: str, reset: bool = True) -> None:
        """``nd`` sees its peer-set connection to ``dead`` end: reset (it died) or closed by it
        (``reset`` False: it dropped ``nd`` from its set)."""
        if not nd.alive:
            return
        if reset:
            nd.unreachable.add(dead)
        elif nd.ps is None or dead not in nd.ps.peers:
            return
        nd.ps.remove(dead)
        self.refresh_peers(nd)
        self.kick(nd)

    # ---- the run ------------------------------------------------------------------------------
    def add_node(self, nid: str, seeds: list[str]) -> SimNode:
        sc = self.sc
        nd = SimNode(nid, sc.nic_bps * sc.wire_payload)
        nd.joined_at = self.env.now
        nd.owners = OwnerCache()
        nd.upl = Uploads(sc.max_uploads, sc.uploads_per_chunk)
        nd.gossip = TargetGossip(nid, lambda: self.env.now, random.Random(self.rng.random()), fanout=sc.hotload_fanout)
        self.nodes[nid] = nd
        self.n_live += 1
        nd.swim = Swim(
            nid,
            f"http://{nid}",
            lambda: self.env.now,
            rng=random.Random(self.rng.random()),
            period_s=sc.swim_period_s,
            suspect_mult=sc.suspect_mult,
            max_piggyback=sc.max_piggyback,
        )
        if seeds:
            self.send_swim(nd.swim.join({s: f"http://{s}" for s in seeds}))
        self.later(0.0, self.swim_tick, nd)
        return nd

    def begin(self) -> None:
        """The initial fleet starts from the discovery source every node agrees on (a headless
        Service's endpoints), so its tables are full at t = 0; the trainer's POST reaches one."""
        # one shared fleet list, each node's table stores its changes only (bdn.control.members):
        # N x N entries would not fit at N = 10,000
        base = MemberBase({s: f"http://{s}" for s in self.initial}, self.env.now)
        for nid in self.initial:
            nd = self.add_node(nid, [])
            nd.swim.join_shared(base)
            # the first push-pull at the policy's own (N-scaled) period, spread over it
            nd.swim._next_sync = self.env.now + self.rng.uniform(0.5, 1.0) * nd.swim.sync_period()
        self.offer_target(self.nodes[self.initial[0]], self.target)

    def join_late(self, nid: str, live: list[str]) -> None:
        self.add_node(nid, self.rng.sample(live, min(3, len(live))))

    def run(self) -> dict[str, Any]:
        sc = self.sc
        self.begin()
        floor = sc.floor_s
        victims = self.rng.sample(self.initial[1:], int(round(sc.n * sc.kill_frac)))
        if victims:
            self.later(floor * sc.kill_at_floor, lambda: [self.kill(self.nodes[v]) for v in victims])
        if self.late:
            self.later(floor * sc.late_at_floor, self._late)
        self.later(sc.min_sim_s, self.check_end)
        self.later(sc.time_limit_s, self._end_now)
        self.env.run(until=self._stop)
        return result(self, victims)

    def _late(self) -> None:
        live = [n for n in self.initial if self.nodes[n].alive]
        for nid in self.late:
            self.join_late(nid, live)
            self.event(nid, "joined late")
        if not self.sc.data:
            self.later(0.5, self._sample_admission)

    def _sample_admission(self, every_s: float = 0.5, members: int = 500) -> None:
        """Control runs: every ``every_s``, the share of (up to ``members`` sampled) initial
        members that count each joiner live; ``admitted_99`` gets the seconds from a joiner's
        join until 99 % of them do (SWIM admission, bdn.control.probation)."""
        olds = [x for x in self.nodes.values() if x.joined_at == 0 and x.alive and x.swim is not None]
        sample = self.rng.sample(olds, min(members, len(olds)))
        for nid in self.late:
            j = self.nodes[nid]
            if nid in self.admitted_99 or not j.alive or not sample:
                continue
            if sum(1 for o in sample if o.swim.is_live(nid)) >= 0.99 * len(sample):
                self.admitted_99[nid] = self.env.now - j.joined_at
        if len(self.admitted_99) < len(self.late) and not self._stop.triggered:
            self.later(every_s, self._sample_admission)

    def check_end(self) -> None:
        if len(self.nodes) < self.sc.n or self.env.now < self.sc.min_sim_s or self._stop.triggered:
            return
        if self.n_done >= self.n_live:
            self.later(self.sc.swim_period_s * 2, self._end_now)  # let gossip settle for the counts

    def _end_now(self) -> None:
        if not self._stop.triggered:
            self._stop.succeed()
