"""Bounded peer sets, BITFIELD/HAVE and the chunk order they pick in (bdn/control/peerset.py)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from bdn.control.peerset import PeerSet, PeerSetError, pack_bits, unpack_bits
from bdn.daemon.fetch.policy import tiebreak


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_bitfield_wire_format_is_bittorrents() -> None:
    bits = np.zeros(10, dtype=bool)
    bits[[0, 9]] = True
    assert pack_bits(bits) == bytes([0x80, 0x40])
    assert unpack_bits(b"\x80\x7f", 10).tolist() == bits.tolist()  # spare bits ignored
    with pytest.raises(PeerSetError):
        unpack_bits(b"\x00", 10)


def test_refresh_caps_the_set_and_includes_readers() -> None:
    clock = FakeClock()
    ps = PeerSet("me", 8, clock, rng=random.Random(1), k=16, max_peers=32, reader_slots=4)
    live = [f"n{i}" for i in range(1000)] + ["me"]
    readers = [f"n{i}" for i in range(100, 110)]
    dial = ps.refresh(live, readers)
    assert len(dial) == 16 and "me" not in dial
    assert len(set(dial) & set(readers)) == 4
    assert ps.refresh(live, readers) == []
    for i in range(40):
        ps.accept(f"in{i}")
    assert len(ps.peers) == 32  # inbound bounded too
    gone = dial[0]
    ps.refresh([n for n in live if n != gone], readers)
    assert gone not in ps.peers


def test_owners_order_from_least_loaded_holder_skipping_owned() -> None:
    """``pick`` orders by bdnd's ``policy.chunk_order`` (each owner's next chunk first), not by
    how many holders a chunk has; each chunk from its least loaded holder."""
    clock = FakeClock()
    owned = [False] * 6
    owned[5] = True
    ps = PeerSet("me", 6, clock, rng=random.Random(2), k=3, max_peers=3, owned=owned)
    ps.place = np.array([2, 1, 0, 0, 0, 0], dtype=np.int32)  # chunk 2 is its owner's first, 0 its third
    for p in ("a", "b", "c"):
        ps.accept(p)
    ps.on_bitfield("a", np.array([1, 1, 1, 0, 0, 1], dtype=bool))
    ps.on_bitfield("b", np.array([1, 1, 0, 0, 0, 1], dtype=bool))
    ps.on_bitfield("c", pack_bits(np.array([1, 0, 0, 0, 0, 1], dtype=bool)))
    picks = ps.pick(3, load={"a": 1})
    assert [i for i, _ in picks] == [2, 1, 0]  # places 0, 1, 2; chunk 5 is ours to read
    assert dict(picks)[1] == "b" and dict(picks)[0] == "c"
    assert ps.pick(3) == []  # all in flight
    ps.got(2)
    ps.failed(1)
    assert [i for i, _ in ps.pick(1)] == [1]
    assert ps.unavailable().tolist() == [3, 4]
    ps.place = np.array([0, 0, 0, 0, 0, 0], dtype=np.int32)
    ps.failed(0)
    ps.failed(1)
    # one place: the set's own random order (tests below), whatever the holder counts
    assert sorted(i for i, _ in ps.pick(2)) == [0, 1]


def test_haves_are_batched_once_per_flush_interval_per_peer() -> None:
    clock = FakeClock()
    ps = PeerSet("me", 100, clock, k=2, max_peers=2, have_flush_s=0.1)
    ps.accept("a")
    ps.accept("b")
    ps.on_have("b", [7])
    assert ps.flush_haves() == {}
    for i in range(10):
        ps.got(i)
    ps.got(7)
    clock.t = 0.1
    out = ps.flush_haves()
    assert out["a"] == list(range(10)) and 7 not in out["b"]  # a second got() sends nothing
    assert ps.flush_haves() == {}  # not again before the interval
    with pytest.raises(PeerSetError):
        ps.on_have("a", [100])


def test_dead_and_idle_peers_are_replaced() -> None:
    clock = FakeClock()
    ps = PeerSet("me", 4, clock, rng=random.Random(3), k=2, max_peers=4, idle_s=5)
    live = ["a", "b", "c", "d"]
    first = ps.refresh(live)
    ps.on_bitfield(first[0], np.ones(4, dtype=bool))  # a seed: useful
    clock.t = 6
    ps.refresh(live)
    assert first[0] in ps.peers and first[1] not in ps.peers or len(ps.peers) == 2
    assert len(ps.peers) == 2
    assert ps.avail.tolist() == [1, 1, 1, 1]


def test_state_is_independent_of_fleet_size() -> None:
    clock = FakeClock()
    sizes = []
    for n in (100, 10_000):
        ps = PeerSet("me", 1000, clock, rng=random.Random(4), k=16, max_peers=32)
        ps.refresh([f"n{i}" for i in range(n)])
        sizes.append(ps.state_bytes())
    assert sizes[0] == sizes[1]


def test_a_chunk_another_peer_holds_is_not_taken_from_a_bucket_reader() -> None:
    clock = FakeClock()
    ps = PeerSet("me", 3, clock, rng=random.Random(5), k=3, max_peers=3)
    assert ps.accept("reader", is_reader=True) and ps.accept("a") and ps.accept("b")
    ps.on_bitfield("reader", np.array([True, True, True]))
    ps.on_bitfield("a", np.array([True, False, False]))
    ps.on_bitfield("b", np.array([False, True, False]))
    picks = dict((i, p) for i, p in ps.pick(3, {}, max_per_peer=1))
    assert picks[2] == "reader"  # only the reader has chunk 2: its slots are for that
    assert picks[0] == "a" and picks[1] == "b"  # the others from non-readers, though the reader is idle
    ps2 = PeerSet("me", 1, clock, rng=random.Random(6), k=2, max_peers=2)
    assert ps2.accept("reader", is_reader=True) and ps2.accept("a")
    ps2.on_bitfield("reader", np.array([True]))
    ps2.on_bitfield("a", np.array([True]))
    assert ps2.pick(1, {}, max_per_peer=1) == [(0, "a")]  # both idle: the non-reader (the reader came first)
    ps2.failed(0)
    assert ps2.pick(1, {"a": 1}, max_per_peer=1) == [(0, "reader")]  # a is full: the reader then


def test_a_million_chunk_set_costs_8_bytes_a_chunk_and_breaks_ties_at_random() -> None:
    """Issue 12, item 2: a daemon builds a PeerSet on its event loop when a download starts. Its
    per-chunk state is the four masks and the availability counts (8 bytes); the chunk order's
    tie-break is a keyed bijection of the position, not a permutation array (8 more bytes, and
    60-70 ms of the loop for 10^6 chunks in bench/manifest_lag)."""
    import tracemalloc

    n = 1_000_000
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        ps = PeerSet("me", n, FakeClock(), rng=random.Random(5))
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert used / n < 9, f"{used / n:.1f} bytes per chunk"
    ranks = tiebreak(np.arange(n), ps._salt)  # bdn.daemon.fetch.policy.tiebreak
    assert len(np.unique(ranks)) == n  # no two positions tie
    small = PeerSet("me", 64, FakeClock(), rng=random.Random(5))
    small.accept("a")
    small.on_bitfield("a", np.ones(64, dtype=bool))
    order = [i for i, _ in small.pick(64, max_per_peer=64)]
    assert sorted(order) == list(range(64)) and order != list(range(64))  # equally rare: a random order
    again = PeerSet("me", 64, FakeClock(), rng=random.Random(5))
    again.accept("a")
    again.on_bitfield("a", np.ones(64, dtype=bool))
    assert [i for i, _ in again.pick(64, max_per_peer=64)] == order  # the seed decides it


def test_an_inbound_peer_not_yet_counted_live_stays_until_it_was_and_is_not() -> None:
    """A joiner on SWIM probation here dialed us: its connection is kept (its HAVEs were its
    only news of our chunks); once counted live and then not, it is dropped."""
    clock = FakeClock()
    ps = PeerSet("me", 4, clock, rng=random.Random(4), k=2, max_peers=4)
    live = ["a", "b", "me"]
    assert sorted(ps.refresh(live)) == ["a", "b"]
    assert ps.accept("joiner")
    ps.refresh(live)
    assert "joiner" in ps.peers  # never counted live here: kept
    ps.refresh(live + ["joiner"])
    ps.refresh(live)
    assert "joiner" not in ps.peers  # counted live, then not: gone
    ps.refresh(["b", "me"])
    assert "a" not in ps.peers


def test_a_peer_added_after_an_announce_learns_the_chunk_from_the_bitfield() -> None:
    """announce() queues a HAVE for the peers of the moment and got() sends none after it: a
    peer that connects in between gets the chunk in its BITFIELD."""
    clock = FakeClock()
    ps = PeerSet("me", 8, clock, k=2, max_peers=4)
    ps.accept("early")
    ps.announce(3)
    ps.accept("late")
    ps.got(3)
    assert ps.flush_haves(force=True) == {"early": [3]}
    assert unpack_bits(ps.bitfield(), 8).tolist() == [i == 3 for i in range(8)]
    assert ps.have_bits()[3]


def test_endgame_asks_a_second_holder_for_the_last_chunks_only() -> None:
    """bdnd's endgame rule (endgame_chunks): with at most that many chunks left and two holders,
    a chunk asked of one holder is asked of a second; never a third, never before the endgame."""
    clock = FakeClock()
    ps = PeerSet("me", 8, clock, rng=random.Random(6), k=3, max_peers=3, endgame_chunks=2)
    for p in ("a", "b", "c"):
        ps.accept(p)
    ps.on_bitfield("a", np.ones(8, dtype=bool))
    ps.on_bitfield("b", np.ones(8, dtype=bool))
    for i in range(5):
        ps.got(i)
    picks = ps.pick(8, max_per_peer=8)
    assert sorted(i for i, _ in picks) == [5, 6, 7]  # 3 left: no race yet
    assert ps.pick(8, max_per_peer=8) == []
    ps.got(5)  # 2 left: the endgame
    race = ps.pick(8, max_per_peer=8)
    assert sorted(i for i, _ in race) == [6, 7]
    for i, p in race:
        assert ps.asked[i] == {"a", "b"} and p in ("a", "b")
    assert ps.pick(8, max_per_peer=8) == []  # two legs each: no third holder asked
    # one leg fails: the chunk stays in flight at the other, and may be raced again
    ps.failed(6, "a")
    assert ps.inflight[6] and ps.asked[6] == {"b"}
    assert ps.pick(8, max_per_peer=8) == [(6, "a")]
    ps.got(6)
    assert not ps.inflight[6] and 6 not in ps.asked


def test_endgame_needs_two_holders_and_leaves_owner_asks_alone() -> None:
    clock = FakeClock()
    ps = PeerSet("me", 4, clock, rng=random.Random(7), k=2, max_peers=2, endgame_chunks=4)
    ps.accept("a")
    ps.accept("b")
    ps.on_bitfield("a", np.array([1, 1, 0, 0], dtype=bool))
    ps.on_bitfield("b", np.array([1, 0, 0, 0], dtype=bool))
    ps.mark_inflight(0)  # asked of its owner (not a pick): never raced
    assert ps.pick(4, max_per_peer=4) == [(1, "a")]
    assert ps.pick(4, max_per_peer=4) == []  # chunk 1 has one holder only
    ps.failed(1, "a")
    assert not ps.inflight[1]  # its only leg failed: free to pick again
    off = PeerSet("me", 4, clock, rng=random.Random(7), k=2, max_peers=2)  # endgame_chunks 0: off
    off.accept("a")
    off.accept("b")
    off.on_bitfield("a", np.ones(4, dtype=bool))
    off.on_bitfield("b", np.ones(4, dtype=bool))
    assert len(off.pick(8, max_per_peer=8)) == 4 and off.pick(8, max_per_peer=8) == []
