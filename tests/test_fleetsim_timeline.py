"""The per-hop timeline of a fleet simulation (bench/fleetsim/timeline.py): depths and hop times."""

from __future__ import annotations

from bench.fleetsim.timeline import analyse


def test_depths_hops_and_done_from_arrivals() -> None:
    # chunk 0: bucket -> a at 1.0, a -> b at 1.5, b -> c at 2.5; chunk 1: bucket -> b at 1.2,
    # b -> a at 1.4, a -> c at 3.0; d got chunk 0 only (killed): never done
    arrivals = [
        (1.0, "a", 0, "bucket"), (1.2, "b", 1, "bucket"), (1.4, "a", 1, "b"), (1.5, "b", 0, "a"),
        (2.0, "d", 0, "a"), (2.5, "c", 0, "b"), (3.0, "c", 1, "a"),
    ]
    r = analyse(arrivals, floor=2.0, chunk_bytes=1.25e9)
    assert r["last_bucket_read_s"] == 1.2
    assert r["first_node_done_s"] == 1.4 and r["last_node_done_s"] == 3.0  # d is not counted
    assert r["arrivals_by_depth"] == {0: 2, 1: 3, 2: 2}
    assert r["median_hop_s_by_depth"] == {1: 0.5, 2: 1.3}  # (0.2, 0.5, 1.0) and (1.0, 1.6)
    assert r["median_s_after_bucket_read_by_depth"][2] == 1.65  # 1.5 and 1.8 after their reads
    assert r["chunk_at_full_nic_s"] == 0.1
