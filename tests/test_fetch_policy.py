"""The fetch policy (bdn.daemon.fetch.policy): which sources one chunk is asked of, in which order,
and what each source's record (rate, refusals) says.

Pure functions over a view of the swarm, with a fake clock and a seeded random: no sockets,
no sleeps.
"""

from __future__ import annotations

import random

from bdn.daemon.fetch import policy
from bdn.daemon.fetch.policy import Ask, PeerView, ReadBucket, Rounds
from bdn.daemon.process.clock import FakeClock
from bdn.proto import hrw

SELF = "n0"
PEERS = [PeerView(f"http://n{i}:7080", f"n{i}", inflight=0) for i in range(1, 6)]
NODES = [SELF, *(p.node_id for p in PEERS)]


def _digest_where(rank_of_self: int) -> str:
    """A digest for which this node sits at HRW position ``rank_of_self`` among NODES."""
    for i in range(100_000):
        d = f"{i:032x}"
        if hrw.rank(NODES, d).index(SELF) == rank_of_self:
            return d
    raise AssertionError("no such digest")


def test_holders_are_least_loaded_first_and_only_those_holding() -> None:
    live = [PeerView("http://a", "a", 3), PeerView("http://b", "b", 0), PeerView("http://c", "c", 1)]
    got = policy.holders(live, {"http://a", "http://b", "http://zz"}, random.Random(1))
    assert [p.url for p in got] == ["http://b", "http://a"]


def test_holders_ties_are_broken_at_random() -> None:
    live = [PeerView(f"http://p{i}", f"p{i}", 0) for i in range(8)]
    orders = {
        tuple(p.url for p in policy.holders(live, {p.url for p in live}, random.Random(seed))) for seed in range(20)
    }
    assert len(orders) > 1


def test_endgame_races_the_first_two_holders() -> None:
    hs = PEERS[:3]
    race, asks = policy.plan_holders(hs, left=2, endgame_chunks=4)
    assert race == hs[:2] and asks == [Ask(hs[2], 0.0)]


def test_no_endgame_with_many_chunks_left_or_one_holder() -> None:
    race, asks = policy.plan_holders(PEERS[:3], left=50, endgame_chunks=4)
    assert race == [] and [a.peer for a in asks] == PEERS[:3] and all(a.wait == 0 for a in asks)
    race, asks = policy.plan_holders(PEERS[:1], left=1, endgame_chunks=4)
    assert race == [] and len(asks) == 1
    assert policy.endgame(left=4, holders=2, endgame_chunks=4)
    assert not policy.endgame(left=5, holders=2, endgame_chunks=4)


def test_owner_first_with_long_wait_then_next_owners_until_self() -> None:
    d = _digest_where(rank_of_self=3)
    ranked = hrw.rank(NODES, d)
    steps = policy.plan_owners(SELF, PEERS, d, "stored", tried=set(), chunk_wait_s=30.0)
    assert [s.peer.node_id for s in steps[:-1]] == ranked[:3]  # type: ignore[union-attr]
    assert [s.wait for s in steps[:-1]] == [30.0, 2.0, 2.0]  # type: ignore[union-attr]
    assert steps[-1] == ReadBucket(3)


def test_this_node_as_owner_reads_the_bucket_first() -> None:
    d = _digest_where(rank_of_self=0)
    assert policy.plan_owners(SELF, PEERS, d, "stored", set(), 30.0) == [ReadBucket(0)]
    assert policy.reads_as_owner(ReadBucket(0), SELF, [p.node_id for p in PEERS], d)


def test_peers_already_asked_this_round_are_skipped() -> None:
    d = _digest_where(rank_of_self=2)
    first = hrw.rank(NODES, d)[0]
    url = next(p.url for p in PEERS if p.node_id == first)
    steps = policy.plan_owners(SELF, PEERS, d, "stored", tried={url}, chunk_wait_s=30.0)
    assert all(isinstance(s, ReadBucket) or s.peer.url != url for s in steps)
    assert steps[-1] == ReadBucket(2)


def test_rebuilt_chunks_have_no_owner_steps() -> None:
    assert policy.plan_owners(SELF, PEERS, _digest_where(0), "result", set(), 30.0) == []


def test_a_node_below_the_owner_reads_only_when_those_above_died() -> None:
    d = _digest_where(rank_of_self=1)
    above = hrw.rank(NODES, d)[0]
    live_nodes = [p.node_id for p in PEERS]
    assert not policy.reads_as_owner(ReadBucket(1), SELF, live_nodes, d)
    assert policy.reads_as_owner(ReadBucket(1), SELF, [n for n in live_nodes if n != above], d)


def test_dead_or_penalised_peers_are_not_in_the_view_so_not_asked() -> None:
    d = _digest_where(rank_of_self=2)
    owner = hrw.rank(NODES, d)[0]
    live = [p for p in PEERS if p.node_id != owner]
    steps = policy.plan_owners(SELF, live, d, "stored", set(), 30.0)
    assert owner not in [s.peer.node_id for s in steps if isinstance(s, Ask)]
    assert isinstance(steps[-1], ReadBucket)


def test_rounds_busy_rounds_do_not_count_within_patience() -> None:
    clock = FakeClock()
    r = Rounds(clock, patience_s=10.0, rng=random.Random(0))
    for _ in range(50):
        delay, again = r.after_round(busy=True, failed=False)
        assert again and 0.1 <= delay <= 0.5
    assert r.attempt == 0
    clock.advance(10.0)
    assert r.after_round(busy=True, failed=False) == (0.2, True)
    assert r.attempt == 1


def test_rounds_three_counted_rounds_then_fallback() -> None:
    r = Rounds(FakeClock(), patience_s=600.0, rng=random.Random(0))
    assert r.after_round(busy=False, failed=True) == (0.2, True)
    assert r.after_round(busy=True, failed=True) == (0.4, True)  # busy and failed: counts
    delay, again = r.after_round(busy=False, failed=False)
    assert not again and abs(delay - 0.6) < 1e-9


# ---- the order a layer's chunks are drawn in (issue 12, item 2) ---------------------------


def test_a_drawn_order_hands_the_loop_a_turn_over_long_held_stretches() -> None:
    from bdn.daemon.store.bitfield import Bitfield

    n = 10 * policy.YIELD_EVERY
    bits = Bitfield(n)
    it, _ = policy.split_owned(bits, [SELF], SELF, random.Random(0), lambda i: SELF)
    first = next(it)
    bits.set_all()  # everything arrives meanwhile: the rest is skipped, a turn at a time
    rest = list(it)
    assert first is not None and rest and all(i is None for i in rest)
    assert len(rest) <= 2 * n // policy.YIELD_EVERY + 2


def test_bitfield_clear_positions_and_set_all() -> None:
    from bdn.daemon.store.bitfield import Bitfield

    b = Bitfield(13)
    b.set(0), b.set(12)
    assert list(b.clear_positions()) == list(range(1, 12)) and list(b.set_positions()) == [0, 12]
    b.set_all()
    assert b.complete and b.count == 13 and list(b.clear_positions()) == []
    assert Bitfield(13, b.to_bytes()).count == 13


def test_bucket_parts_cover_a_chunk_exactly_in_at_most_streams_parts() -> None:
    for length in (1, 100, policy.MIN_PART, 3 * policy.MIN_PART + 7, 16 << 20, (16 << 20) - 1):
        for streams in (1, 2, 4, 16):
            parts = policy.bucket_parts(length, streams)
            assert 1 <= len(parts) <= streams
            assert parts[0][0] == 0 and sum(n for _, n in parts) == length
            assert all(o + n == parts[i + 1][0] for i, (o, n) in enumerate(parts[:-1]))
            assert len(parts) == 1 or min(n for _, n in parts) >= policy.MIN_PART - 1
    assert policy.bucket_parts(16 << 20, 4) == [(i * (4 << 20), 4 << 20) for i in range(4)]
    assert policy.bucket_parts(100, 4) == [(0, 100)]


def test_split_owned_gives_owned_chunks_in_manifest_order_and_the_rest_by_their_owners_queue() -> None:
    from bdn.daemon.store.bitfield import Bitfield

    digests = [f"{i:032x}" for i in range(3000)]
    bits = Bitfield(len(digests))
    for i in range(0, 3000, 11):
        bits.set(i)

    def owner_of(i: int) -> str | None:
        return hrw.owner(NODES, digests[i])

    owned, others = policy.split_owned(bits, NODES, SELF, random.Random(5), owner_of)
    got_owned = [i for i in owned if i is not None]
    got_others = [i for i in others if i is not None]
    missing = [i for i in range(3000) if i % 11]
    assert got_owned == [i for i in missing if hrw.owner(NODES, digests[i]) == SELF]
    assert sorted(got_others) == [i for i in missing if hrw.owner(NODES, digests[i]) != SELF]
    # the k-th chunk (manifest order) of every other owner comes before any owner's (k+1)-th
    # (each owner's chunks in manifest order computed once: asking hrw.owner per pair made this
    # test quadratic, minutes on a loaded machine)
    owner = {i: hrw.owner(NODES, digests[i]) for i in range(3000)}
    rank_in_owner: dict[int, int] = {}
    seen_of: dict[str, int] = {}
    for j in range(3000):  # the owner's whole list (what it reads), not only what this node misses
        rank_in_owner[j] = seen_of.get(owner[j], 0)
        seen_of[owner[j]] = rank_in_owner[j] + 1
    ks = [rank_in_owner[i] for i in got_others]
    assert ks == sorted(ks)
    # two nodes' orders of the same chunks differ within a place (ties are random)
    _, again = policy.split_owned(bits, NODES, SELF, random.Random(6), owner_of)
    assert [i for i in again if i is not None] != got_others


def test_split_owned_alone_owns_everything_and_skips_chunks_that_arrive() -> None:
    from bdn.daemon.store.bitfield import Bitfield

    bits = Bitfield(50)
    owned, others = policy.split_owned(bits, [SELF], SELF, random.Random(1), lambda i: SELF)
    first = next(owned)
    bits.set(first + 1)
    assert [first, *[i for i in owned if i is not None]] == [i for i in range(50) if i != first + 1]
    assert list(others) == []


def test_plan_owners_asks_the_bounded_owner_first_then_hrw_order() -> None:
    d = _digest_where(3)
    ranked = hrw.rank(NODES, d)
    other = ranked[2]
    steps = policy.plan_owners(SELF, PEERS, d, policy.STORED, set(), 30.0, owner=other)
    first = steps[0]
    assert isinstance(first, Ask) and first.peer.node_id == other and first.wait == 30.0
    asked = [s.peer.node_id for s in steps if isinstance(s, Ask)]
    assert asked == [other, *[n for n in ranked[: ranked.index(SELF)] if n != other]]
    # this node as the bounded owner: it reads the bucket at once
    assert policy.plan_owners(SELF, PEERS, d, policy.STORED, set(), 30.0, owner=SELF) == [ReadBucket(0)]
    assert policy.reads_as_owner(ReadBucket(2), SELF, [p.node_id for p in PEERS], d, owner_now=SELF)
    assert not policy.reads_as_owner(ReadBucket(2), SELF, [p.node_id for p in PEERS], d, owner_now=other)


def test_steal_takes_the_last_chunk_of_the_owner_with_the_most_left() -> None:
    """A node whose own reads are done takes over the end of the longest list (its owner reads
    from the front), never one of an owner's last `margin` chunks."""
    remaining = {"a": [3, 7, 9], "b": [1, 4, 8, 12, 20], "c": [2]}
    assert policy.pick_steal(remaining, margin=2) == ("b", 20)
    assert policy.pick_steal({"a": [3, 7], "c": [2]}, margin=2) is None
    assert policy.pick_steal({}, margin=0) is None
    # equal lengths: one answer whatever the dict order (the larger owner id), so repeated
    # looks do not alternate between owners
    assert policy.pick_steal({"a": [1, 2, 5], "b": [3, 4, 6]}, margin=1) == ("b", 6)
    assert policy.pick_steal({"b": [3, 4, 6], "a": [1, 2, 5]}, margin=1) == ("b", 6)


# ---- SourceBook: refusals, rates, lagging requests (issue 31, classes 2 and 3) --------------


def test_a_source_answering_not_here_for_advertised_chunks_is_penalised_after_lie_limit() -> None:
    book = policy.SourceBook(FakeClock())
    assert [book.refused("liar", advertised=True) for _ in range(policy.LIE_LIMIT)] == [False] * (
        policy.LIE_LIMIT - 1
    ) + [True]
    assert not book.refused("liar", advertised=True)  # the streak starts again


def test_busy_refusals_penalise_only_over_the_window_while_others_deliver() -> None:
    clock = FakeClock()
    book = policy.SourceBook(clock)
    for _ in range(3 * policy.REFUSE_LIMIT):  # many at once: not yet (the window has not passed)
        assert not book.refused("liar")
    clock.advance(policy.REFUSE_WINDOW_S)
    assert not book.refused("liar")  # nobody else delivered meanwhile, and not for 2 windows
    book.delivered("honest", 1 << 20, 0.01)
    assert book.refused("liar")


def test_busy_refusals_while_nothing_arrives_at_all_penalise_after_two_windows() -> None:
    clock = FakeClock()
    book = policy.SourceBook(clock)
    for _ in range(policy.REFUSE_LIMIT):
        assert not book.refused("liar")
    clock.advance(2 * policy.REFUSE_WINDOW_S)
    book.bodies = 1  # an answer is arriving: this node is not stalled, nobody is blamed
    assert not book.refused("liar")
    book.bodies = 0
    assert book.refused("liar")


def test_a_delivery_ends_a_refusal_streak() -> None:
    clock = FakeClock()
    book = policy.SourceBook(clock)
    for _ in range(policy.REFUSE_LIMIT):
        book.refused("busy")
    book.delivered("busy", 1 << 20, 0.01)  # an honest holder: busy now and then, delivers
    clock.advance(policy.REFUSE_WINDOW_S)
    book.delivered("other", 1 << 20, 0.01)
    assert not book.refused("busy")


def test_rates_median_and_slow_sources() -> None:
    book = policy.SourceBook(FakeClock())
    assert book.median_rate() is None and not book.slow("a")
    book.delivered("a", 100 << 20, 1.0)
    book.delivered("b", 80 << 20, 1.0)
    book.delivered("c", 64 << 10, 1.0)  # 64 KB/s: the slow peer
    assert book.rate("a") == 100 << 20 and book.median_rate(without="c") == 90 << 20
    assert book.slow("c") and not book.slow("a") and not book.slow("b")
    book.delivered("c", 64 << 20, 1.0)  # it recovers, sample by sample (a moving average)
    assert book.rate("c") > 64 << 10


def test_a_request_lags_past_what_the_median_would_take_at_the_slow_fraction() -> None:
    book = policy.SourceBook(FakeClock())
    n = 16 << 20
    assert book.lag_limit(n, "s") is None and not book.lagging("s", n, 1e6)  # nothing to compare
    book.delivered("a", 10 << 20, 1.0)
    limit = book.lag_limit(n, "s")
    assert limit is not None and abs(limit - n / (policy.SLOW_FRACTION * (10 << 20))) < 1e-9
    assert book.lag_limit(1, "s") == policy.LAG_MIN_S  # a small chunk: latency, not rate
    assert not book.lagging("s", n, limit * 0.99)
    assert book.lagging("s", n, limit * 1.01)
    assert book.slow("s")  # recorded at most that rate: asked last from now on


def test_holders_rank_slow_sources_last_whatever_their_load() -> None:
    book = policy.SourceBook(FakeClock())
    book.delivered("a", 100 << 20, 1.0)
    book.delivered("b", 64 << 10, 1.0)
    live = [PeerView("http://a", "a", 3), PeerView("http://b", "b", 0)]
    assert [p.node_id for p in policy.holders(live, {"http://a", "http://b"}, random.Random(1), book)] == ["a", "b"]
    assert policy.holder_key(False, 3) < policy.holder_key(True, 0)
    assert policy.holder_key(False, 3) < policy.holder_key(False, 0, spare_reader=True)
