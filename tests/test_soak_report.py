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
    from bench.soak.report import REASONS, classify_not_done, not_done_reasons

    def rec(ident: str, t: float, outcome: str, *nd: dict) -> dict:
        return {"identity": ident, "t_post": t, "outcome": outcome, "not_done": list(nd)}

    records = [
        rec("s1", 0.0, "done"),
        rec(
            "s2",
            10.0,
            "not_done_before_next",
            {"node": "node2", "stage": "downloading"},  # superseded by the POST at 20
            {"node": "node3", "stage": "ready"},  # the engine crashed at 15: held until stale
        ),
        rec(
            "s3",
            20.0,
            "not_done_before_next",
            {"node": "node3", "stage": "done", "reason": "not counted: engine 1f (e) not seen for 11.0 s"},
            {"node": "node3", "stage": "error", "reason": "every engine stopped polling: engine 1f"},
        ),
        rec(
            "s4",
            100.0,
            "not_done_before_next",
            # the view said verifying; asked a moment later it was done: the view's stage counts
            {"node": "node3", "stage": "verifying", "in_view": True, "own": {"stage": "done", "current": "s4"}},
            {"node": "node5", "stage": None, "in_view": False},  # absent, nobody asked it: a finding
            {"node": "node7", "stage": None, "in_view": False, "viewer_peer": {"alive": True, "penalised": True}},
            {"node": "node6", "stage": "done", "identity": "s4", "current": "s3", "in_view": True},  # inconsistent
            {"node": "node4", "stage": "queued"},  # killed at 50, back at 60: long before this POST
        ),
        rec(
            "s5",
            110.0,
            "not_done_before_next",
            {"node": "node4", "stage": None, "in_view": False},  # killed at 115, back at 130
            {"node": "node1", "stage": "done", "identity": "s4", "in_view": True},  # slow restart, back at 95
            {"node": "node2", "stage": None, "in_view": False, "own": {"stage": "done", "current": "s5"}},
        ),
        rec("s6", 120.0, "not_done_at_end", {"node": "node0", "stage": "downloading"}),  # the end came
    ]
    chaos = [
        {"t_s": 15.0, "fault": "engine_crash", "node": "node3"},
        {"t_s": 50.0, "fault": "kill", "node": "node4"},
        {"t_s": 60.0, "action": "restarted", "node": "node4"},
        {"t_s": 80.0, "fault": "slow", "node": "node1"},
        {"t_s": 95.0, "action": "restarted", "node": "node1"},
        {"t_s": 105.0, "fault": "liar", "node": "node2"},
        {"t_s": 112.0, "action": "restarted", "node": "node2"},
        {"t_s": 115.0, "fault": "kill", "node": "node4"},
        {"t_s": 130.0, "action": "restarted", "node": "node4"},
    ]
    why = not_done_reasons(records, chaos, "node3")
    assert why["superseded while loading"] == 3  # node2 at s2, node3 verifying and node4 queued at s4
    assert why["cut off by the end of the run while loading"] == 1
    assert why["engine crashed or restarted (chaos engine_crash)"] == 1
    assert why["reported (error, or a stale engine named)"] == 2
    assert why["daemon killed and restarted (chaos kill)"] == 1
    assert why["daemon restarted with a slow uplink (chaos slow)"] == 1
    assert why["daemon restarted with the liar as a peer (chaos liar)"] == 1  # node2 at s5, back at 112
    assert why["row says done while the old snapshot is served"] == 1
    assert why["left out of the fleet view: the viewer had it penalised"] == 1
    assert why["unexplained"] == 1 and dict(why["unexplained_by"]) == {"node5 stage None": 1}
    rows = classify_not_done({"hotload_records": records, "chaos": chaos, "engine_node": "node3"})
    assert len(rows) == sum(len(r["not_done"]) for r in records)  # every one classified, none dropped
    assert set(REASONS) >= {x["why"] for x in rows}


def test_penalties_are_counted_per_peer_and_honest_bad_bytes_named(tmp_path) -> None:
    from bench.soak.report import penalties

    ts = "2026-12-07 03:16:50,708"
    lines = [
        f"{ts} node8 WARNING bdn.fetch.wire: snapshot step000016: peer liar sent bad bytes for chunk 0 of m; "
        "penalised for 30 s",
        f"{ts} node0 WARNING bdn.fetch.wire: snapshot step000016: peer liar sent bad bytes for chunk 1 of m; "
        "penalised for 30 s (and 2 more like it in the last 10 s)",
        f"{ts} node8 WARNING bdn.fetch.wire: snapshot step000016: peer node3 sent bad bytes for chunk 0 of m; "
        "penalised for 30 s",
        f"{ts} node8 WARNING bdn.fetch: snapshot step000012: peer node6 refused the chunks it advertises, request "
        "after request (the last: not here, chunk 20 of m); penalised for 30 s",
        f"{ts} node8 WARNING bdn.fetch: snapshot step000057: peer node6 is slow: chunk 0 of m (865436 bytes) not "
        "done after 9.4 s, the other sources' median is 1032 KB/s; asked elsewhere, penalised for 30 s",
        f"{ts} node8 INFO bdn.fetch: something else entirely",
    ]
    log = tmp_path / "bdnd.log"
    log.write_text("\n".join(lines) + "\n")
    pen = penalties({"node8": log})
    assert pen["by_peer"] == {
        "liar": {"bad bytes": 4},
        "node3": {"bad bytes": 1},
        "node6": {"refused what it advertises": 1, "slow": 1},
    }
    assert pen["honest_bad_bytes"] == {"node3": 1}


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
