"""The soak's flat rule (bench/soak/flat.py): a warm-up that levels off and transient rebuilds pass,
a slow leak of RssAnon or of fds does not, a short life gets no verdict."""

from __future__ import annotations

import math

from bench.soak.flat import judge, judge_life


def life(minutes: float, anon_mb, fds=lambda t: 100, node: str = "node0", pid: int = 1):  # type: ignore[no-untyped-def]
    """Samples every 5 s: ``[t_s, node, pid, rss_kb, fds, cpu_s, log_lines, anon_kb]``."""
    return [
        [
            5.0 * i,
            node,
            pid,
            int((anon_mb(5.0 * i) + 40) * 1024),
            int(fds(5.0 * i)),
            0.0,
            0,
            int(anon_mb(5.0 * i) * 1024),
        ]
        for i in range(int(minutes * 12) + 1)
    ]


def rebuild(t: float) -> float:
    return 30.0 if t % 120 < 40 else 0.0  # an anchor rebuild lifts RssAnon by 30 MB for 40 s every 2 min


def test_a_warm_up_that_levels_off_under_rebuild_spikes_is_flat() -> None:
    v = judge_life(life(62, lambda t: 76 - 10 * math.exp(-t / 400) + rebuild(t)))
    assert v["flat"] is True and v["anon_growth_mb"] < 0.5, v
    assert len(v["anon_floor_mb"]) == 6 and v["anon_floor_mb"][0] < v["anon_floor_mb"][-1]  # it did rise early


def test_a_slow_leak_is_not_flat() -> None:
    v = judge_life(life(62, lambda t: 70 + 0.05 * t / 60 + rebuild(t)))  # 1.5 MB per 30 minutes
    assert v["flat"] is False and v["anon_flat"] is False and v["fds_flat"] is True, v
    assert 1.0 < v["anon_growth_mb"] < 2.0


def test_fd_churn_is_flat_an_fd_leak_is_not() -> None:
    churn = judge_life(life(62, lambda t: 70, fds=lambda t: 100 + 60 * (int(t / 35) % 2)))
    assert churn["fds_flat"] is True and churn["flat"] is True, churn
    leak = judge_life(life(62, lambda t: 70, fds=lambda t: 100 + t / 120 + 60 * (int(t / 35) % 2)))  # +15 per 30 min
    assert leak["fds_flat"] is False and leak["flat"] is False, leak


def test_only_a_long_life_is_judged_and_a_node_by_its_longest() -> None:
    short = judge_life(life(35, lambda t: 70 + t))
    assert short["flat"] is None and "windows" in short["why"]
    samples = life(20, lambda t: 70 + t, node="node3", pid=7) + life(45, lambda t: 70, node="node3", pid=8)
    v = judge(samples)["node3"]
    assert v["pid"] == 8 and v["life_min"] == 45.0 and v["flat"] is True, v
