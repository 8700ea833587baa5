"""The per-hop timeline of a fleet simulation (bench/fleetsim/timeline.py): depths and hop times."""

from __future__ import annotations

from bench.fleetsim.timeline import analyse


def test_depths_hops_and_done_from_arrivals() -> None:
    # chunk 0: bucket -> a at 1.0, a -> b at 1.5, b -> c at 2.5; chunk 1: bucket -> b at 1.2,
    # b -> a at 1.4, a -> c at 3.0; d got chunk 0 only (killed): never done
    arrivals = [
        (1.0, "a", 0, "bucket"),
        (1.2, "b", 1, "bucket"),
        (1.4, "a", 1, "b"),
        (1.5, "b", 0, "a"),
        (2.0, "d", 0, "a"),
        (2.5, "c", 0, "b"),
        (3.0, "c", 1, "a"),
    ]
    r = analyse(arrivals, floor=2.0, chunk_bytes=1.25e9)
    assert r["last_bucket_read_s"] == 1.2
    assert r["first_node_done_s"] == 1.4 and r["last_node_done_s"] == 3.0  # d is not counted
    assert r["arrivals_by_depth"] == {0: 2, 1: 3, 2: 2}
    assert r["median_hop_s_by_depth"] == {1: 0.5, 2: 1.3}  # (0.2, 0.5, 1.0) and (1.0, 1.6)
    assert r["median_s_after_bucket_read_by_depth"][2] == 1.65  # 1.5 and 1.8 after their reads
    assert r["chunk_at_full_nic_s"] == 0.1


def test_combine_makes_one_row_of_single_seed_files(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`python -m bench.fleetsim --combine a.json b.json`: one process per seed, one row over both."""
    import json

    from bench.fleetsim.__main__ import KEYS, combine

    def row(seed: int, x: float) -> dict:
        r = {k: x for k in KEYS} | {
            "name": "fleet-n10000-delta",
            "seconds": 2 * x,
            "x_floor": x,
            "cpu_s": 1.0,
            "scenario": {"seed": seed},
            "seeds": [seed],
        }
        return r

    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "out.json"
    a.write_text(json.dumps([row(1, 1.10)]))
    b.write_text(json.dumps([row(2, 1.12)]))
    out.write_text(json.dumps([{"name": "fleet-n10000-delta", "x_floor": 9.9}, {"name": "other", "x_floor": 1.0}]))
    combine([a, b], out, code="abc")
    rows = {r["name"]: r for r in json.loads(out.read_text())}
    r = rows["fleet-n10000-delta"]
    assert r["seeds"] == [1, 2] and r["spread"]["x_floor"] == [1.10, 1.12] and r["code"] == "abc"
    assert [x["seed"] for x in r["runs"]] == [1, 2] and rows["other"]["x_floor"] == 1.0


def test_combine_adds_a_seed_to_a_published_row(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A row of seeds 1, 2 (the published one) and a single-seed file of seed 3 become one row of
    three seeds; the median run's other fields are that run's, not another seed's."""
    import json

    import pytest

    from bench.fleetsim.__main__ import KEYS, combine

    def row(seed: int, x: float) -> dict:
        return {k: x for k in KEYS} | {
            "name": "fleet-n1000-delta",
            "seconds": 2 * x,
            "x_floor": x,
            "cpu_s": 1.0,
            "chunk_requests": seed * 100,
            "floor_s": 2.0,
            "scenario": {"seed": seed},
            "seeds": [seed],
        }

    a, b, c, out = (tmp_path / f for f in ("a.json", "b.json", "c.json", "out.json"))
    a.write_text(json.dumps([row(1, 1.10)]))
    b.write_text(json.dumps([row(2, 1.20)]))
    combine([a, b], out)  # the published row: seeds 1, 2, the median run's fields are seed 2's
    assert json.loads(out.read_text())[0]["chunk_requests"] == 200
    c.write_text(json.dumps([row(3, 1.15)]))
    published = tmp_path / "published.json"
    published.write_text(out.read_text())
    combine([published, c], out, code="x")
    (r,) = json.loads(out.read_text())
    assert r["seeds"] == [1, 2, 3] and r["x_floor"] == 1.15 and r["spread"]["x_floor"] == [1.10, 1.20]
    assert r["chunk_requests"] == 300 and r["scenario"]["seed"] == 3 and r["floor_s"] == 2.0
    assert [x["seed"] for x in r["runs"]] == [1, 2, 3]
    with pytest.raises(SystemExit, match="seed given twice"):
        combine([published, a], out)


def test_a_run_with_its_timeline_is_the_same_run() -> None:
    """``--timeline`` records arrivals only: the run's results are those of a run without it."""
    from bench.fleetsim.__main__ import run_one
    from bench.fleetsim.scenario import Scenario

    def sc() -> Scenario:
        return Scenario("t", 12, 2e9, 16, 100e9 / 8, 10e9, 100e6, bucket_concurrency=32, seed=4, late_frac=0.1)

    plain, timed = run_one(sc()), run_one(sc(), timeline=True)
    for r in (plain, timed):
        r.pop("wall_s"), r.pop("cpu_s")
    t = timed.pop("timeline")
    assert "timeline" not in plain and timed == plain
    assert t["last_node_done_s"] == plain["seconds"] and t["last_bucket_read_s"] <= t["last_node_done_s"]
    assert sum(t["arrivals_by_depth"].values()) == 16 * 12  # each of the 16 chunks once at each node
    assert max(t["done_initial"]["max"], t["done_joiners"]["max"]) == plain["seconds"]
