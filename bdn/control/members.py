"""SWIM's member table: a plain dict, or a shared immutable fleet list plus this node's changes.

A daemon that starts from a discovery source every node agrees on (a headless Service's
endpoints, or the fleet simulator's initial fleet) begins with the same N members, all alive at
incarnation 0, as every other daemon. :class:`MemberBase` holds that list once (ids, addresses,
the sorted live tuple, an index); :class:`MemberTable` is one node's view of it: a mapping
``node -> SwimEntry`` that reads through to the base and stores only what this node changed
(a status, an incarnation, an address, a joiner, a forgotten member). So N simulated daemons
in one process hold O(N + changes) entries instead of N x N (10^8 at N = 10,000: 2.8 GB per
process), and a real daemon's table is the same compact list it always was.

Contract (what :class:`bdn.control.swim.Swim` relies on): :meth:`MemberTable.get` of a member
that lives only in the base returns a *fresh* :class:`SwimEntry`; a caller that changes it writes
it back (``table[node] = m``). ``len`` is O(1). Iteration yields base members not overridden,
then this node's own entries. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from math import gcd

ALIVE = 0


@dataclass(slots=True)
class SwimEntry:
    """One member's entry in SWIM's table: ``status`` (``bdn.control.swimwire``: alive, suspect,
    dead), its ``incarnation``, its SWIM address and when its status last changed (not
    ``bdn.daemon.swarm.membership.Member``, the daemon's record of a peer it fetches from)."""

    status: int
    incarnation: int
    addr: str
    changed_at: float  # when the status last changed (suspicion timer start)


class MemberBase:
    """An immutable fleet list shared by every view: ``members`` node id -> address (all alive,
    incarnation 0, known since ``t0`` seconds)."""

    __slots__ = ("ids", "addrs", "index", "sorted_ids", "t0", "cache")

    def __init__(self, members: Mapping[str, str], t0: float = 0.0) -> None:
        self.ids: tuple[str, ...] = tuple(members)
        self.addrs: tuple[str, ...] = tuple(members.values())
        self.index: dict[str, int] = {n: i for i, n in enumerate(self.ids)}
        self.sorted_ids: tuple[str, ...] = tuple(sorted(self.ids))
        self.t0 = t0
        self.cache: dict[str, object] = {}  # derived immutable views, built once by their users

    def __len__(self) -> int:
        return len(self.ids)


class MemberTable:
    """One node's member table over an optional :class:`MemberBase` (``self_id`` is never a
    member of its own table). Without a base it is a dict."""

    __slots__ = ("base", "self_id", "own", "gone", "_n")

    def __init__(self, base: MemberBase | None = None, self_id: str = "") -> None:
        self.base = base
        self.self_id = self_id
        self.own: dict[str, SwimEntry] = {}  # this node's entries (changed base members, others)
        self.gone: set[str] = set()  # base members removed from this table (and self)
        if base is not None and self_id in base.index:
            self.gone.add(self_id)
        self._n = 0 if base is None else len(base) - len(self.gone)

    def _in_base(self, node: str) -> bool:
        return self.base is not None and node in self.base.index and node not in self.gone

    def pristine(self) -> bool:
        """True while this table is the base exactly (minus self): live() can share its tuple."""
        return self.base is not None and not self.own and self.gone <= {self.self_id}

    def get(self, node: str, default: SwimEntry | None = None) -> SwimEntry | None:
        m = self.own.get(node)
        if m is not None:
            return m
        if self._in_base(node):
            assert self.base is not None  # _in_base is False without a base
            return SwimEntry(ALIVE, 0, self.base.addrs[self.base.index[node]], self.base.t0)
        return default

    def status_of(self, node: str) -> int | None:
        """The member's status without building an entry (None: not a member)."""
        m = self.own.get(node)
        if m is not None:
            return m.status
        return ALIVE if self._in_base(node) else None

    def __contains__(self, node: object) -> bool:
        return node in self.own or (isinstance(node, str) and self._in_base(node))

    def __getitem__(self, node: str) -> SwimEntry:
        m = self.get(node)
        if m is None:
            raise KeyError(node)
        return m

    def __setitem__(self, node: str, m: SwimEntry) -> None:
        if node not in self.own and not self._in_base(node):
            self._n += 1
        self.own[node] = m

    def pop(self, node: str, default: SwimEntry | None = None) -> SwimEntry | None:
        m = self.get(node)
        if m is None:
            return default
        self.own.pop(node, None)
        if self.base is not None and node in self.base.index:
            self.gone.add(node)
        self._n -= 1
        return m

    def __delitem__(self, node: str) -> None:
        if self.pop(node) is None:
            raise KeyError(node)

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[str]:
        return (n for n, _m in self.items())

    def items(self) -> Iterator[tuple[str, SwimEntry]]:
        b = self.base
        if b is not None:
            own, gone = self.own, self.gone
            for n, a in zip(b.ids, b.addrs):
                if n not in own and n not in gone:
                    yield n, SwimEntry(ALIVE, 0, a, b.t0)
        yield from self.own.items()

    def base_order(self, rng_random: float, rng_stride: float) -> Sequence[str] | None:
        """The base ids in a pseudo-random round-robin order, lazily: index ``(a + i * s) mod n``
        with ``s`` coprime to ``n`` (every base member once per round, O(1) memory instead of a
        shuffled list of N per node). ``rng_*``: uniform draws in [0, 1). None without a base."""
        if self.base is None or not len(self.base):
            return None
        return _Strided(self.base.ids, rng_random, rng_stride)


class _Strided(Sequence):
    """A read-only permutation of ``ids``: position i holds ``ids[(a + i * s) % n]``."""

    __slots__ = ("ids", "a", "s")

    def __init__(self, ids: tuple[str, ...], u: float, v: float) -> None:
        n = len(ids)
        self.ids = ids
        self.a = int(u * n) % n
        s = 1 + int(v * max(1, n - 1))
        while gcd(s, n) != 1:
            s += 1
        self.s = s % n or 1

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self.ids)
        if not -n <= i < n:
            raise IndexError(i)
        return self.ids[(self.a + (i % n) * self.s) % n]
