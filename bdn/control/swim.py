"""Swarm membership at O(1) messages per node per period: SWIM with suspicion and piggybacking.

Source: Das, Gupta, Motivala, "SWIM: Scalable Weakly-consistent Infection-style Process Group
Membership Protocol" (DSN 2002), with the suspicion sub-protocol (§4.2), round-robin probe order
(§4.3) and the retransmit limit of HashiCorp memberlist (``RetransmitMult * log(N+1)``) and its
periodic push-pull state sync for joiners.

Why our own and not a library: the PyPI SWIM packages (``swim-protocol``, ``swim-p2p``) own their
sockets and event loops (asyncio UDP, ZeroMQ) and read the wall clock, so the daemon's signed
HTTP transport and the fleet simulator's simulated one could not drive them, and they could not be
tested with a fake clock. This module is the protocol only: it takes an injected clock and
returns :class:`Message` values; whoever owns a transport delivers them and calls
:meth:`Swim.receive` with the answers.

Per period (``period_s``) each member sends one ``ping`` to the next member of a shuffled
round-robin order; without an ``ack`` within ``ack_timeout_s`` it sends ``ping_req`` to
``indirect_k`` other members, which ping the target on its behalf; without any ack by the end
of the period the target becomes *suspect*; a suspect not refuted within the suspicion timeout
(``suspect_mult * log10(N+1)`` periods, at least ``suspect_mult``) is *dead*. A member that hears
itself suspected refutes it with a higher incarnation number. Every change is piggybacked on the
next outgoing messages (at most ``max_piggyback``, 32, per message: ~2 kB), each sent at most
``retransmit_mult * ceil(log2(N+1))`` times, so it reaches the whole fleet in O(log N) periods.
A joiner (at once and again a few periods later) and every member (every ``sync_interval_s``,
scaled up with log N as memberlist's push-pull) exchanges the whole table with one random
member (``sync``/``sync_ack``): the only message whose size grows with N.

**Admission** (:mod:`bdn.control.probation`): a member new to this daemon that another member
announces (a piggybacked update, a table row) waits on probation, out of the live set and not
relayed, until it is heard from directly, is announced by a second live member, or answers a
confirmation probe (every other period's ping while newcomers wait: no extra messages; only
from its ``confirmers`` designated daemons, :func:`bdn.control.probation.confirms`, so a joiner
answers about that many probes in any fleet); at most ``probation_per_source`` wait per source. Exempt: a member's own entry,
the seeds (:meth:`Swim.join`, :meth:`Swim.sync_to`: their answers), the shared fleet list
(:meth:`Swim.join_shared`). ``probation=False`` admits every newcomer at once (the protocol
before: a member holding the partition secret could add 25,000 invented members with one sync).

Modules: this one is the protocol (periods, probes, suspicion, piggyback); the member table's
sync and the admission wiring are :mod:`bdn.control.swimtable` (a mixin of :class:`Swim`); the
wire values :mod:`bdn.control.swimwire` (re-exported here).

Cost per member per period: 1 ping + 1 ack sent and on average 1 of each received, plus
``2 * indirect_k`` on a missed ack: O(1) in N. State: one ``(status, incarnation, address)``
entry per member (the compact member list) plus O(log N) queued updates.

**While two daemons disagree about the live set** (a change is still spreading: O(log N)
periods, or a suspect not yet confirmed), they compute HRW owners over different sets. For
every disputed member D only the keys whose top HRW score is D's are affected: at most
1/|live| of a snapshot's chunks per disputed member. A daemon that counts D alive asks D (one
read of the bucket, by D); one that counts D dead takes the chunk's next owner, which may read
it too: at most one duplicate bucket read per such chunk per disagreement, i.e. at most
``disputed / readers`` of S (bench/fleetsim measures it as ``egress / S``). Suspects stay in
the live set until confirmed dead (as in memberlist), so a slow ack alone moves no owners.
"""

from __future__ import annotations

import bisect
import math
import random
from dataclasses import dataclass, field

from bdn.control import Now
from bdn.control.broadcasts import Broadcasts
from bdn.control.members import MemberBase, MemberTable, SwimEntry
from bdn.control.probation import Probation
from bdn.control.probeorder import ProbeOrder
from bdn.control.swimtable import TableSync, _accusable
from bdn.control.swimwire import (  # noqa: F401  (re-exported: callers import them from here)
    ALIVE,
    DEAD,
    KINDS,
    MAX_ADDR,
    MAX_INCARNATION,
    MAX_NODE_ID,
    MAX_SYNC_ENTRIES,
    MAX_UPDATES_PER_MESSAGE,
    STATUS_NAMES,
    SUSPECT,
    Message,
    SwimError,
    Update,
)


@dataclass
class _Probe:
    target: str
    seq: int
    started: float
    indirect_sent: bool = False
    acked: bool = False


@dataclass
class _Relay:
    asker: str
    asker_seq: int
    expires: float


@dataclass
class Swim(TableSync):
    """One daemon's SWIM state machine. Call :meth:`tick` at least at :meth:`next_deadline`.

    ``self_id``/``self_addr``: this daemon. ``clock``: seconds. ``rng``: injected randomness
    (probe order, indirect helpers). Public reads: :meth:`live` (sorted node ids, this daemon
    included), :attr:`epoch` (increments whenever that set changes), :meth:`addr`.
    """

    self_id: str
    self_addr: str
    clock: Now
    rng: random.Random = field(default_factory=random.Random)
    period_s: float = 1.0
    ack_timeout_s: float = 0.25
    indirect_k: int = 3
    suspect_mult: float = 4.0
    retransmit_mult: int = 4
    max_piggyback: int = 32  # a 5 % join burst at N = 1,000 must not queue behind the message budget
    sync_interval_s: float = 30.0
    dead_forget_s: float = 3600.0
    probation: bool = True
    probation_per_source: int = 16
    probation_limit: int = 256
    confirmers: int = 16  # expected daemons that probe one newcomer (bdn.control.probation.confirms)

    def __post_init__(self) -> None:
        now = self.clock()
        self.incarnation = 0
        self.epoch = 0
        self._members = MemberTable()  # a dict, or a shared fleet list + changes (join_shared)
        self._probes = ProbeOrder(self.rng)  # whom to probe next (SWIM §4.3)
        self._queue = Broadcasts(self.retransmit_mult, self.max_piggyback)  # updates to piggyback
        self._probe: _Probe | None = None
        self._relays: dict[int, _Relay] = {}
        self._seq = 0
        self._next_period = now
        self._next_sync = now + self.rng.uniform(0.5, 1.0) * self.sync_interval_s
        self._live_cache: tuple[str, ...] | None = None
        self._live_pending: list[str] = []  # members changed since _live_cache was right
        self._suspects: dict[str, float] = {}  # node -> suspected since (timers without scanning)
        self._dead: dict[str, float] = {}  # node -> dead since (forgotten after dead_forget_s)
        #: Nodes whose live/dead standing changed, in order, for callers that update derived
        #: state incrementally (:meth:`bdn.control.owners.OwnerMap.affected_by`); drain it.
        self.changes: list[str] = []
        self.synced = False  # holds a full table (see join)
        self._probation = Probation(
            self.probation_per_source, self.probation_limit, 30.0 * self.period_s, probe_after_s=2.0 * self.period_s
        )
        self._confirm: dict[int, tuple[str, float]] = {}  # seq -> (newcomer probed, when)
        self._seed_asks: dict[str, float] = {}  # seed node id ("" = not known yet) -> when asked
        self.periods = 0  # protocol periods run (a metric: messages per period)
        self.sent = 0  # messages returned for sending (a metric)
        self.received = 0

    # ---- reads ----------------------------------------------------------------------------
    def live(self) -> tuple[str, ...]:
        """Node ids counted live for HRW (alive or suspect, and this daemon), sorted."""
        if self._live_pending and self._live_cache is not None:
            # a few members flipped since the last call: patch the sorted tuple (O(N) memmove
            # each) instead of rebuilding it from the whole table (O(N log N) in Python: at
            # N = 10,000 that rebuild, after every admission, was most of bench/fleetsim's time)
            ids = list(self._live_cache)
            for node in dict.fromkeys(self._live_pending):
                i = bisect.bisect_left(ids, node)
                present = i < len(ids) and ids[i] == node
                if self.is_live(node):
                    if not present:
                        ids.insert(i, node)
                elif present:
                    del ids[i]
            self._live_cache = tuple(ids)
        self._live_pending.clear()
        if self._live_cache is None:
            if self._members.pristine() and self.self_id in self._members.base.index:
                self._live_cache = self._members.base.sorted_ids  # shared by every view (join_shared)
                return self._live_cache
            ids = [n for n, m in self._members.items() if m.status != DEAD]
            ids.append(self.self_id)
            self._live_cache = tuple(sorted(ids))
        return self._live_cache

    def is_live(self, node: str) -> bool:
        """True for this daemon and for members alive or suspect (O(1))."""
        if node == self.self_id:
            return True
        st = self._members.status_of(node)
        return st is not None and st != DEAD

    def status(self, node: str) -> str | None:
        if node == self.self_id:
            return "alive"
        m = self._members.get(node)
        return STATUS_NAMES[m.status] if m else None

    def addr(self, node: str) -> str | None:
        """The member's address (a newcomer on probation's too: it is probed there)."""
        m = self._members.get(node)
        if m:
            return m.addr
        if node == self.self_id:
            return self.self_addr
        w = self._probation.get(node)
        return w.update.addr if w is not None else None

    @property
    def newcomers(self) -> Probation:
        """The newcomers on probation, waiting for a confirmation probe (counts: ``refused``,
        ``confirmed``, ``dropped``)."""
        return self._probation

    def table_size(self) -> int:
        return len(self._members)

    def state_bytes(self) -> int:
        """Rough control-state size: per member id + address + two ints, plus the queue."""
        per = sum(len(n) + len(m.addr) + 16 for n, m in self._members.items())
        return per + 48 * len(self._queue)

    def sync_period(self) -> float:
        """``sync_interval_s`` scaled as memberlist's push-pull: x(ceil(log2 N - 5) + 1) above 32."""
        n = len(self._members) + 1
        return self.sync_interval_s * (1 + max(0, math.ceil(math.log2(n) - 5)))

    def next_deadline(self) -> float:
        """The clock time at which :meth:`tick` has something to do."""
        t = min(self._next_period, self._next_sync)
        if self._probe is not None and not self._probe.acked and not self._probe.indirect_sent:
            t = min(t, self._probe.started + self.ack_timeout_s)
        return t

    # ---- joining ---------------------------------------------------------------------------
    def join(self, seeds: dict[str, str], complete: bool = False) -> list[Message]:
        """Add ``seeds`` (node id -> address) as alive and ask one of them for the whole table.

        ``complete``: the seeds are the whole fleet (a discovery source every node agrees on):
        :attr:`synced` at once. Otherwise :attr:`synced` turns True with the first ``sync_ack``;
        until then the view is partial, and callers keep this daemon out of HRW roles (a joiner
        that counted only its seeds would own most chunks and read them from the bucket again).
        """
        now = self.clock()
        self.synced = self.synced or complete or not seeds
        for node, addr in seeds.items():
            if node != self.self_id and node not in self._members:
                self._members[node] = SwimEntry(ALIVE, 0, addr, now)
                self._probes.append(node)
        self._probes.shuffle()  # each member its own random probe order (SWIM §4.3)
        self._changed()
        self.changes.clear()  # a whole new table: callers rebuild from live()
        self._enqueue(Update(self.self_id, ALIVE, self.incarnation, self.self_addr))
        # A second full exchange a few periods later: seeds that joined at the same moment knew
        # little at the first one (a fleet starting together).
        self._next_sync = now + self.rng.uniform(2.0, 4.0) * self.period_s
        if not seeds:
            return []
        seed = self.rng.choice(sorted(n for n in seeds if n != self.self_id) or [None])
        return [] if seed is None else [self.sync_to(seed)]

    def join_shared(self, base: MemberBase) -> None:
        """Start from a fleet list every node agrees on (as ``join(seeds, complete=True)``),
        held once for all the views that share it (:mod:`bdn.control.members`): this table
        stores only what changes from it. Call on a fresh instance; :attr:`synced` at once."""
        now = self.clock()
        self._members = MemberTable(base, self.self_id)
        self._probes.start_base(self._members)
        self.synced = True
        self._changed()
        self.changes.clear()
        self._enqueue(Update(self.self_id, ALIVE, self.incarnation, self.self_addr))
        self._next_sync = now + self.rng.uniform(2.0, 4.0) * self.period_s

    def readvertise(self, addr: str) -> None:
        """This daemon's address changed (e.g. its transfer server bound a port): gossip it with
        a new incarnation, so it overrides every older entry."""
        if addr != self.self_addr:
            self.self_addr = addr
            self.incarnation = min(self.incarnation + 1, MAX_INCARNATION)
            self._enqueue(Update(self.self_id, ALIVE, self.incarnation, self.self_addr))

    # ---- the protocol ----------------------------------------------------------------------
    def tick(self) -> list[Message]:
        """Advance timers; returns the messages to send now."""
        now = self.clock()
        out: list[Message] = []
        p = self._probe
        if p is not None and not p.acked and not p.indirect_sent and now >= p.started + self.ack_timeout_s:
            p.indirect_sent = True
            helpers = [n for n in self._alive_others() if n != p.target]
            for h in self.rng.sample(helpers, min(self.indirect_k, len(helpers))):
                out.append(self._out("ping_req", h, seq=p.seq, target=p.target))
        if now >= self._next_period:
            self._end_period(now)
            self.periods += 1
            self._next_period = now + self.period_s
            # Every other period with newcomers waiting, the period's one ping is a confirmation
            # probe (bdn.control.probation): the messages per period stay those of SWIM, and
            # failure detection keeps at least half its pace whatever arrives.
            w = self._probation.next_probe(now, self._confirms) if self.periods % 2 and len(self._probation) else None
            if w is not None:
                self._seq += 1
                node = w.update.node
                self._confirm[self._seq] = (node, now)
                out.append(self._out("ping", node, seq=self._seq))
            else:
                target = self._probes.next(self._members)
                if target is not None:
                    self._seq += 1
                    self._probe = _Probe(target, self._seq, now)
                    out.append(self._out("ping", target, seq=self._seq))
        if now >= self._next_sync:
            self._next_sync = now + self.sync_period()
            others = self._alive_others()
            if others:
                out.append(self._out("sync", self.rng.choice(others), updates=self._table()))
        self._expire(now)
        return out

    def receive(self, msg: Message) -> list[Message]:
        """Handle one message addressed to this daemon; returns the answers to send."""
        if msg.dst != self.self_id or msg.kind not in KINDS:
            return []
        self.received += 1
        now = self.clock()
        if msg.src in self._probation:
            self._admit(msg.src, now)  # heard from directly
        if msg.kind in ("sync", "sync_ack"):
            seeded = msg.kind == "sync_ack" and self._seed_answer(msg.src)
            self._apply_table(msg.src, msg.updates[:MAX_SYNC_ENTRIES], now, seeded)
        else:
            for u in msg.updates[:MAX_UPDATES_PER_MESSAGE]:
                self._apply(u, now, src=msg.src)
        if msg.kind == "ping":
            return [self._out("ack", msg.src, seq=msg.seq)]
        if msg.kind == "ack":
            p = self._probe
            if p is not None and msg.seq == p.seq:
                p.acked = True
                return []
            c = self._confirm.pop(msg.seq, None)
            if c is not None:
                if c[0] == msg.src:
                    self._admit(msg.src, now)  # (already admitted above: it sent this ack)
                return []
            r = self._relays.pop(msg.seq, None)
            if r is not None:
                return [self._out("ack", r.asker, seq=r.asker_seq)]
            return []
        if msg.kind == "ping_req":
            if not msg.target or msg.target == self.self_id:
                return [self._out("ack", msg.src, seq=msg.seq)]
            self._seq += 1
            self._relays[self._seq] = _Relay(msg.src, msg.seq, now + self.period_s)
            return [self._out("ping", msg.target, seq=self._seq)]
        if msg.kind == "sync":
            return [self._out("sync_ack", msg.src, updates=self._table())]
        if msg.kind == "sync_ack" and not self.synced:
            self.synced = True
            self._changed()  # callers re-plan: the view is whole now
            return self._ping_confirmers(now)
        return []

    # ---- internals -------------------------------------------------------------------------
    def _out(
        self, kind: str, dst: str, *, seq: int = 0, target: str = "", updates: tuple[Update, ...] | None = None
    ) -> Message:
        self.sent += 1
        ups = self._piggyback() if updates is None else updates
        return Message(kind, self.self_id, dst, seq, target, ups)

    def _enqueue(self, u: Update) -> None:
        self._queue.add(u.node, u)  # a newer update about a node replaces the older one

    def _piggyback(self) -> tuple[Update, ...]:
        return self._queue.take(len(self._members))

    def _alive_others(self) -> list[str]:
        return [n for n, m in self._members.items() if m.status != DEAD]

    def _end_period(self, now: float) -> None:
        p = self._probe
        self._probe = None
        if p is None or p.acked:
            return
        m = self._members.get(p.target)
        if m is not None and m.status == ALIVE:
            inc = _accusable(m.incarnation)
            self._set(p.target, m, SUSPECT, inc, now)
            self._enqueue(Update(p.target, SUSPECT, inc, m.addr))

    def _suspect_timeout(self) -> float:
        n = len(self._members) + 1
        return self.suspect_mult * max(1.0, math.log10(n + 1)) * self.period_s

    def _expire(self, now: float) -> None:
        if self._suspects:
            timeout = self._suspect_timeout()
            for node in [n for n, t in self._suspects.items() if now - t >= timeout]:
                m = self._members[node]
                inc = _accusable(m.incarnation)
                self._set(node, m, DEAD, inc, now)
                self._enqueue(Update(node, DEAD, inc, m.addr))
        if self._dead:
            for node in [n for n, t in self._dead.items() if now - t >= self.dead_forget_s]:
                del self._dead[node]
                self._members.pop(node, None)
        for seq in [s for s, r in self._relays.items() if r.expires <= now]:
            del self._relays[seq]
        for seq in [s for s, (_n, t) in self._confirm.items() if now - t >= self.period_s]:
            node, _t = self._confirm.pop(seq)
            if node not in self._members:
                self._probation.drop(node)  # unanswered: it never was a member

    def _set(self, node: str, m: SwimEntry, status: int, inc: int, now: float) -> None:
        was_live = m.status != DEAD
        if status != m.status:
            m.changed_at = now
        m.status, m.incarnation = status, inc
        self._members[node] = m  # a base member's entry is a copy: store it (bdn.control.members)
        if status == SUSPECT:
            self._suspects.setdefault(node, now)
        else:
            self._suspects.pop(node, None)
        if status == DEAD:
            self._dead[node] = now
        else:
            self._dead.pop(node, None)
        if was_live != (status != DEAD):
            self._changed(node)

    def _changed(self, node: str | None = None) -> None:
        if node is None or node == self.self_id or self._live_cache is None or len(self._live_pending) >= 64:
            self._live_cache = None
            self._live_pending.clear()
        else:
            self._live_pending.append(node)
        self.epoch += 1
        if node is not None:
            self.changes.append(node)
            if len(self.changes) > 4096:
                del self.changes[:2048]  # a caller that never drains: keep the newest
