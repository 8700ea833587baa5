"""SWIM's probe order: which member a daemon probes next (pure; the randomness is injected).

Source: SWIM (Das, Gupta, Motivala, DSN 2002), section 4.3: members are probed round-robin over
a random permutation, re-shuffled each round, and a member that joins is inserted at a random
place of the current round; so every member is probed within 2 x (N - 1) periods, not only in
expectation. With a shared fleet list (bdn.control.members.MemberBase, ``join_shared``) the
base members come from its lazy permutation (``base_order``) and the members this table holds
of its own from a shuffled list, interleaved at random in proportion to what each has left (as
one shuffled list would be). Split out of bdn.control.swim, which keeps the protocol.
"""

from __future__ import annotations

import random
from typing import Any

from bdn.control.swimwire import DEAD


class ProbeOrder:
    """The current round's remaining members. ``members`` arguments are the daemon's
    :class:`bdn.control.members.MemberTable` (``status_of``, ``items``, ``own``, ``base``,
    ``base_order``)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self._order: list[str] = []  # members of this round not probed yet (own ones, shuffled)
        self._round: Any = None  # with a shared base: its members' lazy order this round
        self._round_pos = 0

    def own_count(self) -> int:
        """Members left in the round's own list (callers compare it before and after adds)."""
        return len(self._order)

    def append(self, node: str) -> None:
        """Add ``node`` to this round; the caller shuffles once after a batch (:meth:`shuffle`)."""
        self._order.append(node)

    def shuffle(self) -> None:
        """Shuffle the round's own list (after a batch of :meth:`append`)."""
        self.rng.shuffle(self._order)

    def insert(self, node: str) -> None:
        """A member that joined: at a random place of the current round, if one is under way
        (otherwise the next round picks it up)."""
        if self._order or self._round is not None:
            self._order.insert(self.rng.randrange(len(self._order) + 1), node)

    def start_base(self, members: Any) -> None:
        """A shared base was adopted: the round starts over from its lazy order."""
        self._order = []
        self._base_round(members)

    def next(self, members: Any) -> str | None:
        """The member to probe now (not dead, not this daemon), or None when there is none."""
        while True:
            n = self._pop()
            if n is None:
                break
            st = members.status_of(n)
            if st is not None and st != DEAD:
                return n
        if members.base is not None:  # a new round: the base lazily, the rest shuffled
            self._base_round(members)
            self._order = [n for n, m in members.own.items() if m.status != DEAD]
            self.rng.shuffle(self._order)
            n = self._pop()
            while n is not None and members.status_of(n) in (None, DEAD):
                n = self._pop()
            return n
        alive = [n for n, m in members.items() if m.status != DEAD]
        if not alive:
            return None
        self.rng.shuffle(alive)
        self._order = alive
        return self._order.pop()

    def _base_round(self, members: Any) -> None:
        self._round = members.base_order(self.rng.random(), self.rng.random())
        self._round_pos = 0

    def _pop(self) -> str | None:
        left = len(self._round) - self._round_pos if self._round is not None else 0
        if left and (not self._order or self.rng.random() * (left + len(self._order)) < left):
            n = self._round[self._round_pos]
            self._round_pos += 1
            return n  # (a removed one is skipped by the caller)
        return self._order.pop() if self._order else None


__all__ = ["ProbeOrder"]
