"""Members heard of second-hand wait on probation until they answer a probe (SWIM admission).

A partition secret is shared by every daemon, so a member that holds it can sign messages as
any node id and gossip any table: one ``sync`` of 25,000 invented members (911 KB) used to
enter every receiver's live set and HRW at once, and stayed "alive" for hours since SWIM probes
one member per period (docs/TRUST.md, "Attacks tried"). The rule here bounds what one member can
add:

- A member new to this daemon, announced by a *source* other than itself (a piggybacked update
  or a table row from another member), is not a member yet: it waits here, on **probation**,
  out of the live set, out of HRW, not relayed and not in this daemon's tables.
- It becomes a member once it is heard from directly (a message whose authenticated source it
  is), once ``vouches`` (2) distinct members of this daemon's live set announced it (one member
  alone never reaches two: the others do not relay it while it waits, and node ids it signs
  as are not members here), or once it answers a **confirmation probe**: while newcomers have
  waited ``probe_after_s`` without that, every other period's one ping goes to the oldest of
  them instead of the next member of the round-robin order (:meth:`Probation.next_probe`), so
  the messages per period stay SWIM's whatever arrives and failure detection keeps at least
  half its pace. Unanswered, it is dropped (it never was a member: nothing to suspect or
  gossip). In an honest fleet a newcomer's gossip reaches most daemons from two relays within
  a few periods, so few probes are sent (a joiner is not pinged by every daemon at once).
- **Designated confirmers.** Not every daemon that waits on a newcomer probes it: only its
  ``confirmers`` (:func:`confirms`: about ``confirmers`` daemons of the fleet, picked by a hash
  of the two node ids that every daemon computes alike, as rendezvous hashing does), so a
  joiner answers about ``confirmers`` probes however large the fleet is (before: every daemon
  that heard of it second-hand probed it, ~20 % of 1,000 daemons in bench/fleetsim, 17.8
  messages per second at the joiner). The others wait for the second member's word: the
  confirmers learn it first-hand: a joiner that holds the fleet's table pings its own
  confirmers once (:meth:`bdn.control.swim.Swim`, ``_confirmers_of_self``), which admits it
  there (heard from directly). A designated confirmer's word is then worth two: a live member
  that :func:`confirms` the newcomer in this daemon's view admits it alone, at most one
  newcomer per source per ``strong_every_s`` (so a member adds at most one member per daemon
  per period this way, as by answering probes at its own addresses), and only in fleets of
  more than ``2 * confirmers`` members (in smaller ones every member confirms: one member's
  word must not be enough there). Why: with two ordinary words needed, a newcomer that a few
  daemons know first-hand spreads as a complex contagion (each daemon needs two relays), which
  from a few in 1,000 took 15-25 s in bench/fleetsim; the confirmers' relays admit at once.
- At most ``per_source`` newcomers per source wait at once, at most ``limit`` in all; more are
  dropped (counted in :attr:`Probation.refused`), as are those that waited ``ttl_s`` unprobed.
  An honest newcomer dropped here reaches this daemon again (from its own messages, from the
  next relays, from an anti-entropy sync).

So one member adds to a daemon's table at most ``per_source`` entries at a time, and to its live
set only members that answer probes under their node id, one per two periods at most. Exempt (the
caller admits them at once): the member's own entry, the seeds and shared fleet list the
operator configured, and the tables a joiner asked its seeds for before it held a full view.

The cost for honest fleets: each hop of a newcomer's gossip waits for one confirmation probe at
the receiver, so a burst of ``b`` joiners takes up to ``2 b`` periods to be counted by a daemon
that heard of them all second-hand (fewer: a joiner's own messages admit it at once).

Pure: time from the caller (seconds); no I/O.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from bdn.proto import hrw

_SPACE = 1 << 64  # hrw.score is a 64-bit hash


def confirms(member: str, newcomer: str, fleet_n: int, confirmers: int) -> bool:
    """Is ``member`` one of ``newcomer``'s designated confirmers in a fleet of ``fleet_n`` members?

    True for a ``confirmers / fleet_n`` share of the members, picked by the 64-bit hash of both
    node ids (:func:`bdn.proto.hrw.score` of ``member`` for ``"confirm" NUL newcomer``): every
    daemon computes the same answer without a ranking (O(1), not O(N)), so about
    ``confirmers`` members of any fleet probe a newcomer (Poisson; all of them when
    ``fleet_n <= confirmers``). ``confirmers`` 0: every member confirms (the rule before).
    """
    if confirmers <= 0 or fleet_n <= confirmers:
        return True
    return hrw.score(member, "confirm\x00" + newcomer) < _SPACE * confirmers // fleet_n


@dataclass
class Newcomer:
    """One waiting member: the update that announced it (an object of the caller's), its source
    and since when it waits; ``probed``: a confirmation probe was sent."""

    update: object
    source: str
    since: float
    probed: bool = False
    source_member: bool = False  # ``source`` was a live member then: a second one admits it


class Probation:
    """The newcomers waiting for a confirmation probe, bounded per source and in all.

    ``per_source``: most newcomers one source may have waiting; ``limit``: most in all;
    ``ttl_s``: seconds a newcomer may wait unprobed before it is dropped.
    """

    def __init__(
        self,
        per_source: int = 16,
        limit: int = 256,
        ttl_s: float = 30.0,
        probe_after_s: float = 0.0,
        strong_every_s: float = 1.0,
    ) -> None:
        if per_source < 1 or limit < 1 or ttl_s <= 0 or probe_after_s < 0:
            raise ValueError("per_source and limit must be >= 1, ttl_s > 0, probe_after_s >= 0")
        self.per_source, self.limit, self.ttl_s = per_source, limit, ttl_s
        self.probe_after_s = probe_after_s
        self.strong_every_s = strong_every_s
        self._strong_at: dict[str, float] = {}  # source -> when its confirmer's word last admitted
        self._waiting: dict[str, Newcomer] = {}  # node -> newcomer, oldest first
        self._by_source: Counter = Counter()
        self.refused = 0  # newcomers dropped over a bound (a metric)
        self.confirmed = 0
        self.dropped = 0  # probed and unanswered, or waited ttl_s

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, node: str) -> bool:
        return node in self._waiting

    def get(self, node: str) -> Newcomer | None:
        return self._waiting.get(node)

    def offer(
        self, node: str, update: object, source: str, now: float, member: bool = False, confirmer: bool = False
    ) -> bool | None:
        """``source`` announced ``node``, unknown here (``member``: ``source`` is in this daemon's
        live set; ``confirmer``: it is also one of ``node``'s designated confirmers, see the
        module docstring). True if it waits now (or waited already: the newer ``update``
        replaces the older); None when this was a second member's word or a confirmer's word
        within its rate: it is admitted (taken out, the caller makes it a member); False when a
        bound refused it."""
        if member and confirmer and now - self._strong_at.get(source, -1e18) >= self.strong_every_s:
            if len(self._strong_at) >= 4 * self.limit:  # bounded: forget the sources of long ago
                for k in [k for k, t in self._strong_at.items() if now - t >= self.strong_every_s]:
                    del self._strong_at[k]
            if len(self._strong_at) < 4 * self.limit:
                self._strong_at[source] = now
                if node in self._waiting:
                    self.take(node)
                else:
                    self.confirmed += 1
                return None
        w = self._waiting.get(node)
        if w is not None:
            w.update = update
            if member and source != w.source and w.source_member:
                self.take(node)
                return None
            if member and not w.source_member:  # a member's word counts, an unknown's does not
                self._uncount(w.source)
                w.source, w.source_member = source, True
                self._by_source[source] += 1
            return True
        if self._by_source[source] >= self.per_source or len(self._waiting) >= self.limit:
            self.refused += 1
            return False
        self._waiting[node] = Newcomer(update, source, now, source_member=member)
        self._by_source[source] += 1
        return True

    def take(self, node: str) -> Newcomer | None:
        """``node`` was heard from directly or answered its probe: it leaves probation (the caller
        makes it a member). None if it was not waiting."""
        w = self._pop(node)
        if w is not None:
            self.confirmed += 1
        return w

    def drop(self, node: str) -> None:
        """Its confirmation probe went unanswered: forget it."""
        if self._pop(node) is not None:
            self.dropped += 1

    def next_probe(self, now: float, eligible: Callable[[str], bool] | None = None) -> Newcomer | None:
        """The oldest newcomer not probed yet that ``eligible`` (None: every one; the caller's
        :func:`confirms`) lets this daemon probe, marked probed (None: nothing to probe);
        those that waited ``ttl_s`` unprobed are dropped first."""
        for node in [n for n, w in self._waiting.items() if not w.probed and now - w.since >= self.ttl_s]:
            self.drop(node)
        for node, w in self._waiting.items():
            if not w.probed and now - w.since >= self.probe_after_s and (eligible is None or eligible(node)):
                w.probed = True
                return w
        return None

    def _pop(self, node: str) -> Newcomer | None:
        w = self._waiting.pop(node, None)
        if w is not None:
            self._uncount(w.source)
        return w

    def _uncount(self, source: str) -> None:
        self._by_source[source] -= 1
        if self._by_source[source] <= 0:
            del self._by_source[source]
