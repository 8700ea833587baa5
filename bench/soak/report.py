"""The soak's numbers: hot-load latencies, memory and fd slopes, log rates, and the text summary.

Slopes are least-squares lines (``numpy.polyfit``, degree 1) over one daemon life's samples after
its first ``warmup_s`` seconds, in MB/min (RSS) and fds/min; a life needs at least ``min_span_s``
seconds of samples after warm-up to get one. The node's reported slope is that of its longest life
(``node0`` is spared by the chaos loop, so it has the whole run). "Flat" is judged on the growth
the slope implies over the run: below ``RSS_FLAT_MB`` MB and ``FD_FLAT`` fds over the run's
minutes, judged only on a life of at least ``JUDGE_MIN_S`` seconds. Beside it, the "floor"
slopes (``rss_floor_mb_per_min``, ``anon_floor_mb_per_min``) fit the per-minute minima, the level
a daemon returns to between hot-loads (:func:`floor_slope_per_min`): a leak moves the floor, a
transient anchor rebuild does not.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from bench.soak import flat as flat_rule

RSS_FLAT_MB = 50.0
FD_FLAT = 20.0
#: bdnd's max_per_peer default: chunk requests in flight to one peer (bdn/daemon/config.py)
MAX_PER_PEER = 4
JUDGE_MIN_S = 600.0  # a life shorter than this gets slopes but no flat/growing verdict


def percentile(xs: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100, linear interpolation), None for no data."""
    return round(float(np.percentile(np.asarray(xs, dtype=float), q)), 3) if xs else None


def slope_per_min(ts: list[float], ys: list[float]) -> float:
    """Least-squares slope of ``ys`` against ``ts`` (seconds), per minute."""
    return float(np.polyfit(np.asarray(ts, float) / 60.0, np.asarray(ys, float), 1)[0])


def floor_slope_per_min(ts: list[float], ys: list[float], bin_s: float = 60.0) -> float | None:
    """Least-squares slope (per minute) of the per-``bin_s`` minima of ``ys``: the level memory
    returns to between hot-loads. A daemon's RSS jumps 10-40 MB while it rebuilds an anchor and
    drops back after; a few of those near one end of a life tilt the plain slope of every sample
    (a 15-minute run read +0.5 MB/min where the per-minute medians moved 100 -> 102 MB). None
    with fewer than 3 bins."""
    bins: dict[int, float] = {}
    for t, y in zip(ts, ys):
        k = int((t - ts[0]) // bin_s)
        bins[k] = min(y, bins.get(k, y))
    if len(bins) < 3:
        return None
    ks = sorted(bins)
    return slope_per_min([k * bin_s for k in ks], [bins[k] for k in ks])


def second_half_trend(
    ts: list[float], ys: list[float], kind: str = "min", bin_s: float = 60.0
) -> dict[str, Any] | None:
    """The trend of one daemon life's second half: the per-``bin_s`` minima (``kind`` "min": the
    memory floor) or maxima ("max": the fd peaks) of its samples from the life's midpoint on,
    their least-squares slope per minute, the slope's standard error (the noise: the scatter of
    the bins about the line), and the total change the slope implies over that half.
    ``{"slope_per_min", "stderr_per_min", "over_min", "implied", "first", "last", "bins"}``;
    None with fewer than 5 bins."""
    if not ts:
        return None
    mid = ts[0] + (ts[-1] - ts[0]) / 2
    pick = min if kind == "min" else max
    bins: dict[int, float] = {}
    for t, y in zip(ts, ys):
        if t >= mid:
            k = int((t - mid) // bin_s)
            bins[k] = pick(y, bins[k]) if k in bins else y
    if len(bins) < 5:
        return None
    xs = [k * bin_s / 60.0 for k in sorted(bins)]
    vs = [bins[k] for k in sorted(bins)]
    n = len(xs)
    mx, my = sum(xs) / n, sum(vs) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, vs)) / sxx
    resid = sum((y - my - b * (x - mx)) ** 2 for x, y in zip(xs, vs))
    se = (resid / (n - 2) / sxx) ** 0.5
    return {
        "slope_per_min": round(b, 4),
        "stderr_per_min": round(se, 4),
        "over_min": round(xs[-1] - xs[0], 1),
        "implied": round(b * (xs[-1] - xs[0]), 2),
        "first": round(vs[0], 1),
        "last": round(vs[-1], 1),
        "bins": n,
    }


def second_half(samples: list[list[Any]]) -> dict[str, Any]:
    """Per node, its longest life's second-half trends (:func:`second_half_trend`): the RssAnon
    floor (MB, per-minute minima) and the open fds (per-minute maxima). ``samples`` rows are
    ``[t_s, node, pid, rss_kb, fds, cpu_s, log_lines, anon_kb]``."""
    lives: dict[tuple[str, int], list[list[Any]]] = {}
    for row in samples:
        lives.setdefault((row[1], row[2]), []).append(row)
    out: dict[str, Any] = {}
    for (node, pid), rows in sorted(lives.items()):
        span = rows[-1][0] - rows[0][0]
        if node in out and out[node]["life_min"] * 60 >= span:
            continue
        ts = [x[0] for x in rows]
        out[node] = {
            "pid": pid,
            "life_min": round(span / 60, 1),
            "anon_mb": second_half_trend(ts, [x[7] / 1024 for x in rows], "min"),
            "fds": second_half_trend(ts, [float(x[4]) for x in rows], "max"),
        }
    return out


def floor_levels(ts: list[float], ys: list[float], bin_s: float = 300.0) -> list[float]:
    """The minimum of ``ys`` in each ``bin_s`` window from the first sample (a life's floor per 5 minutes)."""
    bins: dict[int, float] = {}
    for t, y in zip(ts, ys):
        k = int((t - ts[0]) // bin_s)
        bins[k] = min(y, bins.get(k, y))
    return [round(bins[k], 1) for k in sorted(bins)]


def resources(samples: list[list[Any]], warmup_s: float, min_span_s: float, flat_over_min: float) -> dict[str, Any]:
    """Per node: each life's RSS / fd first-last-max and slope; the node's slope from its longest life."""
    lives: dict[tuple[str, int], list[list[Any]]] = {}
    for s in samples:
        lives.setdefault((s[1], s[2]), []).append(s)
    out: dict[str, Any] = {}
    for (node, pid), ss in sorted(lives.items()):
        t0 = ss[0][0]
        late = [s for s in ss if s[0] - t0 >= warmup_s]
        life: dict[str, Any] = {
            "pid": pid,
            "from_s": ss[0][0],
            "to_s": ss[-1][0],
            "samples": len(ss),
            "rss_mb_first": round(ss[0][3] / 1024, 1),
            "rss_mb_last": round(ss[-1][3] / 1024, 1),
            "rss_mb_max": round(max(s[3] for s in ss) / 1024, 1),
            "fds_first": ss[0][4],
            "fds_last": ss[-1][4],
            "fds_max": max(s[4] for s in ss),
            "cpu_s": ss[-1][5],
        }
        if len(late) >= 3 and late[-1][0] - late[0][0] >= min_span_s:
            life["rss_mb_per_min"] = round(slope_per_min([s[0] for s in late], [s[3] / 1024 for s in late]), 3)
            life["fds_per_min"] = round(slope_per_min([s[0] for s in late], [s[4] for s in late]), 3)
            if len(late[0]) > 7:
                life["anon_mb_per_min"] = round(slope_per_min([s[0] for s in late], [s[7] / 1024 for s in late]), 3)
            half = [s for s in late if s[0] >= (late[0][0] + late[-1][0]) / 2]
            for key, col in (("rss_floor_mb_per_min", 3), ("anon_floor_mb_per_min", 7)):
                if len(late[0]) > col:
                    f = floor_slope_per_min([s[0] for s in late], [s[col] / 1024 for s in late])
                    if f is not None:
                        life[key] = round(f, 3)
                    # the second half alone: a warm-up that levels off (allocator, bounded pools) reads
                    # flat here, a leak does not
                    f = floor_slope_per_min([s[0] for s in half], [s[col] / 1024 for s in half])
                    if f is not None:
                        life[key.replace("_per_min", "_per_min_2nd_half")] = round(f, 3)
            if len(late[0]) > 7:
                life["anon_floor_mb_by_5min"] = floor_levels([s[0] for s in ss], [s[7] / 1024 for s in ss])
        out.setdefault(node, {"lives": []})["lives"].append(life)
    for rec in out.values():
        sloped = [lf for lf in rec["lives"] if "rss_mb_per_min" in lf]
        rec["fds_max"] = max(lf["fds_max"] for lf in rec["lives"])
        rec["rss_mb_max"] = max(lf["rss_mb_max"] for lf in rec["lives"])
        if sloped:
            best = max(sloped, key=lambda lf: lf["to_s"] - lf["from_s"])
            rec["slope_life_pid"] = best["pid"]
            rec["slope_life_min"] = round((best["to_s"] - best["from_s"]) / 60, 1)
            rec["rss_mb_per_min"] = best["rss_mb_per_min"]
            rec["fds_per_min"] = best["fds_per_min"]
            for key in (
                "anon_mb_per_min",
                "rss_floor_mb_per_min",
                "anon_floor_mb_per_min",
                "rss_floor_mb_per_min_2nd_half",
                "anon_floor_mb_per_min_2nd_half",
                "anon_floor_mb_by_5min",
            ):
                if key in best:
                    rec[key] = best[key]
            if best["to_s"] - best["from_s"] >= JUDGE_MIN_S:  # shorter lives: numbers, no verdict
                rec["flat"] = (
                    abs(best["rss_mb_per_min"]) * flat_over_min < RSS_FLAT_MB
                    and abs(best["fds_per_min"]) * flat_over_min < FD_FLAT
                )
    return out


def memory_owners(maps: list[list[Any]], warmup_s: float) -> dict[str, Any]:
    """Per node, its longest life's ``maps`` rows (bench/soak/sampler.py) after ``warmup_s``: the
    first and last MB of the glibc main heap, the glibc thread arenas and the other anonymous
    mappings, each one's least-squares slope (MB/min), and the arena heaps and threads at the end."""
    lives: dict[tuple[str, int], list[list[Any]]] = {}
    for m in maps:
        lives.setdefault((m[1], m[2]), []).append(m)
    best: dict[str, list[list[Any]]] = {}
    for (node, _), ms in lives.items():
        late = [m for m in ms if m[0] - ms[0][0] >= warmup_s]
        if len(late) >= 3 and (node not in best or late[-1][0] - late[0][0] > best[node][-1][0] - best[node][0][0]):
            best[node] = late
    out: dict[str, Any] = {}
    for node, ms in sorted(best.items()):
        ts = [m[0] for m in ms]
        rec: dict[str, Any] = {
            "pid": ms[0][2],
            "from_s": ts[0],
            "to_s": ts[-1],
            "arena_heaps_last": ms[-1][5],
            "threads_last": ms[-1][7],
        }
        for key, col in (("heap", 3), ("arenas", 4), ("other", 6)):
            ys = [m[col] / 1024 for m in ms]
            rec[f"{key}_mb_first"], rec[f"{key}_mb_last"] = round(ys[0], 1), round(ys[-1], 1)
            rec[f"{key}_mb_per_min"] = round(slope_per_min(ts, ys), 3)
        out[node] = rec
    return out


def log_rates(samples: list[list[Any]], minutes: float) -> dict[str, Any]:
    """Per node: lines in the log over the run, lines per minute, and the busiest minute."""
    out: dict[str, Any] = {}
    by_node: dict[str, list[list[Any]]] = {}
    for s in samples:
        by_node.setdefault(s[1], []).append(s)
    for node, ss in sorted(by_node.items()):
        per_min: Counter[int] = Counter()
        prev = ss[0][6]
        for s in ss[1:]:
            per_min[int(s[0] // 60)] += s[6] - prev
            prev = s[6]
        out[node] = {
            "lines": ss[-1][6],
            "per_min": round(ss[-1][6] / max(minutes, 1e-9), 1),
            "busiest_min": max(per_min.values()) if per_min else 0,
        }
    return out


_NUM = re.compile(r"\b[0-9a-f]{8,}\b|\d+(\.\d+)?")


def top_log_lines(
    paths: dict[str, Path], levels: tuple[str, ...] = ("WARNING", "ERROR", "CRITICAL"), n: int = 15
) -> list[dict[str, Any]]:
    """The most frequent warning/error messages over every daemon's log (numbers and hex masked)."""
    c: Counter[str] = Counter()
    example: dict[str, str] = {}
    for p in paths.values():
        try:
            text = p.read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            if not any(f" {lv} " in line or f'"{lv}"' in line for lv in levels):
                continue
            body = line.split(" ", 2)[-1] if line[:4].isdigit() else line
            key = _NUM.sub("#", body)[:200]
            c[key] += 1
            example.setdefault(key, line[:400])
    return [{"count": k, "pattern": pat, "example": example[pat]} for pat, k in c.most_common(n)]


_LIAR = re.compile(r"snapshot (\S+): peer liar sent bad bytes")
#: The line each life of a daemon logs once it listens (bdn/daemon/app.py); the soak appends a
#: restarted daemon's log to the same file, so this line separates its lives.
_LIFE = re.compile(r"bdnd \S+ listening: ")


def liar_hits(paths: dict[str, Path]) -> dict[str, Any]:
    """Bad chunks each daemon life took from the liar, per snapshot (its "sent bad bytes" log lines).

    Keys of ``by_node`` are ``"<node> life <k>"`` (k counts the daemon's starts in its log from 1):
    a restarted daemon downloads a snapshot again and meets the liar afresh, so its lives are
    counted apart. A penalty (``penalty_s``) should send a daemon elsewhere after the first; many
    per snapshot in one life means requests already queued for the liar still went to it (issue
    12, item 8)."""
    per: dict[str, dict[str, int]] = {}
    for node, p in sorted(paths.items()):
        try:
            text = p.read_text(errors="replace")
        except OSError:
            continue
        life = 0
        for line in text.splitlines():
            if _LIFE.search(line):
                life += 1
                continue
            m = _LIAR.search(line)
            if m:
                key = f"{node} life {max(life, 1)}"
                per.setdefault(key, {}).setdefault(m.group(1), 0)
                per[key][m.group(1)] += 1
    counts = [n for d in per.values() for n in d.values()]
    return {"total": sum(counts), "max_per_snapshot": max(counts, default=0), "by_node": per}


def hotload_stats(hotloads: list[dict[str, Any]]) -> dict[str, Any]:
    done = [h for h in hotloads if h["outcome"] == "done"]
    ready = [h["ready_s"] for h in hotloads if h["ready_s"] is not None]
    outcomes = Counter(h["outcome"] for h in hotloads)
    return {
        "posted": len(hotloads),
        "completed": len(done),
        "completed_after_faults": sum(1 for h in done if h["faults_before"] > 0),
        "outcomes": dict(outcomes),
        "post_to_all_done_s": {
            "p50": percentile([h["done_s"] for h in done], 50),
            "p99": percentile([h["done_s"] for h in done], 99),
            "max": max((h["done_s"] for h in done), default=None),
        },
        "post_to_all_ready_s": {
            "p50": percentile(ready, 50),
            "p99": percentile(ready, 99),
            "max": max(ready, default=None),
            "n": len(ready),
        },
        "posts_needing_retry": sum(1 for h in hotloads if len(h["attempts"]) > 1),
    }


_NUMS = re.compile(r"step\d+|\d+")

_PENALTY = re.compile(
    r"^\S+ \S+ (?P<by>\S+) WARNING \S+ snapshot \S+: peer (?P<peer>\S+) (?P<what>sent bad bytes|stalled on chunk|is slow|"
    r"refused the chunks it advertises).*?penalised for [\d.]+ s(?: \(and (?P<more>\d+) more like it)?"
)
_PENALTY_KIND = {
    "sent bad bytes": "bad bytes",
    "stalled on chunk": "stalled",
    "is slow": "slow",
    "refused the chunks it advertises": "refused what it advertises",
}


def penalties(paths: dict[str, Path], liars: tuple[str, ...] = ("liar",)) -> dict[str, Any]:
    """Penalties each peer got over the run, from every daemon's log (bdn/daemon/fetch: "peer X
    sent bad bytes / stalled / is slow / refused the chunks it advertises ... penalised for N s",
    with a rate-limited line's "(and N more like it)" added): ``{"by_peer": {peer: {kind: n}},
    "honest_bad_bytes": {peer: n}}``. Bad bytes from a peer that is not one of ``liars`` is a
    bug (an honest daemon never serves bytes that fail their digest); the other kinds are about
    speed or a stale have-list and say nothing about honesty."""
    by_peer: dict[str, Counter[str]] = {}
    examples: dict[str, str] = {}
    for _node, p in sorted(paths.items()):
        try:
            text = p.read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            if "penalised for" not in line:
                continue
            m = _PENALTY.search(line)
            if not m:
                continue
            kind = _PENALTY_KIND[m.group("what")]
            by_peer.setdefault(m.group("peer"), Counter())[kind] += 1 + int(m.group("more") or 0)
            examples.setdefault(f"{m.group('peer')} {kind}", line[:300])
    honest = {peer: c["bad bytes"] for peer, c in by_peer.items() if c.get("bad bytes") and peer not in liars}
    return {
        "by_peer": {peer: dict(c) for peer, c in sorted(by_peer.items())},
        "liars": list(liars),
        "honest_bad_bytes": honest,
        "examples": {k: v for k, v in examples.items() if k.split(" ", 1)[0] in honest},
    }


#: Stages of a replica still loading its target: a POST that comes meanwhile supersedes it (the
#: replica's row lists it in ``superseded``), which is the trainer's pace, not the daemon's fault.
LOADING_STAGES = ("queued", "downloading", "applying", "verifying")
#: How long before a POST an engine crash can still hold its replica: bdnd's engine_stale_s (10 s)
#: plus a liveness tick (a third of it) and the engine's restart and first poll.
ENGINE_HOLD_S = 20.0
#: How long after a daemon's restart (chaos ``kill``, ``liar`` or ``slow``: each kills it and
#: starts it again) its replica can still be catching up: membership and the target's catch-up,
#: then the snapshot's load.
RESTART_HOLD_S = 30.0
#: Faults that kill a daemon and start it again (bench/soak/chaos.py).
RESTARTING_FAULTS = ("kill", "liar", "slow")

#: The reasons :func:`classify_not_done` gives, in the order the report lists them.
REASONS = (
    "superseded while loading",
    "cut off by the end of the run while loading",
    "daemon killed and restarted (chaos kill)",
    "daemon restarted with the liar as a peer (chaos liar)",
    "daemon restarted with a slow uplink (chaos slow)",
    "engine crashed or restarted (chaos engine_crash)",
    "reported (error, or a stale engine named)",
    "row says done while the old snapshot is served",
    "left out of the fleet view: the viewer had it penalised",
    "left out of the fleet view: the viewer had it not alive",
    "unexplained",
)
_BY_FAULT = {"kill": REASONS[2], "liar": REASONS[3], "slow": REASONS[4]}


def _down_windows(r: dict[str, Any]) -> dict[str, list[tuple[float, float, str]]]:
    """Per node, ``(killed_at, healthy_again_at, fault)`` of each restart the chaos loop made
    (``RESTARTING_FAULTS``; ``inf`` when it did not come back within the run)."""
    out: dict[str, list[tuple[float, float, str]]] = {}
    ev = sorted(r.get("chaos", []), key=lambda e: e["t_s"])
    for i, e in enumerate(ev):
        if e.get("fault") in RESTARTING_FAULTS and e.get("node"):
            back = next(
                (x["t_s"] for x in ev[i + 1 :] if x.get("action") == "restarted" and x.get("node") == e["node"]),
                float("inf"),
            )
            out.setdefault(e["node"], []).append((e["t_s"], back, e["fault"]))
    return out


def classify_not_done(r: dict[str, Any]) -> list[dict[str, Any]]:
    """Every replica not done with a hot-load before the next POST (or the end of the run), with
    its reason (one of ``REASONS``), from the result's records alone (pure):
    ``[{"identity", "node", "stage", "reason", "why", "own"?}]``.

    The stage is the fleet view's at the trainer's last look (its ``not_done`` row); a replica
    the view left out gets the stage of its own row (``own``: the trainer asked it right after,
    bench/soak/trainer.py). In order:

    - ``reported``: stage ``error`` with a reason, or a reason naming a stale engine;
    - the engine's replica ``ready``/``loading``/``error`` with an engine crash or an engine
      start within ``ENGINE_HOLD_S`` before the POST or before the next one;
    - a daemon the chaos loop killed (``RESTARTING_FAULTS``) before the next POST and that was
      healthy again less than ``RESTART_HOLD_S`` before the POST (or not yet);
    - ``superseded while loading`` / ``cut off by the end``: still in ``LOADING_STAGES``, or
      ``ready``/``loading`` (verified here, the engine or the change event still to come);
    - ``done`` with another snapshot served (the inconsistent row, fixed in replica/view.py);
    - left out of the view, with how the viewer lists it (penalised / not alive);
    - anything else is ``unexplained`` (a finding)."""
    engine_node = r.get("engine_node", "node1")
    engine_events = sorted(
        e["t_s"] for e in r.get("chaos", []) if e.get("fault") == "engine_crash" or e.get("action") == "engine_started"
    )
    downs = _down_windows(r)
    records = r["hotload_records"]
    out: list[dict[str, Any]] = []
    for i, h in enumerate(records):
        if h.get("outcome") not in ("not_done_before_next", "not_done_at_end"):
            continue
        t_next = records[i + 1]["t_post"] if i + 1 < len(records) else float("inf")
        lo = h["t_post"]
        for nd in h.get("not_done", []):
            own = nd.get("own")
            src = own if (own and nd.get("in_view") is False) else nd
            stage, reason = src.get("stage"), src.get("reason") or ""
            node = nd["node"]
            fault = [f for t0, t1, f in downs.get(node, []) if t0 <= t_next and t1 >= lo - RESTART_HOLD_S]
            if "not seen for" in reason or "stopped polling" in reason or (stage == "error" and reason):
                why = REASONS[6]
            elif (
                node == engine_node
                and stage in ("ready", "loading", "error")
                and any(lo - ENGINE_HOLD_S <= t <= t_next for t in engine_events)
            ):
                why = REASONS[5]
            elif fault:
                why = _BY_FAULT[fault[-1]]
            elif stage in LOADING_STAGES or stage in ("ready", "loading"):
                why = REASONS[0] if h["outcome"] == "not_done_before_next" else REASONS[1]
            elif stage == "done" and src.get("current") != h["identity"] and src.get("identity") == h["identity"]:
                why = REASONS[7]
            elif nd.get("in_view") is False and (nd.get("viewer_peer") or {}).get("penalised"):
                why = REASONS[8]
            elif nd.get("in_view") is False and (nd.get("viewer_peer") or {}).get("alive") is False:
                why = REASONS[9]
            else:
                why = REASONS[-1]
            out.append(
                {
                    "identity": h["identity"],
                    "node": node,
                    "stage": stage,
                    "reason": reason,
                    "why": why,
                    **({"own": own} if own is not None else {}),
                }
            )
    return out


def not_done_reasons(records: list[dict[str, Any]], chaos: list[dict[str, Any]], engine_node: str) -> dict[str, Any]:
    """The count of each reason of :func:`classify_not_done` (``REASONS``), plus
    ``"unexplained_by"``: a Counter of ``"node stage S"`` for the unexplained ones. Pure."""
    rows = classify_not_done({"hotload_records": records, "chaos": chaos, "engine_node": engine_node})
    counts = Counter(x["why"] for x in rows)
    out: dict[str, Any] = {k: counts.get(k, 0) for k in REASONS}
    out["unexplained_by"] = Counter(f"{x['node']} stage {x['stage']}" for x in rows if x["why"] == REASONS[-1])
    return out


def findings(r: dict[str, Any]) -> list[str]:
    """What the daemon did wrong in this run, one line each (the report's FINDING lines)."""
    out: list[str] = []
    engine_node = r.get("engine_node", "node1")
    v = r["verify"]
    if v["wrong_bytes_handed_out"]:
        out.append(f"{v['wrong_bytes_handed_out']} wrong answers: {v['wrong'][:3]}")
    for e in r["unexpected_exits"]:
        out.append(f"{e.get('node')} exited on its own at {e.get('t_s')} s with rc {e.get('rc')}")
    for e in r["chaos"]:
        if e.get("action") == "restart_failed":
            out.append(f"{e['node']} did not come back after a restart at {e['t_s']} s: {e['error']}")
    for node, rec in r["resources"].items():
        if rec.get("flat") is False:
            out.append(
                f"{node}: RSS {rec['rss_mb_per_min']:+.3f} MB/min, fds {rec['fds_per_min']:+.3f}/min "
                f"over {rec['slope_life_min']} min"
            )
    for node, fr in (r.get("flat") or {}).items():  # bench/soak/flat.py: the 10-minute-window rule
        if fr.get("flat") is False:
            out.append(
                f"{node} not flat over its last 30 min (pid {fr['pid']}, {fr['life_min']} min): RssAnon floor "
                f"per 10 min {fr['anon_floor_mb']} (+{fr['anon_growth_mb']} MB), fd maxima {fr['fds_max']} "
                f"({fr['fds_growth']:+d})"
            )
    why = not_done_reasons(r["hotload_records"], r["chaos"], engine_node)
    for k, n in why["unexplained_by"].most_common():
        out.append(f"replica {k}: not done in {n} hot-load(s), nothing reported why")
    if why[REASONS[7]]:
        out.append(f"{why[REASONS[7]]} replica row(s) said done for the target while another snapshot was served")
    for peer, n in ((r.get("penalties") or {}).get("honest_bad_bytes") or {}).items():
        out.append(f"honest peer {peer} penalised {n} time(s) for bad bytes")
    failed = r["verify"].get("failed_snapshots", [])
    if failed:
        reasons = Counter(_NUMS.sub("#", f["reason"])[:160] for f in failed)
        out.append(f"{len(failed)} snapshot failures on live daemons; reasons: {dict(reasons.most_common(4))}")
    lh = r.get("liar_bad_chunks_taken") or {}
    # A penalty cannot take back what is already in flight: up to max_per_peer (4) requests were
    # sent to the liar before its first bad answer came; more than that by one daemon for one
    # snapshot means queued requests still went to it after the penalty.
    if lh.get("max_per_snapshot", 0) > MAX_PER_PEER:
        worst = max(((n, i, k) for n, d in lh["by_node"].items() for i, k in d.items()), key=lambda x: x[2])
        out.append(
            f"{worst[0]} took {worst[2]} bad chunks from the liar for {worst[1]} ({lh['total']} in all): the "
            f"penalty does not redirect the requests queued for a lying peer (issue 12, item 8; up to "
            f"{MAX_PER_PEER} in flight when the first bad answer comes are expected)"
        )
    if r["end"]["not_alive"]:
        out.append(f"not alive at the end: {r['end']['not_alive']}")
    bad = {k: v for k, v in r["end"]["shutdown"].items() if v != "exit 0"}
    if bad:
        out.append(
            f"SIGTERM at the end did not give exit 0: {bad}; their logs after 'stopping': "
            f"{ {k: v[:4] for k, v in r.get('shutdown_logs', {}).items()} }"
        )
    return out


def text_summary(r: dict[str, Any]) -> str:
    """A few lines for a human: the numbers the issue asks for, and anything that went wrong."""
    h, v = r["hotloads"], r["verify"]
    why = not_done_reasons(r["hotload_records"], r["chaos"], r.get("engine_node", "node1"))
    lines = [
        f"soak: {r['config']['nodes']} daemons, {r['elapsed_min']:.1f} min, seed {r['config']['seed']}, "
        f"{len([e for e in r['chaos'] if e.get('fault')])} faults "
        f"({', '.join(f'{k} {n}' for k, n in sorted(r['faults_by_kind'].items()))})",
        f"hot-loads: {h['posted']} posted, {h['completed']} completed ({h['completed_after_faults']} after a fault), "
        f"outcomes {h['outcomes']}",
        "replicas not done before the next POST (or the end), why: "
        + "; ".join(f"{k} {why[k]}" for k in REASONS if why[k] or k == REASONS[-1]),
        f"POST -> all live replicas done: p50 {h['post_to_all_done_s']['p50']} s, p99 {h['post_to_all_done_s']['p99']} s; "
        f"-> all ready: p50 {h['post_to_all_ready_s']['p50']} s, p99 {h['post_to_all_ready_s']['p99']} s",
        f"wrong bytes handed out: {v['wrong_bytes_handed_out']} ({v['distinct_ready']} ready snapshots, "
        f"{v['snapshot_checks']} checks, {v['bytes_hashed'] / 1e9:.2f} GB hashed, {v['http_range_checks']} range reads, "
        f"{v['engine_checks']} engine digests)",
    ]
    for node, rec in sorted(r["resources"].items()):
        if "rss_mb_per_min" in rec:
            floor = (
                f" (per-minute floor {rec['rss_floor_mb_per_min']:+.3f}, heap floor "
                f"{rec.get('anon_floor_mb_per_min', 0):+.3f}, 2nd half {rec.get('anon_floor_mb_per_min_2nd_half', 0):+.3f}; "
                f"heap floor per 5 min {rec.get('anon_floor_mb_by_5min')})"
                if "rss_floor_mb_per_min" in rec
                else ""
            )
            lines.append(
                f"  {node}: RSS {rec['rss_mb_per_min']:+.3f} MB/min{floor}, fds {rec['fds_per_min']:+.3f}/min over "
                f"{rec['slope_life_min']} min ({ {True: 'flat', False: 'GROWING', None: 'too short to judge'}[rec.get('flat')] }); max RSS "
                f"{rec['rss_mb_max']} MB, max fds {rec['fds_max']}; log {r['logs'].get(node, {}).get('per_min')} lines/min"
            )
    envs = r["config"].get("node_env") or {}
    for node, m in sorted((r.get("memory_owners") or {}).items()):
        lines.append(
            f"  {node} {' '.join(f'{k}={v}' for k, v in sorted(envs.get(node, {}).items())) or '(default env)'}: "
            f"main heap {m['heap_mb_first']} -> {m['heap_mb_last']} MB ({m['heap_mb_per_min']:+.3f}/min), "
            f"thread arenas {m['arenas_mb_first']} -> {m['arenas_mb_last']} MB ({m['arenas_mb_per_min']:+.3f}/min, "
            f"{m['arena_heaps_last']} heaps), other anon {m['other_mb_first']} -> {m['other_mb_last']} MB "
            f"({m['other_mb_per_min']:+.3f}/min); {m['threads_last']} threads"
        )
    for node, fr in sorted((r.get("flat") or {}).items()):
        verdict = {True: "FLAT", False: "NOT FLAT", None: f"not judged ({fr.get('why')})"}[fr["flat"]]
        grow = (
            f"; growth over the last 30 min: RssAnon floor {fr['anon_growth_mb']:+.2f} MB, fd maxima "
            f"{fr['fds_growth']:+d}"
            if fr["flat"] is not None
            else ""
        )
        lines.append(
            f"  {node} rule (bench/soak/flat.py) {verdict}: pid {fr['pid']}, {fr['life_min']} min; RssAnon "
            f"floor per 10 min {fr['anon_floor_mb']} MB, fd maxima {fr['fds_max']}{grow}"
        )
    for node, sh in sorted((r.get("second_half") or {}).items()):
        a, f = sh["anon_mb"], sh["fds"]
        if a and f:
            lines.append(
                f"  {node} second half of its {sh['life_min']} min life ({a['over_min']} min): RssAnon floor "
                f"{a['first']} -> {a['last']} MB, slope {a['slope_per_min']:+.4f} ± {a['stderr_per_min']:.4f} "
                f"MB/min; fd maxima {f['first']:.0f} -> {f['last']:.0f}, slope {f['slope_per_min']:+.3f} ± "
                f"{f['stderr_per_min']:.3f} /min"
            )
    pen = r.get("penalties")
    if pen:
        lines.append(
            "penalties per peer (from the logs): "
            + ", ".join(
                f"{peer}{' (liar)' if peer in pen['liars'] else ''} {dict(sorted(k.items()))}"
                for peer, k in pen["by_peer"].items()
            )
            + f"; honest peers penalised for bad bytes: {pen['honest_bad_bytes'] or 'none'}"
        )
    lh = r.get("liar_bad_chunks_taken")
    if lh:
        lines.append(
            f"bad chunks taken from the liar: {lh['total']} (at most {lh['max_per_snapshot']} by one daemon "
            "for one snapshot)"
        )
    if r["unexpected_exits"]:
        lines.append(
            f"daemons that exited on their own: {[(e.get('node'), e.get('rc')) for e in r['unexpected_exits']]}"
        )
    lines.append(
        f"at the end: alive {r['end']['alive']}, not alive {r['end']['not_alive']}; shutdown {r['end']['shutdown']}"
    )
    exits = r["end"].get("exits") or {}
    if exits:
        lines.append(
            "SIGTERM -> exit: "
            + ", ".join(
                f"{n} {e['result']}" + (f" in {e['exit_s']} s" if e.get("exit_s") is not None else "")
                for n, e in sorted(exits.items())
            )
        )
    for f in r["findings"]:
        lines.append(f"FINDING: {f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.soak.report RESULT.json [--write]``: print the summary of a finished run,
    recomputing the log-derived sections from its workdir's logs when they are still there."""
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m bench.soak.report", description=main.__doc__.splitlines()[0])
    ap.add_argument("result", type=Path)
    ap.add_argument("--write", action="store_true", help="write the recomputed sections back into RESULT")
    a = ap.parse_args(argv)
    r = json.loads(a.result.read_text())
    work = Path(r["config"]["workdir"])
    logs = {f"node{i}": work / f"node{i}" / "bdnd.log" for i in range(r["config"]["nodes"])}
    if all(p.exists() for p in logs.values()):
        r["liar_bad_chunks_taken"] = liar_hits(logs)
        r["top_log_lines"] = top_log_lines(logs)
        r["penalties"] = penalties(logs)
    r["not_done_why"] = classify_not_done(r)
    c = r["config"]
    if r.get("samples"):  # slopes and floors with the current estimators
        r["resources"] = resources(r["samples"], c["warmup_s"], min(300.0, c["minutes"] * 60 / 3), c["minutes"])
    if r.get("maps"):
        r["memory_owners"] = memory_owners(r["maps"], c["warmup_s"])
    if r.get("samples"):
        r["flat"] = flat_rule.judge(r["samples"])
        r["second_half"] = second_half(r["samples"])
    r["findings"] = findings(r)
    print(text_summary(r))
    if a.write:
        a.result.write_text(json.dumps(r, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
