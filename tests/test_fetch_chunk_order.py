"""Which chunk next: ``bdn.daemon.fetch.policy.chunk_order``, the one order bdnd's fetcher
(``policy.split_owned``) and the fleet simulator's peer sets (``PeerSet.pick``) both draw from
(issue 27). Pure: arrays in, an order out."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from bdn.control.peerset import PeerSet
from bdn.daemon.fetch import policy
from bdn.daemon.store.bitfield import Bitfield


class FakeClock:
    def __call__(self) -> float:
        return 0.0


@st.composite
def candidates(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray]:
    n = draw(st.integers(0, 60))
    place = np.array(draw(st.lists(st.integers(0, 6), min_size=n, max_size=n)), dtype=np.int32)
    positions = np.array(draw(st.lists(st.integers(0, 10_000), min_size=n, max_size=n, unique=True)), dtype=np.int64)
    return place, policy.tiebreak(positions, draw(st.integers(0, 2**64 - 1)))


@settings(max_examples=200, deadline=None)
@given(candidates())
def test_chunk_order_is_a_permutation_by_owner_place_then_ties(c) -> None:
    place, ties = c
    order = policy.chunk_order(place, ties)
    assert sorted(order.tolist()) == list(range(len(place)))
    keys = [(int(place[j]), int(ties[j])) for j in order]
    assert keys == sorted(keys)


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**64 - 1))
def test_tiebreak_is_a_bijection_fixed_by_the_salt(salt: int) -> None:
    pos = np.arange(5000)
    ranks = policy.tiebreak(pos, salt)
    assert len(np.unique(ranks)) == len(pos)
    assert np.array_equal(ranks, policy.tiebreak(pos, salt))
    assert not np.array_equal(ranks, policy.tiebreak(pos, salt ^ 1))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from("abcd"), max_size=80))
def test_owner_places_count_each_owners_chunks_in_manifest_order(owners: list[str]) -> None:
    place = policy.owner_places(owners).tolist()
    for i, o in enumerate(owners):
        assert place[i] == owners[:i].count(o)
    assert policy.owner_places(["a", "b", "a", "c", "b", "a"]).tolist() == [0, 0, 1, 0, 1, 2]


def _owner_of(owners: list[str]):
    return lambda i: owners[i]


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 2**32),
    st.lists(st.sampled_from(["me", "a", "b", "c"]), min_size=1, max_size=90),
    st.sets(st.integers(0, 89)),
)
def test_the_fetcher_draws_owned_chunks_in_manifest_order_and_the_rest_each_owners_next_first(
    seed: int, owners: list[str], held: set[int]
) -> None:
    n = len(owners)
    bits = Bitfield(n)
    for i in held:
        if i < n:
            bits.set(i)
    owned, others = policy.split_owned(bits, ["me", "a", "b", "c"], "me", random.Random(seed), _owner_of(owners))
    missing = [i for i in range(n) if not bits[i]]
    assert [i for i in owned if i is not None] == [i for i in missing if owners[i] == "me"]
    drawn = [i for i in others if i is not None]
    assert sorted(drawn) == [i for i in missing if owners[i] != "me"]
    place = policy.owner_places(owners)  # places in the owners' whole lists, not in what is missing
    assert [place[i] for i in drawn] == sorted(place[i] for i in drawn)


def test_a_chunk_that_arrives_while_the_order_is_drawn_is_skipped() -> None:
    owners = ["a", "b"] * 20
    bits = Bitfield(40)
    _, others = policy.split_owned(bits, ["me", "a", "b"], "me", random.Random(2), _owner_of(owners))
    first = next(others)
    assert first in (0, 1)  # each owner's first chunk first
    bits.set(1 - first)  # the other owner's first chunk arrives meanwhile
    rest = [i for i in others if i is not None]
    assert sorted([first, *rest]) == [i for i in range(40) if i != 1 - first]


def test_the_daemon_and_the_simulators_peer_set_pick_the_same_order_from_the_same_inputs() -> None:
    """bdnd's fetcher (split_owned) and PeerSet.pick (the simulator's nodes), given the same
    holders, owners and random draw, ask for the same chunks in the same order."""
    n, peers = 120, ["a", "b", "c", "d"]
    rnd = random.Random(11)
    owners = [rnd.choice(["me", *peers]) for _ in range(n)]
    have = {p: np.array([rnd.random() < 0.4 for _ in range(n)]) for p in peers}
    held = np.array([rnd.random() < 0.2 for _ in range(n)])
    owned = np.array([o == "me" for o in owners])

    ps = PeerSet("me", n, FakeClock(), rng=random.Random(5), owned=owned)
    ps.place = policy.owner_places(owners)
    for p in peers:
        ps.accept(p)
        ps.on_bitfield(p, have[p])
    for i in np.flatnonzero(held):
        ps.got(int(i))
    picked = [i for i, _ in ps.pick(n, max_per_peer=n)]

    bits = Bitfield(n)
    for i in np.flatnonzero(held):
        bits.set(int(i))
    _, others = policy.split_owned(bits, ["me", *peers], "me", random.Random(5), _owner_of(owners))
    drawn = [i for i in others if i is not None]
    # the fetcher draws every missing chunk (those nobody holds go to their owners, parked); the
    # peer set picks only what a peer holds: the same order on those
    held_by_a_peer = sum(h.astype(np.int32) for h in have.values()) > 0
    assert picked == [i for i in drawn if held_by_a_peer[i]]
    assert len(picked) == int((held_by_a_peer & ~held & ~owned).sum()) > 0
