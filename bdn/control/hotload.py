"""Hot-load at fleet scale: targets ordered by the trainer, spread by gossip, status aggregated.

- **Order.** A :class:`Target` is ordered by ``(policy_version, published_at, identity)``: the
  policy version the trainer gave the snapshot, then the manifest's ``created_at`` (the
  trainer's publish time), then the identity as the last tie-break. Nothing here reads a
  daemon's clock, so the daemon that accepts a POST cannot reorder hot-loads, and two POSTs of
  the same snapshot through different daemons are the same target.
- **Spread.** A daemon that adopts a newer target pushes it at once to ``fanout`` random live
  members (infect-and-forward, as memberlist's gossip), and piggybacks its current target on
  every membership message (anti-entropy for anything a push missed). Newly infected members
  forward once, so the target reaches N members in about ``log_fanout(N)`` hops, and every
  member within O(log N) membership periods even if pushes are lost.
- **Fleet status without N requests.** Each replica reports its stage to the ``aggregators``
  (the top few live nodes by HRW score of ``"status" + identity``) when its stage changes and
  every ``report_interval_s``; ``GET /hot_load/v1/models/hot_load`` on any daemon asks those few
  and merges. Rows are paginated as the hosted APIs do: ``page_size`` default 50, max 1,000,
  ``page_token`` opaque (the last node id of the previous page, hex).

Pure: time comes from an injected clock; the caller sends what these functions return.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from bdn.control import Now
from bdn.proto import hrw
from bdn.proto.identity import IdentityError, validate_identity

DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 1000


class HotLoadError(ValueError):
    """A malformed target, status report or page request (untrusted input)."""


@dataclass(frozen=True, order=True)
class Target:
    """A hot-load target; comparison operators follow :attr:`order`.

    ``policy_version``: the trainer's integer (>= 0). ``published_at``: the manifest's
    ``created_at`` (seconds since the epoch, float, as the trainer wrote it).
    """

    policy_version: int
    published_at: float
    identity: str

    @property
    def order(self) -> tuple[int, float, str]:
        return (self.policy_version, self.published_at, self.identity)

    def wire(self) -> list:
        return [self.policy_version, self.published_at, self.identity]

    @classmethod
    def from_wire(cls, obj: object) -> Target:
        """Raises HotLoadError on anything but ``[int >= 0, finite number >= 0, identity]``."""
        if not isinstance(obj, (list, tuple)) or len(obj) != 3:
            raise HotLoadError("target must be [policy_version, published_at, identity]")
        pv, at, ident = obj
        if not isinstance(pv, int) or isinstance(pv, bool) or not 0 <= pv < 2**63:
            raise HotLoadError("target policy_version must be an integer in [0, 2^63)")
        if not isinstance(at, (int, float)) or isinstance(at, bool) or not 0 <= at < 1e11:
            raise HotLoadError("target published_at must be a number of seconds in [0, 1e11)")
        try:
            validate_identity(ident)
        except IdentityError as e:
            raise HotLoadError(f"target identity: {e}") from None
        return cls(pv, float(at), ident)


class TargetGossip:
    """One daemon's current hot-load target and what to push of it.

    ``fanout``: members a newly adopted target is pushed to. :attr:`adopted_at` is the local
    clock time of the last adoption (for metrics only: it orders nothing).
    """

    def __init__(self, self_id: str, clock: Now, rng: random.Random | None = None, fanout: int = 3) -> None:
        self.self_id = self_id
        self.clock = clock
        self.rng = rng or random.Random()
        self.fanout = fanout
        self.current: Target | None = None
        self.adopted_at: float | None = None

    def offer(self, target: Target, live: Sequence[str] | Callable[[], Sequence[str]]) -> list[str]:
        """A target from a POST, a push or a piggyback. Returns the members to push it to
        (empty when it is not newer than the current one). ``live``: the live node ids, or a
        callable giving them (called only when the target is adopted: every membership message
        carries a target, and the live set of a large fleet is not rebuilt for each)."""
        if self.current is not None and target.order <= self.current.order:
            return []
        self.current = target
        self.adopted_at = self.clock()
        if callable(live):
            live = live()
        others = [n for n in live if n != self.self_id]
        return self.rng.sample(others, min(self.fanout, len(others)))

    def piggyback(self) -> list | None:
        """The wire form to attach to every outgoing membership message."""
        return None if self.current is None else self.current.wire()


def aggregators(live: Iterable[str], identity: str, count: int = 3) -> list[str]:
    """The ``count`` live nodes that collect replica stages for ``identity`` (HRW, stable)."""
    return hrw.rank(live, "status\x00" + identity)[: max(1, count)]


class _Keyed(Protocol):
    @property
    def node(self) -> str: ...


_R = TypeVar("_R", bound=_Keyed)  # a Row of the fleet GET


def merge(boards: Iterable[Sequence[_R]], made_at: Callable[[_R], float]) -> list[_R]:
    """Rows from several aggregators, one per node, sorted by node. Of a node's rows the one
    with the largest ``made_at`` wins (the replica's own clock when it made the row: the
    aggregators saw different reports of it); on a tie, the later board's."""
    by_node: dict[str, _R] = {}
    for rows in boards:
        for r in rows:
            seen = by_node.get(r.node)
            if seen is None or made_at(r) >= made_at(seen):
                by_node[r.node] = r
    return [by_node[n] for n in sorted(by_node)]


def page_params(page_size: object = None, page_token: object = None) -> tuple[int, str | None]:
    """Validate query parameters: page size (default 50, 1..1000) and the opaque token.

    Raises:
        HotLoadError: a page size that is not an integer in 1..1000, or a malformed token.
    """
    if page_size is None or page_size == "":
        size = DEFAULT_PAGE_SIZE
    else:
        try:
            size = int(page_size)  # type: ignore[call-overload]  # any query value: int() raising is the check
        except (TypeError, ValueError):
            raise HotLoadError("page_size must be an integer") from None
        if not 1 <= size <= MAX_PAGE_SIZE:
            raise HotLoadError(f"page_size must be between 1 and {MAX_PAGE_SIZE}")
    if page_token in (None, ""):
        return size, None
    if not isinstance(page_token, str) or len(page_token) > 2 * 128 or len(page_token) % 2:
        raise HotLoadError("malformed page_token")
    try:
        after = bytes.fromhex(page_token).decode()
    except (ValueError, UnicodeDecodeError):
        raise HotLoadError("malformed page_token") from None
    return size, after


def paginate(rows: Sequence[_R], page_size: int, after: str | None) -> tuple[list[_R], str]:
    """One page of ``rows`` (sorted by node) after node ``after``; returns (page, next_token),
    next_token ``""`` on the last page."""
    start = 0
    if after is not None:
        lo, hi = 0, len(rows)
        while lo < hi:  # first row with node > after
            mid = (lo + hi) // 2
            if rows[mid].node <= after:
                lo = mid + 1
            else:
                hi = mid
        start = lo
    page = list(rows[start : start + page_size])
    more = start + page_size < len(rows)
    return page, (page[-1].node.encode().hex() if more and page else "")


@dataclass(frozen=True)
class Row:
    """One replica's whole entry of the fleet GET (``data``: the JSON map ``GET replica`` gives),
    as an aggregator keeps it; ``node`` is the replica's node id (what pages are sorted by)."""

    node: str
    identity: str
    data: dict


class ReplicaBoard:
    """An aggregator's rows: the latest :class:`Row` per node, for the targets it aggregates.

    A row older than ``ttl_s`` (the replica stopped reporting: dead, or it reports elsewhere
    now) is dropped on read. At most ``max_rows`` (one per member of the fleet); a new node
    past that is refused with HotLoadError.
    """

    def __init__(self, clock: Now, ttl_s: float = 30.0, max_rows: int = 100_000) -> None:
        self.clock = clock
        self.ttl_s = ttl_s
        self.max_rows = max_rows
        self._rows: dict[str, tuple[Row, float]] = {}

    def put(self, row: Row) -> None:
        if row.node not in self._rows and len(self._rows) >= self.max_rows:
            self._expire()
            if len(self._rows) >= self.max_rows:
                raise HotLoadError("status board full")
        self._rows[row.node] = (row, self.clock())

    def _expire(self) -> None:
        cutoff = self.clock() - self.ttl_s
        for n in [n for n, (_, t) in self._rows.items() if t < cutoff]:
            del self._rows[n]

    def rows(self, identity: str | None = None) -> list[Row]:
        """Current rows sorted by node id (optionally of one target identity)."""
        self._expire()
        return sorted(
            (r for r, _ in self._rows.values() if identity is None or r.identity == identity), key=lambda r: r.node
        )

    def __len__(self) -> int:
        return len(self._rows)


def report_interval(base_s: float, live_n: int, per_aggregator_per_s: float = 10.0) -> float:
    """How often a replica re-reports an unchanged stage: ``base_s``, stretched so that the
    refreshes reaching each aggregator (every one of the ``live_n`` replicas reports to each)
    stay under ``per_aggregator_per_s`` whatever the fleet size. Changes are reported at once."""
    return max(base_s, live_n / max(per_aggregator_per_s, 1e-9))


def summary(rows: Iterable[Row], stage_of: Callable[[Row], str]) -> dict[str, int]:
    """Replicas per stage over every row (not one page): ``{"done": 998, "loading": 2}``."""
    out: dict[str, int] = {}
    for r in rows:
        s = stage_of(r)
        out[s] = out.get(s, 0) + 1
    return out
