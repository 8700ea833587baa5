"""Hot-load ordering, gossip, status aggregation and pagination (bdn/control/hotload.py)."""

from __future__ import annotations

import math
import random

import pytest

from bdn.control.hotload import (
    HotLoadError,
    ReplicaBoard,
    Row,
    Target,
    TargetGossip,
    aggregators,
    merge,
    page_params,
    paginate,
)


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_order_is_the_trainers_not_a_daemons_clock() -> None:
    a = Target(3, 1000.0, "step3")
    b = Target(4, 10.0, "step4")  # published "earlier" by clock, but a newer policy version
    assert b > a
    assert Target(4, 11.0, "step4b") > b > Target(4, 10.0, "step3z")  # identity breaks ties
    assert Target.from_wire(b.wire()) == b
    for bad in (None, [1, 2], [-1, 0, "s"], [True, 0, "s"], [1, float("nan"), "s"], [1, 0, "../x"], [1, 1e12, "s"]):
        with pytest.raises(HotLoadError):
            Target.from_wire(bad)


def test_gossip_adopts_only_newer_and_reaches_everyone_in_log_rounds() -> None:
    clock = FakeClock()
    n = 2000
    live = [f"n{i}" for i in range(n)]
    nodes = {x: TargetGossip(x, clock, random.Random(i), fanout=3) for i, x in enumerate(live)}
    t = Target(7, 1.0, "step7")
    frontier = [("n0", nodes["n0"].offer(t, live))]
    hops = 0
    while frontier:
        hops += 1
        nxt = []
        for _src, dsts in frontier:
            for d in dsts:
                push = nodes[d].offer(t, live)
                if push:
                    nxt.append((d, push))
        frontier = nxt
    reached = sum(1 for g in nodes.values() if g.current == t)
    assert reached >= 0.9 * n  # pushes alone; piggybacks on membership messages do the rest
    assert hops <= 3 * math.ceil(math.log(n, 3))
    assert nodes["n0"].offer(Target(6, 5.0, "step6"), live) == [] and nodes["n0"].current == t


def test_status_goes_to_a_few_stable_aggregators_and_pages() -> None:
    clock = FakeClock()
    live = [f"n{i:04d}" for i in range(1200)]
    aggs = aggregators(live, "step7", 3)
    assert len(aggs) == 3 and aggs == aggregators(list(reversed(live)), "step7", 3)
    boards = {a: ReplicaBoard(clock) for a in aggs}
    for x in live:
        for a in aggs:
            boards[a].put(Row(x, "step7", {"stage": "done", "made": 1.0}))
    rows = merge((b.rows("step7") for b in boards.values()), made_at=lambda r: r.data["made"])
    assert len(rows) == 1200
    size, after = page_params()
    assert size == 50 and after is None
    seen, token, pages = [], "", 0
    while True:
        size, after = page_params(1000, token)
        page, token = paginate(rows, size, after)
        seen += [r.node for r in page]
        pages += 1
        if not token:
            break
    assert seen == live and pages == 2
    for bad in (0, 1001, "x"):
        with pytest.raises(HotLoadError):
            page_params(bad)
    with pytest.raises(HotLoadError):
        page_params(10, "zz")


def test_merge_keeps_each_replicas_newest_row_whichever_aggregator_holds_it() -> None:
    """Three aggregators saw different reports of n1 (one missed its last change): the GET
    shows n1's newest row, not the last board's; a tie goes to the later board."""
    made = lambda r: r.data["made"]  # noqa: E731
    newest = Row("n1", "s", {"stage": "done", "made": 20.0})
    stale = Row("n1", "s", {"stage": "loading", "made": 10.0})
    for order in ([newest, stale], [stale, newest]):
        boards = [[r, Row("n2", "s", {"stage": "ready", "made": 5.0})] for r in order]
        assert [r.data["stage"] for r in merge(boards, made_at=made)] == ["done", "ready"]
    tie = [[Row("n1", "s", {"stage": "loading", "made": 1.0})], [Row("n1", "s", {"stage": "done", "made": 1.0})]]
    assert merge(tie, made_at=made)[0].data["stage"] == "done"


def test_board_forgets_silent_replicas_and_is_bounded() -> None:
    clock = FakeClock()
    b = ReplicaBoard(clock, ttl_s=10, max_rows=2)
    b.put(Row("a", "s", {}))
    b.put(Row("b", "s", {}))
    with pytest.raises(HotLoadError, match="full"):
        b.put(Row("c", "s", {}))
    clock.t = 11
    b.put(Row("c", "s", {}))
    assert [r.node for r in b.rows()] == ["c"]
