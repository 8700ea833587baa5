"""HRW owners and bucket readers per membership epoch (bdn/control/owners.py)."""

from __future__ import annotations

from bdn.control.owners import (
    OwnerCache,
    OwnerMap,
    reader_count,
    reader_slots,
    slot_of,
    slot_table,
)
from bdn.proto import hrw


def test_reader_count_saturates_the_bucket_with_headroom() -> None:
    assert reader_count(10_000, 10e9, 100e6) == 150
    assert reader_count(10_000, 10e9, 100e6, connections_per_reader=2) == 75
    assert reader_count(8, 25e6, 0) == 8  # no per-connection limit: every node reads
    assert reader_count(8, 10e9, 100e6) == 8  # never more than the live set
    assert reader_count(0, 10e9, 100e6) == 0


def test_owners_are_hrw_among_readers_and_all_nodes_with_no_limit() -> None:
    live = [f"n{i}" for i in range(50)]
    full = OwnerMap(1, live, "step1")
    for d in ("a", "b", "c"):
        assert full.owner(d) == hrw.owner(live, d)
    m = OwnerMap(1, live, "step1", readers=5)
    assert len(m.readers) == 5 and all(m.is_reader(r) for r in m.readers)
    for d in (f"d{i}" for i in range(100)):  # without digests: plain HRW over the reader slots
        assert m.owner(d) == m.readers[slot_of(d, 5)]
    assert set(m.owned_by(m.readers[0], [f"d{i}" for i in range(100)])) <= set(range(100))


def test_readers_rotate_per_snapshot_and_survive_unrelated_deaths() -> None:
    live = [f"n{i}" for i in range(200)]
    a = OwnerMap(1, live, "step1", readers=10).readers
    b = OwnerMap(1, live, "step2", readers=10).readers
    assert set(a) != set(b)
    outsider = next(n for n in live if n not in a)
    c = OwnerMap(2, [n for n in live if n != outsider], "step1", readers=10).readers
    assert c == a  # a non-reader's death moves no owner
    d = OwnerMap(3, [n for n in live if n != a[0]], "step1", readers=10).readers
    assert set(d) - set(a) and len(set(d) & set(a)) == 9  # one reader replaced, the rest stay


def test_cache_rebuilds_only_when_the_epoch_changes() -> None:
    cache = OwnerCache()
    live = ["a", "b", "c"]
    m1 = cache.get(1, live, "s")
    assert cache.get(1, live, "s") is m1 and cache.rebuilds == 1
    m2 = cache.get(2, ["a", "b"], "s")
    assert m2 is not m1 and cache.rebuilds == 2 and "c" not in m2.readers


def test_affected_by_acting_and_former_owner() -> None:
    live = [f"n{i}" for i in range(100)]
    m = OwnerMap(1, live, "s", readers=10)
    outsiders = [n for n in live if not m.is_reader(n)]
    assert m.affected_by(m.readers[3])
    assert not any(m.affected_by(n) for n in outsiders)  # they rank below every reader
    # a joiner matters only if it would rank among the readers
    joiners = [f"j{i}" for i in range(200)]
    for j in joiners:
        again = OwnerMap(2, live + [j], "s", readers=10)
        assert m.affected_by(j) == (again.readers != m.readers)
    d = "chunk-a"
    ranked = m.ranked(d)
    assert m.acting_owner(d) == ranked[0] == m.owner(d)
    assert m.acting_owner(d, {ranked[0]}) == ranked[1]
    assert m.former_owner(d, ranked[0]) == ranked[1] and m.former_owner(d, ranked[-1]) is None
    small = OwnerMap(1, ["a", "b"], "s", readers=5)
    assert small.affected_by("zzz")  # every live node reads: any change moves owners


def test_one_owner_rule_bounded_loads_among_the_readers() -> None:
    """The daemon's fetcher table and the simulator's OwnerMap are the same function."""
    from collections import Counter

    from bdn.control.owners import owner_table
    from bdn.daemon.fetch.owners import Owners

    live = [f"n{i}" for i in range(5)]
    digests = [f"{i * 7919:032x}" for i in range(263)]
    m = OwnerMap(1, live, "step1", readers=5, digests=digests)  # every live node reads: bounded
    assert m.bounded
    loads = Counter(m.owner(d) for d in digests)
    assert set(loads) == set(m.readers) and max(loads.values()) == -(-len(digests) // 5)  # cap: ceil(263 / 5)
    assert dict(owner_table(digests, m.readers)) == {d: m.owner(d) for d in digests}
    for d in digests:  # the bounded owner heads the fallback order; acting owner follows it
        assert m.ranked(d)[0] == m.owner(d) == m.acting_owner(d)
        assert sorted(m.ranked(d)) == sorted(m.readers)
        assert m.acting_owner(d, {m.owner(d)}) == m.ranked(d)[1]
    assert sorted(i for r in m.readers for i in m.owned_by(r, digests)) == list(range(len(digests)))
    # small N: every live node reads, and bdnd's fetcher cache gives the same owners
    small = [f"n{i}" for i in range(8)]
    full = OwnerMap(1, small, "step1", digests=digests)
    o = Owners()
    assert all(o.owner("L", small, d, lambda: digests, len(digests)) == full.owner(d) for d in digests)
    live = [f"n{i}" for i in range(40)]
    sub = OwnerMap(1, live, "step1", readers=5, digests=digests)  # a subset reads: reader slots
    table = slot_table(digests, 5)
    assert not sub.bounded and all(sub.owner(d) == sub.readers[table[d]] for d in digests)
    shares = Counter(sub.owner(d) for d in digests)
    assert len(shares) == 5 and max(shares.values()) == 53  # no reader above ceil(263 / 5)
    # bdnd's fetcher (bucket_readers > 0) gives the same owners from the same slots
    assert all(o.slot_owner("L2", list(sub.readers), d, lambda: digests, len(digests)) == sub.owner(d) for d in digests)
    plain = OwnerMap(1, live, "step1", readers=5)
    assert not plain.bounded and all(plain.owner(d) == plain.readers[slot_of(d, 5)] for d in digests)
    assert owner_table(digests, ["solo"]) == {} and owner_table([], live) == {}


def test_readers_of_is_the_owner_maps_reader_set() -> None:
    from bdn.control.owners import readers_of

    live = [f"n{i}" for i in range(100)]
    assert readers_of("s", live, 0) == live and readers_of("s", live, None) == live
    assert readers_of("s", live[:3], 10) == live[:3]
    from bdn.control.owners import readers_and_rule

    assert readers_and_rule("s", live, 0) == (live, True)
    assert readers_and_rule("s", live, 5) == (readers_of("s", live, 5), False)
    r = readers_of("s", live, 5)
    assert r == list(OwnerMap(1, live, "s", readers=5).readers)
    assert r == readers_of("s", list(reversed(live)), 5)  # the same on every daemon


def test_reader_slots_share_equally_and_a_change_moves_one_slot() -> None:
    """Reader slots: equal shares (within one chunk) whatever the node ids, where plain HRW
    among 5 readers split 128 chunks up to 21 / 31 (docs/decisions/0002-bucket-reader-slots.md); a
    reader's death moves its slot only, to the slot's next candidate, who is also its acting
    owner and the new holder's former owner."""
    from collections import Counter

    digests = [f"{i:032x}" for i in range(128)]
    for n in (100, 1000, 3000):
        live = [f"n{i:05d}" for i in range(n)]
        m = OwnerMap(1, live, "step000001", readers=5, digests=digests)
        shares = Counter(m.owner(d) for d in digests)
        assert len(shares) == 5 and max(shares.values()) == 26  # ceil(128 / 5), whatever the ids
    live = [f"n{i:05d}" for i in range(1000)]
    m = OwnerMap(1, live, "s", readers=5, digests=digests)
    dead = m.readers[2]
    after = OwnerMap(2, [x for x in live if x != dead], "s", readers=5, digests=digests)
    moved = [d for d in digests if m.owner(d) != after.owner(d)]
    assert moved and all(m.owner(d) == dead for d in moved)  # only the dead reader's chunks move
    assert {after.owner(d) for d in moved} == {after.readers[2]}  # all to one node, its slot's next
    for d in moved:
        assert m.acting_owner(d, {dead}) == after.owner(d)
        assert after.former_owner(d, after.owner(d)) is not None
    assert [r for k, r in enumerate(after.readers) if k != 2] == [r for k, r in enumerate(m.readers) if k != 2]
    # a joiner outranking a holder takes that slot only (affected_by says so beforehand)
    for j in (f"j{i}" for i in range(3000)):
        if m.affected_by(j):
            again = OwnerMap(2, live + [j], "s", readers=5, digests=digests)
            k = again.readers.index(j)
            assert [r for i, r in enumerate(again.readers) if i != k] == [r for i, r in enumerate(m.readers) if i != k]
            assert again.former_owner(digests[[again.owner(d) for d in digests].index(j)], j) == m.readers[k]
            break
    else:
        raise AssertionError("no joiner outranked a holder")
    # the candidates: holder first, then nodes holding no slot; a cached score gives the same
    cands = reader_slots("s", live, 5)
    holders = [c[0] for c in cands]
    assert len(set(holders)) == 5 and all(not set(c[1:]) & set(holders) for c in cands)
    cache: dict = {}

    def cached(node: str, key: str) -> int:
        if (node, key) not in cache:
            cache[(node, key)] = hrw.score(node, key)
        return cache[(node, key)]

    assert reader_slots("s", live, 5, score=cached) == cands
    assert slot_table(digests, 5) == slot_table(list(digests), 5) and slot_table([], 5) == {}
