"""SWIM's dissemination queue (bdn/control/broadcasts.py): one pending update per member, the
least transmitted first, each update sent retransmit_mult * ceil(log2(N + 2)) times."""

from __future__ import annotations

import pytest

from bdn.control.broadcasts import Broadcasts


def test_each_update_goes_out_its_budget_of_times_least_sent_first() -> None:
    q = Broadcasts(retransmit_mult=2, max_per_message=2)
    assert q.limit(6) == 2 * 3  # ceil(log2(8)) = 3
    q.add("a", "a1")
    q.add("b", "b1")
    q.add("c", "c1")
    sent = [q.take(6) for _ in range(9)]
    assert sent[0] == ("a1", "b1")  # ties: the order they came in
    assert sent[1] == ("c1", "a1")  # c has been sent least
    counts = {u: sum(m.count(u) for m in sent) for u in ("a1", "b1", "c1")}
    assert counts == {"a1": 6, "b1": 6, "c1": 6}
    assert len(q) == 0 and q.take(6) == ()


def test_a_newer_update_about_a_member_replaces_the_pending_one_and_restarts_its_budget() -> None:
    q = Broadcasts(retransmit_mult=1, max_per_message=8)
    q.add("a", "a-alive-1")
    assert q.take(2) == ("a-alive-1",)  # limit(2) = 1 * ceil(log2(4)) = 2: one transmission left
    q.add("a", "a-suspect-1")
    assert len(q) == 1
    assert q.take(2) == ("a-suspect-1",)
    assert q.take(2) == ("a-suspect-1",)
    assert q.take(2) == ()


def test_bad_budgets_are_refused() -> None:
    with pytest.raises(ValueError):
        Broadcasts(0, 8)
    with pytest.raises(ValueError):
        Broadcasts(4, 0)


def test_take_matches_the_sorted_reference_and_never_scans_the_queue() -> None:
    """Against the plain definition (sort the pending updates by transmissions, take the first
    ``max_per_message``), over a random mix of adds and takes with a changing member count."""
    import random

    rng = random.Random(7)
    q = Broadcasts(retransmit_mult=2, max_per_message=5)
    ref: dict[str, list] = {}  # node -> [update, transmissions]
    for step in range(3000):
        if rng.random() < 0.4:
            node = f"n{rng.randrange(60)}"
            upd = f"{node}@{step}"
            q.add(node, upd)
            ref[node] = [upd, 0]
        else:
            members = rng.randrange(1, 200)
            got = q.take(members)
            counts = sorted(e[1] for e in ref.values())[: q.max_per_message]
            assert sorted(ref[u.split("@")[0]][1] for u in got) == counts
            limit = q.limit(members)
            for u in got:
                e = ref[u.split("@")[0]]
                assert e[0] == u
                e[1] += 1
                if e[1] >= limit:
                    del ref[u.split("@")[0]]
        assert len(q) == len(ref)
