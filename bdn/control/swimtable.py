"""SWIM's member table: whole-table sync, applying updates, and the admission wiring.

The part of :class:`bdn.control.swim.Swim` that decides what enters this daemon's table: a
``sync``/``sync_ack`` table (:meth:`TableSync._apply_table`), each gossiped update with SWIM's
precedence (:meth:`TableSync._apply`, §4.2 of the paper, :func:`_overrides`), newcomers heard of
second-hand sent to probation and admitted from it (:mod:`bdn.control.probation`: a second
member's word, a designated confirmer's word, its own message, its probe's answer), and a
joiner's pings to its own confirmers. Split out of ``swim.py`` (fleet branch) along that
responsibility without changing behaviour; :class:`TableSync` is a mixin that only
:class:`~bdn.control.swim.Swim` uses (it reads and writes Swim's fields).

Pure: time from the caller; no I/O.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bdn.control import Now
from bdn.control.members import SwimEntry
from bdn.control.probation import confirms
from bdn.control.swimwire import ALIVE, DEAD, MAX_INCARNATION, SUSPECT, Message, Update


class TableSync:
    """Table sync and admission for :class:`~bdn.control.swim.Swim` (a mixin: Swim's fields)."""

    # the fields of Swim these methods use (set by Swim.__post_init__)
    _members: Any
    _probation: Any
    _probes: Any
    _seed_asks: dict
    _suspects: dict
    self_id: str
    self_addr: str
    incarnation: int
    probation: bool
    confirmers: int
    rng: Any
    clock: Now
    _seq: int

    if TYPE_CHECKING:  # the methods of Swim these use (bdn/control/swim.py)

        def _out(
            self, kind: str, dst: str, *, seq: int = 0, target: str = "", updates: tuple[Update, ...] | None = None
        ) -> Message: ...
        def _alive_others(self) -> list[str]: ...
        def is_live(self, node: str) -> bool: ...
        def _enqueue(self, u: Update) -> None: ...
        def _set(self, node: str, m: SwimEntry, status: int, inc: int, now: float) -> None: ...
        def _changed(self, node: str | None = None) -> None: ...

    def sync_to(self, dst: str) -> Message:
        """A ``sync`` (the whole table) to ``dst`` ("" = a seed whose node id is not known yet:
        its transport addresses it by URL and the receiver reads it as addressed to itself).
        ``dst`` is a seed: the table its answer carries is admitted whole (no probation)."""
        now = self.clock()
        for k in [k for k, t in self._seed_asks.items() if now - t > 60.0]:
            del self._seed_asks[k]
        if len(self._seed_asks) < 4096:
            self._seed_asks[dst] = now
        return self._out("sync", dst, updates=self._table())

    def _ping_confirmers(self, now: float) -> list[Message]:
        """A joiner's first whole table: one ping to each of its designated confirmers
        (:func:`bdn.control.probation.confirms`), which admits it there at once (heard from
        directly); their word then admits it elsewhere. Once per join: O(N) hashes, about
        ``confirmers`` messages (and their acks)."""
        n = len(self._members) + 1
        if not self.probation or n <= 2 * self.confirmers or self.confirmers <= 0:
            return []
        out = []
        for node in self._alive_others():
            if confirms(node, self.self_id, n, self.confirmers):
                self._seq += 1
                out.append(self._out("ping", node, seq=self._seq))
        return out[: 4 * self.confirmers]

    def _table(self) -> tuple[Update, ...]:
        t = self._members
        if t.base is not None:  # the base's entries as shared Update objects, built once per base
            ups = t.base.cache.get("updates")
            if ups is None:
                ups = t.base.cache["updates"] = tuple(Update(n, ALIVE, 0, a) for n, a in zip(t.base.ids, t.base.addrs))
            own, gone = t.own, t.gone
            rows = [u for u in ups if u.node not in own and u.node not in gone]
            rows += [Update(n, m.status, m.incarnation, m.addr) for n, m in own.items()]
            rows.append(Update(self.self_id, ALIVE, self.incarnation, self.self_addr))
            return tuple(rows)
        rows = [Update(n, m.status, m.incarnation, m.addr) for n, m in t.items()]
        rows.append(Update(self.self_id, ALIVE, self.incarnation, self.self_addr))
        return tuple(rows)

    def _seed_answer(self, src: str) -> bool:
        """Is a ``sync_ack`` from ``src`` the answer to a sync we sent a seed?"""
        if self._seed_asks.pop(src, None) is not None:
            return True
        if "" in self._seed_asks:  # a seed addressed by URL: its node id was not known
            del self._seed_asks[""]
            return True
        return False

    def _admit(self, node: str, now: float) -> None:
        """A newcomer on probation was heard from directly: a member now, relayed."""
        w = self._probation.take(node)
        if w is not None and node not in self._members:
            self._apply(w.update, now, src=node)

    def _confirms(self, newcomer: str) -> bool:
        """Is this daemon one of ``newcomer``'s designated confirmers (it probes it)?"""
        return confirms(self.self_id, newcomer, len(self._members) + 1, self.confirmers)

    def _apply_table(self, src: str, updates: tuple[Update, ...], now: float, seeded: bool = False) -> None:
        """A whole table (``sync``/``sync_ack``) from ``src``. Members new to this table are
        appended and the probe order reshuffled once (random places, as :meth:`_apply` gives
        one: O(N), not O(N^2) for a joiner's first table), and they are not re-gossiped unless
        the entry is ``src`` itself (the sender knew them: gossiping a joiner's whole table,
        N updates, would fill every queue; anti-entropy syncs cover a straggler). ``seeded``:
        a seed's answer to our sync, admitted whole; otherwise newcomers wait on probation."""
        before = self._probes.own_count()
        for u in updates:
            self._apply(u, now, bulk=u.node != src, src=src if not seeded else "")
        if self._probes.own_count() > before:
            self._probes.shuffle()

    def _apply(self, u: Update, now: float, bulk: bool = False, src: str = "") -> None:
        """One update from ``src`` ("": a source admitted whole: a seed's table, the caller's)."""
        if u.status != ALIVE and u.incarnation > MAX_INCARNATION - 1:
            u = Update(u.node, u.status, MAX_INCARNATION - 1, u.addr)  # see MAX_INCARNATION
        if u.node == self.self_id:
            if u.status != ALIVE and u.incarnation >= _accusable(self.incarnation):
                self.incarnation = max(self.incarnation, u.incarnation + 1)  # refute (SWIM §4.2)
                self._enqueue(Update(self.self_id, ALIVE, self.incarnation, self.self_addr))
            return
        m = self._members.get(u.node)
        if m is None:
            if u.status == DEAD:
                if u.node in self._probation:
                    self._probation.drop(u.node)
                return  # never heard of it: nothing to forget
            if self.probation and src and src != u.node:
                # second-hand: it waits for a probe or a second member's word (bdn.control.probation)
                member = self.is_live(src)
                n = len(self._members) + 1
                strong = member and n > 2 * self.confirmers > 0 and confirms(src, u.node, n, self.confirmers)
                if self._probation.offer(u.node, u, src, now, member=member, confirmer=strong) is not None:
                    return
            m = self._members[u.node] = SwimEntry(u.status, u.incarnation, u.addr, now)
            if u.status == SUSPECT:
                self._suspects[u.node] = now
            if bulk:
                self._probes.append(u.node)  # the caller shuffles once (_apply_table)
            else:  # at a random place of this round, if one is under way (SWIM §4.3)
                self._probes.insert(u.node)
            self._changed(u.node)
            if not bulk:
                self._enqueue(u)
            return
        if _overrides(u, m):
            moved = bool(u.addr) and u.addr != m.addr and u.status != DEAD
            if u.addr:
                m.addr = u.addr
            self._set(u.node, m, u.status, u.incarnation, now)
            if moved:
                # a new address (e.g. the member's transfer server bound after its first
                # message): a change the daemon must apply, although its liveness did not flip
                self._changed(u.node)
            self._enqueue(Update(u.node, u.status, u.incarnation, m.addr))


def _accusable(incarnation: int) -> int:
    """The incarnation a suspicion or death of a member known at ``incarnation`` carries: the
    same, but at most ``MAX_INCARNATION - 1`` (the member refutes with ``MAX_INCARNATION``)."""
    return min(incarnation, MAX_INCARNATION - 1)


def _overrides(u: Update, m: SwimEntry) -> bool:
    """SWIM §4.2 precedence: alive(i) beats suspect/alive(j<i) and dead(j<i) (a restarted member
    that refuted its death); suspect(i) beats alive(j<=i) and suspect(j<i); dead(i) beats
    alive/suspect(j<=i)."""
    if u.status == ALIVE:
        return u.incarnation > m.incarnation
    if u.status == SUSPECT:
        if m.status == ALIVE:
            return u.incarnation >= m.incarnation
        if m.status == SUSPECT:
            return u.incarnation > m.incarnation
        return False
    return m.status != DEAD and u.incarnation >= m.incarnation
