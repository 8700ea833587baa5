"""Repeated runs of one benchmark point: the raw values, their median and spread, and how to print them.

Every harness (bench/swarm, bench/delta, bench/handoff) takes ``--runs N`` (default 3), measures
each point N times and stores, per point, for each metric it repeats::

    "runs":   {"seconds": [81.2, 79.9, 80.8]},        # the raw values, in run order
    "median": {"seconds": 80.8},
    "min":    {"seconds": 79.9},
    "max":    {"seconds": 81.2}

beside the row's usual keys, which hold the median (so a reader of the old single-run files and of
the new ones uses the same keys). Rows written before ``--runs`` existed have none of the four
keys and count as one run (:func:`n_runs`); :func:`spread` prints ``median (min–max)`` and
:func:`runs_label` the caption that says how many runs a table stands for.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Iterable, Mapping
from typing import Any

DEFAULT_RUNS = 3


def add_runs_arg(ap: argparse.ArgumentParser, default: int = DEFAULT_RUNS) -> None:
    """``--runs N``: how many times each point is measured (at least 1)."""

    def positive(text: str) -> int:
        n = int(text)
        if n < 1:
            raise argparse.ArgumentTypeError(f"--runs must be >= 1, got {n}")
        return n

    ap.add_argument(
        "--runs",
        type=positive,
        default=default,
        help=f"measure each point this many times; rows keep runs, median, min, max (default {default})",
    )


def summarize(values: Mapping[str, Iterable[float | None]]) -> dict[str, dict[str, Any]]:
    """``{"runs", "median", "min", "max"}``, each a map metric -> value(s), for the raw ``values``.

    A metric whose runs are all None (the run failed) gets None as median, min and max; None runs
    among real ones are kept in ``runs`` and left out of the statistics.
    """
    out: dict[str, dict[str, Any]] = {"runs": {}, "median": {}, "min": {}, "max": {}}
    for metric, vals in values.items():
        raw = list(vals)
        real = [v for v in raw if v is not None]
        out["runs"][metric] = raw
        out["median"][metric] = statistics.median(real) if real else None
        out["min"][metric] = min(real) if real else None
        out["max"][metric] = max(real) if real else None
    return out


def median_index(values: list[float | None]) -> int:
    """The index of the run whose value is the (lower) median: the run a row's other fields come from."""
    real = sorted((v, i) for i, v in enumerate(values) if v is not None)
    if not real:
        return len(values) - 1
    return real[(len(real) - 1) // 2][1]


def collapse(rows: list[dict[str, Any]], metrics: tuple[str, ...], by: str) -> dict[str, Any]:
    """One row for a point measured ``len(rows)`` times.

    The fields come from the run whose ``by`` value is the median (so the per-node bytes, CPU and
    counters of one real run stay together), ``metrics`` are replaced by their medians, and
    ``runs``/``median``/``min``/``max`` are added for each of them.
    """
    if len(rows) == 1 and "runs" in rows[0]:
        return rows[0]
    pick = median_index([r.get(by) for r in rows])
    out = dict(rows[pick])
    out.pop("runs", None)
    stats = summarize({m: [r.get(m) for r in rows] for m in metrics})
    for m in metrics:
        if stats["median"][m] is not None:
            v = stats["median"][m]
            out[m] = round(v, 6) if isinstance(v, float) else v
    out.update(stats)
    out["median_run"] = pick
    return out


def n_runs(row: Mapping[str, Any], metric: str) -> int:
    """How many runs the row's ``metric`` stands for (1 for rows from before ``--runs``)."""
    runs = row.get("runs")
    if isinstance(runs, Mapping) and isinstance(runs.get(metric), list):
        return sum(v is not None for v in runs[metric]) or 1
    return 1


def spread(row: Mapping[str, Any], metric: str, nd: int = 2, scale: float = 1.0) -> str:
    """``median (min–max)`` of ``metric`` over the row's runs; the plain value for a single run;
    ``–`` when absent. ``scale`` multiplies every value (e.g. 1e-6 to print bytes as MB).

    Tables say how many runs their cells stand for with :func:`runs_label`.
    """
    med = row.get("median")
    if isinstance(med, Mapping) and med.get(metric) is not None and n_runs(row, metric) > 1:
        lo, hi = row["min"][metric], row["max"][metric]
        return f"{med[metric] * scale:.{nd}f} ({lo * scale:.{nd}f}–{hi * scale:.{nd}f})"
    v = row.get(metric)
    if v is None:
        return "–"
    return f"{v * scale:.{nd}f}"


def runs_label(rows: Iterable[Mapping[str, Any]], metric: str) -> str:
    """What a table's cells of ``metric`` are: "1 run", "median (min–max) of 3 runs", or a mix."""
    counts = sorted({n_runs(r, metric) for r in rows if r.get(metric) is not None})
    if not counts:
        return "no runs"
    if counts == [1]:
        return "1 run"
    if len(counts) == 1:
        return f"median (min–max) of {counts[0]} runs"
    return f"median (min–max) of {counts[0]}–{counts[-1]} runs; a cell without a range is 1 run"
