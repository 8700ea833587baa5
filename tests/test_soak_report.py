"""The soak report's floor slope (bench/soak/report.py): a transient rise does not read as growth,
a rising floor does."""

from __future__ import annotations

from bench.soak.report import floor_slope_per_min, slope_per_min


def test_a_transient_near_the_end_tilts_the_plain_slope_not_the_floor() -> None:
    ts = [5.0 * i for i in range(180)]  # 15 minutes, a sample every 5 s
    ys = [100.0 + (30.0 if 700 <= t < 760 else 0.0) for t in ts]  # one anchor rebuild: +30 MB for a minute
    assert slope_per_min(ts, ys) > 0.3
    assert abs(floor_slope_per_min(ts, ys)) < 1e-9  # type: ignore[arg-type]


def test_a_rising_floor_is_growth_and_too_few_minutes_give_none() -> None:
    ts = [5.0 * i for i in range(180)]
    ys = [100.0 + 0.5 * t / 60 + (20.0 if i % 12 == 0 else 0.0) for i, t in enumerate(ts)]  # +0.5 MB/min under spikes
    f = floor_slope_per_min(ts, ys)
    assert f is not None and abs(f - 0.5) < 0.05
    assert floor_slope_per_min(ts[:20], ys[:20]) is None  # under 3 minutes


def test_liar_chunks_are_counted_per_daemon_life(tmp_path) -> None:
    from bench.soak.report import MAX_PER_PEER, liar_hits

    bad = "2026-12-02 01:00:00 WARNING snapshot step000001: peer liar sent bad bytes for chunk 3\n"
    start = "2026-12-02 01:00:00 INFO bdnd node7 listening: peers on 0.0.0.0:7080 (advertised x)\n"
    log = tmp_path / "node7.log"
    # three lives of one daemon, each taking 3 bad chunks of the same snapshot (what max_per_peer allows)
    log.write_text((start + bad * 3) * 3)
    hits = liar_hits({"node7": log})
    assert hits["total"] == 9
    assert hits["max_per_snapshot"] == 3 <= MAX_PER_PEER
    assert hits["by_node"] == {f"node7 life {k}": {"step000001": 3} for k in (1, 2, 3)}


def test_not_done_replicas_are_explained_or_counted_as_findings() -> None:
    from bench.soak.report import not_done_reasons

    def rec(t: float, outcome: str, *nd: dict) -> dict:
        return {"t_post": t, "outcome": outcome, "not_done": list(nd)}

    records = [
        rec(0.0, "done"),
        rec(
            10.0,
            "not_done_before_next",
            {"node": "node2", "stage": "downloading"},  # superseded by the POST at 20
            {"node": "node3", "stage": "loading"},
        ),  # the engine crashed at 15: held until stale
        rec(
            20.0,
            "not_done_before_next",
            {"node": "node3", "stage": "done", "reason": "not counted: engine 1f (e) not seen for 11.0 s"},
            {"node": "node3", "stage": "error", "reason": "every engine stopped polling: engine 1f"},
        ),
        rec(
            100.0,
            "not_done_before_next",
            {"node": "node3", "stage": "loading"},  # no crash near: a finding
            {"node": "node5", "stage": None},
        ),
        rec(110.0, "not_done_at_end", {"node": "node1", "stage": "downloading"}),  # the end came: a finding
    ]
    why = not_done_reasons(records, [{"t_s": 15.0, "fault": "engine_crash"}, {"t_s": 50.0, "fault": "kill"}], "node3")
    assert (why["superseded"], why["engine_stale"], why["reported"]) == (1, 1, 2)
    assert dict(why["unexplained"]) == {"node3 stage loading": 1, "node5 stage None": 1, "node1 stage downloading": 1}


def test_the_second_half_trend_gives_a_slope_and_its_noise() -> None:
    from bench.soak.report import second_half_trend

    ts = [5.0 * i for i in range(720)]  # an hour, a sample every 5 s
    flat = [100.0 + (3.0 if i % 7 == 0 else 0.0) + (0.5 if i % 12 == 0 else 0.0) for i in range(720)]
    tr = second_half_trend(ts, flat)
    assert tr is not None and tr["bins"] == 30 and abs(tr["slope_per_min"]) <= 2 * tr["stderr_per_min"] + 1e-9
    rising = [100.0 + 0.2 * t / 60 for t in ts]
    tr = second_half_trend(ts, rising)
    assert tr is not None and abs(tr["slope_per_min"] - 0.2) < 1e-6 and tr["stderr_per_min"] < 1e-6
    peaks = [90.0 + (20.0 if i % 40 == 0 else 0.0) for i in range(720)]
    assert second_half_trend(ts, peaks, "max")["first"] == 110.0
    assert second_half_trend(ts[:50], flat[:50]) is None  # a 4-minute life: too short
