"""Bounded-load owners (bdn.daemon.fetch.owners): who reads which chunk from the bucket.

Pure: tables from digests and node ids, no sockets, no clock.
"""

from __future__ import annotations

from collections import Counter

from bdn.daemon.fetch import owners
from bdn.proto import hrw

NODES = [f"n{i}" for i in range(1, 9)]
DIGESTS = [f"{i * 7919:032x}" for i in range(263)]


def test_every_owner_reads_an_equal_share_where_plain_hrw_does_not() -> None:
    table = owners.bounded(DIGESTS, NODES)
    assert set(table) == set(DIGESTS) and set(table.values()) <= set(NODES)
    loads = Counter(table.values())
    assert max(loads.values()) - min(loads.values()) <= 1  # 263 = 8 x 33 - 1
    plain = Counter(hrw.owner(NODES, d) for d in DIGESTS)
    assert max(plain.values()) - min(plain.values()) > 1  # what the table is for


def test_the_table_follows_hrw_where_capacity_allows_and_is_the_same_on_every_node() -> None:
    table = owners.bounded(DIGESTS, NODES)
    first_choice = sum(table[d] == hrw.owner(NODES, d) for d in DIGESTS)
    assert first_choice > len(DIGESTS) // 2
    for d in DIGESTS:  # never below a node with spare capacity: the owner is one of the ranking's
        assert table[d] in hrw.rank(NODES, d)
    o = owners.Owners()
    assert all(
        o.owner("L", list(reversed(NODES)), d, lambda: DIGESTS, len(DIGESTS))
        == o.owner("L", NODES, d, lambda: DIGESTS, len(DIGESTS))
        for d in DIGESTS
    )


def test_duplicate_digests_have_one_owner_and_count_once() -> None:
    ds = DIGESTS[:40] + DIGESTS[:10]
    table = owners.bounded(ds, NODES)
    assert len(table) == 40
    assert max(Counter(table.values()).values()) == 5


def test_a_node_leaving_moves_its_chunks_and_the_cache_follows_the_live_set() -> None:
    o = owners.Owners()
    built = []

    def digests() -> list[str]:
        built.append(1)
        return DIGESTS

    before = {d: o.owner("L", NODES, d, digests, len(DIGESTS)) for d in DIGESTS}
    assert len(built) == 1  # one table for the layer and live set
    live = [n for n in NODES if n != "n3"]
    after = {d: o.owner("L", live, d, digests, len(DIGESTS)) for d in DIGESTS}
    assert len(built) == 2 and "n3" not in after.values()
    assert max(Counter(after.values()).values()) == -(-len(DIGESTS) // len(live))  # the cap, no more
    # most chunks that n3 did not own keep their owner
    kept = sum(before[d] == after[d] for d in DIGESTS if before[d] != "n3")
    assert kept > len(DIGESTS) // 2
    o.forget("L")
    o.owner("L", NODES, DIGESTS[0], digests, len(DIGESTS))
    assert len(built) == 3


def test_alone_or_huge_layers_use_plain_hrw_without_a_table() -> None:
    o = owners.Owners()

    def never() -> list[str]:
        raise AssertionError("no table for these")

    assert o.owner("L", ["n1"], DIGESTS[0], never, 10) == "n1"
    big = owners.MAX_WORK // len(NODES) + 1
    assert o.owner("L", NODES, DIGESTS[0], never, big) == hrw.owner(NODES, DIGESTS[0])
    assert o.owner("L", [], DIGESTS[0], never, 10) is None
