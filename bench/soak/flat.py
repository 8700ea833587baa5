"""The soak's "flat" rule (issue 12: memory and open fds "must stay flat"), decided from the samples.

Written before the first 60-minute soak run (2026-12-01) and applied to it as is:

- A daemon life's samples (``[t_s, node, pid, rss_kb, fds, cpu_s, log_lines, anon_kb]``,
  bench/soak/sampler.py) are cut into ``WINDOW_S`` (10-minute) windows from its first sample;
  only complete windows count (a shorter last window has fewer samples, so a higher minimum).
- Memory: the **floor** of RssAnon per window (its minimum: the level the daemon returns to
  between hot-loads; an anchor rebuild lifts it 10-40 MB for a minute and that is not growth).
  The life is flat when no window of the last ``SPAN_S`` (30 minutes: the last 3 windows) has a
  floor more than ``ANON_MB`` (0.5 MB) above the floor of the window just before them.
- Open fds: the **maximum** per window (connection churn swings fds by 50-80 between samples, a
  leak lifts every window's maximum). Flat when no window of the last 30 minutes has a maximum
  more than ``FD_SLACK`` (8) above the highest maximum of the windows before them.
- Judged only on a life with at least ``SPAN_S + WINDOW_S`` (40 minutes) of complete windows; a
  node is judged on its longest life (daemons the chaos loop spares live the whole run).

RssAnon rather than RSS: RSS also counts the tmpfs pages of the snapshots a daemon has mapped
(``RssShmem``), which come and go with the store's contents, not with the daemon's heap. RSS
floors are reported beside, not judged.
"""

from __future__ import annotations

from typing import Any

WINDOW_S = 600.0
SPAN_S = 1800.0
ANON_MB = 0.5
FD_SLACK = 8


def windows(ts: list[float], ys: list[float], window_s: float = WINDOW_S) -> tuple[list[float], list[float]]:
    """Per complete ``window_s`` window from ``ts[0]``: ``(minima, maxima)`` of ``ys``. A window is
    complete when a later sample exists at or after its end."""
    if not ts:
        return [], []
    n = int((ts[-1] - ts[0]) // window_s)
    lo: list[float] = [float("inf")] * n
    hi: list[float] = [float("-inf")] * n
    for t, y in zip(ts, ys):
        k = int((t - ts[0]) // window_s)
        if k < n:
            lo[k], hi[k] = min(lo[k], y), max(hi[k], y)
    keep = [k for k in range(n) if lo[k] != float("inf")]
    return [lo[k] for k in keep], [hi[k] for k in keep]


def judge_life(
    samples: list[list[Any]],
    window_s: float = WINDOW_S,
    span_s: float = SPAN_S,
    anon_mb: float = ANON_MB,
    fd_slack: float = FD_SLACK,
) -> dict[str, Any]:
    """The rule above on one life's samples (time order). Returns the per-window RssAnon and RSS
    floors (MB), fd maxima, the growths, and ``flat`` (True / False, None when too short)."""
    ts = [s[0] for s in samples]
    anon_lo, _ = windows(ts, [s[7] / 1024 for s in samples], window_s)
    rss_lo, _ = windows(ts, [s[3] / 1024 for s in samples], window_s)
    _, fd_hi = windows(ts, [float(s[4]) for s in samples], window_s)
    out: dict[str, Any] = {
        "window_min": window_s / 60,
        "anon_floor_mb": [round(x, 1) for x in anon_lo],
        "rss_floor_mb": [round(x, 1) for x in rss_lo],
        "fds_max": [int(x) for x in fd_hi],
        "flat": None,
    }
    last = int(span_s // window_s)
    if len(anon_lo) < last + 1:
        out["why"] = f"{len(anon_lo)} complete {window_s / 60:g}-minute windows, {last + 1} needed"
        return out
    base, later = anon_lo[-last - 1], anon_lo[-last:]
    out["anon_growth_mb"] = round(max(later) - base, 2)
    out["fds_growth"] = int(max(fd_hi[-last:]) - max(fd_hi[:-last]))
    out["anon_flat"] = out["anon_growth_mb"] < anon_mb
    out["fds_flat"] = out["fds_growth"] <= fd_slack
    out["flat"] = out["anon_flat"] and out["fds_flat"]
    return out


def judge(samples: list[list[Any]], **rule: Any) -> dict[str, Any]:
    """Per node: :func:`judge_life` of its longest life (by sampled span), with its pid and minutes."""
    lives: dict[tuple[str, int], list[list[Any]]] = {}
    for s in samples:
        lives.setdefault((s[1], s[2]), []).append(s)
    best: dict[str, list[list[Any]]] = {}
    for (node, _), ss in lives.items():
        if node not in best or ss[-1][0] - ss[0][0] > best[node][-1][0] - best[node][0][0]:
            best[node] = ss
    out: dict[str, Any] = {}
    for node, ss in sorted(best.items()):
        out[node] = {"pid": ss[0][2], "life_min": round((ss[-1][0] - ss[0][0]) / 60, 1), **judge_life(ss, **rule)}
    return out
