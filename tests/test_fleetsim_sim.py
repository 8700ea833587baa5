"""bench/fleetsim's event mechanics on small fleets: every node completes, bytes are conserved,
the bucket is read once per chunk, deaths and late joiners are handled (seeded, deterministic)."""

from __future__ import annotations

import pytest

pytest.importorskip("simpy")

from bench.fleetsim.scenario import Scenario
from bench.fleetsim.sim import FleetSim
from bench.fleetsim.today import TodaySim

GB = 1e9


def _fleet(n: int, chunks: int, **kw: object) -> Scenario:
    return Scenario("t", n, 2 * GB, chunks, 100e9 / 8, 10 * GB, 100e6, bucket_concurrency=32, **kw)


def test_fleet_run_completes_with_one_read_per_chunk_and_not_before_the_floor() -> None:
    sim = FleetSim(_fleet(12, 16))
    r = sim.run()
    assert r["done_nodes"] == r["live_nodes"] == 12
    assert r["seconds"] >= r["floor_s"]
    assert r["bucket_egress_over_s"] == pytest.approx(1.0)
    assert r["duplicate_bucket_reads"] == 0 and sorted(sim.bucket_reads) == list(range(16))
    # every node received every chunk it did not read: peer transfers + reads = nodes x chunks
    peer_got = sum(1 for _t, _n, e in sim.log if e == "snapshot ready")
    assert peer_got == 12
    assert r["readers"] == 5 and r["control_msgs_per_node_s_mean"] > 0
    assert all(x.nreq == 0 and x.uploads == 0 for x in sim.nodes.values())
    assert sim.net.active == 0


def test_deaths_and_late_joiners_still_complete_every_live_node() -> None:
    r = FleetSim(_fleet(20, 16, kill_frac=0.05, late_frac=0.1, hotload_fanout=6)).run()
    assert r["killed"] == 1 and r["late"] == 2
    assert r["done_nodes"] == r["live_nodes"] == 19
    # A dead reader's partial reads are read again, and while the joiners' views and the old
    # members' disagree on the reader set (within a SWIM period here: the floor is 0.2 s) two
    # nodes may both take a dead reader's chunk over: bounded, not zero.
    assert r["bucket_egress_over_s"] <= 1.5


def test_same_seed_same_run() -> None:
    a = FleetSim(_fleet(10, 8, seed=3)).run()
    b = FleetSim(_fleet(10, 8, seed=3)).run()
    assert a["seconds"] == b["seconds"] and a["chunk_requests"] == b["chunk_requests"]


def test_same_seed_same_event_log_with_deaths_and_joiners() -> None:
    # nothing in a run may depend on where its objects sit in memory: a kill aborts the dead
    # node's flows in their start order (a set of flows, iterated in address order, made one
    # N = 100 seed give other results in other processes; too rare to show at this size, so
    # this guards the rest: the same log with the flows at other addresses)
    runs, junk = [], []
    for k in range(3):
        junk.append([object() for _ in range(997 * k)])  # other addresses for the flows
        sim = FleetSim(_fleet(20, 16, seed=5, kill_frac=0.1, late_frac=0.1, hotload_fanout=6))
        r = sim.run()
        runs.append((sim.log, r["seconds"], r["chunk_requests"], r["network_refills"]))
    assert runs[0] == runs[1] == runs[2]
    assert any(e == "killed" for _t, _n, e in runs[0][0])


def test_the_remembered_slow_answers_are_the_books(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench.fleetsim import sim as fsim

    answers: list[bool] = []
    remembered = fsim._SlowMemo.__call__

    def checked(self: fsim._SlowMemo, src: str) -> bool:
        v = remembered(self, src)
        assert v == self.book.slow(src)  # the daemon's rule, asked afresh
        answers.append(v)
        return v

    monkeypatch.setattr(fsim._SlowMemo, "__call__", checked)
    r = FleetSim(_fleet(12, 16, seed=2)).run()
    assert r["done_nodes"] == r["live_nodes"] == 12
    assert len(answers) > 100


def test_today_model_completes_and_counts_its_polling() -> None:
    sc = Scenario("v", 4, 64 * (16 << 20), 64, 200e6 / 8, 200e6 / 8, 0.0, rtt_s=0.0005, policy="today")
    r = TodaySim(sc).run()
    assert r["done_nodes"] == 4 and r["bucket_egress_over_s"] == pytest.approx(1.0)
    assert r["seconds"] >= r["floor_s"]
    # today: a have-bitfield GET to each of 3 peers every 0.5 s (and its answer) while downloading
    assert r["control_msgs_per_node_s_mean"] >= 3 * 2 * 2 * 0.5


def _piped(n: int, chunks: int, forward: str, **kw: object) -> Scenario:
    return _fleet(
        n, chunks, serial_reads=True, have_flush_s=0.0, download_slots=16, max_per_peer=4, forward=forward, **kw
    )


def test_forwarding_real_chunks_as_they_arrive_and_cut_through_conserve_bytes() -> None:
    """A simulated chunk of 7.5 real ones (bench/fleetsim/forward.py): forwarded as each real
    chunk arrives ("real", bdnd) and with cut-through behind bucket reads ("cut"), against
    forwarding it only once whole ("store")."""
    r = {f: FleetSim(_piped(12, 16, f)).run() for f in ("store", "real", "cut")}
    for x in r.values():
        assert x["done_nodes"] == x["live_nodes"] == 12
        assert x["bucket_egress_over_s"] == pytest.approx(1.0) and x["seconds"] >= x["floor_s"]
    # Which way is fastest is not asserted: under the daemon's own upload admission
    # (bdn.daemon.serve.uploads: per-chunk fan-out, cut-through slots) store-and-forward came out
    # ahead at this size (12 nodes, 16 chunks: 1.311 s against 1.359 real, 1.365 cut); the
    # simulator's own upload queue, which favoured pipelining, is gone (issue 27).


def test_at_one_real_chunk_per_simulated_chunk_real_forwarding_is_store_and_forward() -> None:
    a = FleetSim(
        Scenario(
            "t",
            8,
            32 * (16 << 20),
            32,
            100e9 / 8,
            10 * GB,
            100e6,
            bucket_concurrency=32,
            serial_reads=True,
            forward="store",
        )
    ).run()
    b = FleetSim(
        Scenario(
            "t",
            8,
            32 * (16 << 20),
            32,
            100e9 / 8,
            10 * GB,
            100e6,
            bucket_concurrency=32,
            serial_reads=True,
            forward="real",
        )
    ).run()
    assert a["seconds"] == b["seconds"] and a["chunk_requests"] == b["chunk_requests"]


def test_a_copy_cut_short_by_a_death_is_withdrawn_and_every_live_node_completes() -> None:
    """A node announces a chunk while it arrives; when its source dies the copy fails, the node
    withdraws its announcement, and nobody waits on it (a stale HAVE once stalled a run)."""
    for seed in (1, 2):
        sim = FleetSim(
            _piped(20, 16, "real", kill_frac=0.05, late_frac=0.1, hotload_fanout=6, seed=seed, time_limit_s=30.0)
        )
        r = sim.run()
        assert r["done_nodes"] == r["live_nodes"] == 19, seed
        assert r["bucket_egress_over_s"] <= 1.5
        assert not sim.fwd.waiting and not sim.fwd.children


def test_endgame_races_cancel_their_losers_and_conserve_the_slots() -> None:
    """endgame_chunks > 0: the last chunks are asked of two holders; every node still completes
    with one bucket read per chunk, and no request, upload slot or flow is left behind."""
    sim = FleetSim(_fleet(24, 16, endgame_chunks=4, kill_frac=0.05, late_frac=0.1, hotload_fanout=6))
    raced = []
    got = sim.got

    def spy(nd, i, source):  # type: ignore[no-untyped-def]
        legs = nd.ps.asked.get(i) if nd.ps is not None else None
        if legs is not None and len(legs) > 1 and not nd.ps.held[i]:
            raced.append((nd.id, i))
        got(nd, i, source)

    sim.got = spy  # type: ignore[method-assign]
    r = sim.run()
    assert raced  # some races happened
    assert r["done_nodes"] == r["live_nodes"]
    assert r["bucket_egress_over_s"] <= 1.5
    live = [x for x in sim.nodes.values() if x.alive]
    assert all(x.nreq == 0 and x.uploads == 0 and x.upl.running == 0 for x in live)
    assert all(not x.ps.asked for x in live if x.ps is not None)
