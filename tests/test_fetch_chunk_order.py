"""Which chunk next: ``bdn.daemon.fetch.policy.chunk_order``, the one order bdnd's fetcher
(``policy.split_owned``) and the fleet simulator's peer sets (``PeerSet.pick``) both draw from
(issue 27). Pure: arrays in, an order out."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from bdn.control.peerset import PeerSet
from bdn.daemon.bitfield import Bitfield
from bdn.daemon.fetch import policy


class FakeClock:
    def __call__(self) -> float:
        return 0.0


@st.composite
def candidates(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = draw(st.integers(0, 60))
    avail = np.array(draw(st.lists(st.integers(0, 4), min_size=n, max_size=n)), dtype=np.int32)
    place = np.array(draw(st.lists(st.integers(0, 6), min_size=n, max_size=n)), dtype=np.int32)
    positions = np.array(draw(st.lists(st.integers(0, 10_000), min_size=n, max_size=n, unique=True)), dtype=np.int64)
    ties = policy.tiebreak(positions, draw(st.integers(0, 2**64 - 1)))
    return avail, place, ties


@settings(max_examples=200, deadline=None)
@given(candidates())
def test_chunk_order_is_a_permutation_sorted_by_holders_then_owner_place_then_ties(c) -> None:
    avail, place, ties = c
    order = policy.chunk_order(avail, place, ties)
    assert sorted(order.tolist()) == list(range(len(avail)))
    keys = [(int(avail[j]), int(place[j]), int(ties[j])) for j in order]
    assert keys == sorted(keys)


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**64 - 1))
def test_tiebreak_is_a_bijection_fixed_by_the_salt(salt: int) -> None:
    pos = np.arange(5000)
    ranks = policy.tiebreak(pos, salt)
    assert len(np.unique(ranks)) == len(pos)
    assert np.array_equal(ranks, policy.tiebreak(pos, salt))
    assert not np.array_equal(ranks, policy.tiebreak(pos, salt ^ 1))


def test_owner_places_count_each_owners_chunks_in_manifest_order() -> None:
    assert policy.owner_places(["a", "b", "a", "c", "b", "a"]).tolist() == [0, 0, 1, 0, 1, 2]
    assert policy.owner_places([]).tolist() == []


def _owner_of(owners: list[str]):
    return lambda i: owners[i]


def test_the_fetcher_draws_rarest_first_then_each_owners_next_chunk_and_reads_counts_again() -> None:
    n = 200
    rnd = random.Random(3)
    owners = [rnd.choice(["me", "a", "b", "c"]) for _ in range(n)]
    bits = Bitfield(n)
    counts = np.zeros(n, dtype=np.int32)
    counts[[i for i in range(n) if i % 7 == 0]] = 2
    counts[[i for i in range(n) if i % 5 == 0]] = 1
    calls = []

    def avail(pos: np.ndarray) -> np.ndarray:
        calls.append(len(pos))
        return counts[pos]

    owned, others = policy.split_owned(bits, ["me", "a", "b", "c"], "me", random.Random(9), _owner_of(owners), avail)
    assert [i for i in owned if i is not None] == [i for i in range(n) if owners[i] == "me"]
    first = [next(others) for _ in range(policy.REORDER_EVERY)]
    place = policy.owner_places(owners)
    theirs = np.array([i for i in range(n) if owners[i] != "me"])
    expect = theirs[policy.chunk_order(counts[theirs], place[theirs], policy.tiebreak(theirs, random.Random(9).getrandbits(64)))]
    assert first == expect[: policy.REORDER_EVERY].tolist()
    assert calls == [len(theirs)]
    # news between two draws: a chunk arrived here, and the rarest left now has 3 holders
    got = int(expect[policy.REORDER_EVERY])
    bits.set(got)
    counts[expect[policy.REORDER_EVERY + 1:]] += 3
    counts[int(expect[-1])] = 0
    rest = [i for i in others if i is not None]
    assert len(calls) >= 2 and calls[1] == len(theirs) - policy.REORDER_EVERY - 1  # counts read again
    assert rest[0] == int(expect[-1])  # the one nobody holds now comes first
    assert got not in rest and sorted(first + rest + [got]) == theirs.tolist()


def test_the_daemon_and_the_simulators_peer_set_pick_the_same_order_from_the_same_inputs() -> None:
    """bdnd's fetcher (split_owned) and PeerSet.pick (the simulator's nodes), given the same
    holders, owners and random draw, ask for the same chunks in the same order."""
    n, peers = 120, ["a", "b", "c", "d"]
    rnd = random.Random(11)
    owners = [rnd.choice(["me", *peers]) for _ in range(n)]
    have = {p: np.array([rnd.random() < 0.4 for _ in range(n)]) for p in peers}
    held = np.array([rnd.random() < 0.2 for _ in range(n)])
    owned = np.array([o == "me" for o in owners])
    place = policy.owner_places(owners)

    ps = PeerSet("me", n, FakeClock(), rng=random.Random(5), owned=owned)
    ps.place = place
    for p in peers:
        ps.accept(p)
        ps.on_bitfield(p, have[p])
    for i in np.flatnonzero(held):
        ps.got(int(i))
    picked = [i for i, _ in ps.pick(n, max_per_peer=n)]

    bits = Bitfield(n)
    for i in np.flatnonzero(held):
        bits.set(int(i))
    counts = sum(h.astype(np.int32) for h in have.values())
    _, others = policy.split_owned(bits, ["me", *peers], "me", random.Random(5), _owner_of(owners),
                                   lambda pos: counts[pos])
    drawn = [i for i in others if i is not None]
    # the fetcher draws every missing chunk (those nobody holds go to their owners); the peer
    # set picks only what a peer holds: the same order on those
    assert picked == [i for i in drawn if counts[i] > 0]
    assert len(picked) == int(((counts > 0) & ~held & ~owned).sum())
