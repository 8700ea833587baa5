"""Tests for bdn.proto.hrw: rendezvous (highest random weight) ownership of chunks."""

from __future__ import annotations

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from bdn.proto.chunks import digest
from bdn.proto.hrw import owner, rank, score

NODES = [f"node-{i}.bdn.svc:7070" for i in range(8)]


def _keys(n: int) -> list[str]:
    # Real keys are chunk digests (or addresses): 32 hex chars.
    return [digest(i.to_bytes(8, "big")) for i in range(n)]


def test_score_is_deterministic_64_bit() -> None:
    s = score("node-a", "k")
    assert s == score("node-a", "k")
    assert 0 <= s < 1 << 64
    assert score("node-a", "k") != score("node-b", "k")
    assert score("node-a", "k") != score("node-a", "k2")


def test_score_separates_node_and_key() -> None:
    # The NUL separator keeps ("ab", "c") and ("a", "bc") apart.
    assert score("ab", "c") != score("a", "bc")


def test_owner_of_no_nodes_is_none() -> None:
    assert owner([], "k") is None
    assert rank([], "k") == []


def test_owner_is_rank_head_over_many_keys() -> None:
    for k in _keys(2000):
        r = rank(NODES, k)
        assert owner(NODES, k) == r[0]
        assert sorted(r) == sorted(NODES)


def test_rank_is_by_descending_score() -> None:
    for k in _keys(200):
        scores = [score(n, k) for n in rank(NODES, k)]
        assert scores == sorted(scores, reverse=True)


def test_order_of_input_does_not_matter() -> None:
    rev = list(reversed(NODES))
    for k in _keys(500):
        assert rank(NODES, k) == rank(rev, k)
        assert owner(NODES, k) == owner(iter(rev), k)  # any iterable, consumed once


def test_removing_a_node_only_moves_its_own_keys() -> None:
    keys = _keys(10_000)
    before = {k: owner(NODES, k) for k in keys}
    gone = NODES[3]
    rest = [n for n in NODES if n != gone]
    moved = 0
    for k in keys:
        after = owner(rest, k)
        if before[k] == gone:
            moved += 1
            # ... to its own next-best node, i.e. the second of the old ranking.
            assert after == rank(NODES, k)[1]
        else:
            assert after == before[k], k
    assert moved > 0


def test_adding_a_node_only_takes_keys_to_itself() -> None:
    keys = _keys(10_000)
    before = {k: owner(NODES, k) for k in keys}
    new = "node-new.bdn.svc:7070"
    grown = [*NODES, new]
    taken = 0
    for k in keys:
        after = owner(grown, k)
        if after != before[k]:
            assert after == new
            taken += 1
    # About 1/9 of the keys; loose bounds, the point is "some, not most".
    assert 0.07 * len(keys) < taken < 0.16 * len(keys)


def test_distribution_roughly_even() -> None:
    keys = _keys(20_000)
    counts = Counter(owner(NODES, k) for k in keys)
    assert set(counts) == set(NODES)
    for n in NODES:
        share = counts[n] / len(keys)
        assert 0.09 <= share <= 0.16, (n, share)


def test_fallback_load_spreads_when_a_node_leaves() -> None:
    # Unlike a hash ring, a leaving node's keys spread over all the others.
    keys = _keys(20_000)
    gone = NODES[0]
    rest = NODES[1:]
    heirs = Counter(owner(rest, k) for k in keys if owner(NODES, k) == gone)
    assert set(heirs) == set(rest)


def test_duplicate_node_ids_are_harmless() -> None:
    for k in _keys(100):
        assert owner([*NODES, *NODES], k) == owner(NODES, k)
        assert rank([*NODES, NODES[0]], k)[0] == owner(NODES, k)


@given(
    st.lists(st.text(min_size=1, max_size=20), min_size=1, max_size=12, unique=True),
    st.text(max_size=40),
)
def test_property_owner_is_rank_head(nodes: list[str], key: str) -> None:
    r = rank(nodes, key)
    assert owner(nodes, key) == r[0]
    assert len(r) == len(nodes)


@given(
    st.lists(st.text(min_size=1, max_size=20), min_size=2, max_size=12, unique=True),
    st.text(max_size=40),
    st.data(),
)
def test_property_removal_keeps_relative_order(nodes: list[str], key: str, data: st.DataObject) -> None:
    gone = data.draw(st.sampled_from(nodes))
    rest = [n for n in nodes if n != gone]
    assert rank(rest, key) == [n for n in rank(nodes, key) if n != gone]
