"""A download's timeline from bdnd's per-chunk event logs (config key ``chunk_log``).

    .venv/bin/python -m bench.swarm.timeline NODE.jsonl [NODE.jsonl ...] [--png out.png]

Per log (one node): when its first chunk started and its last ended, bytes by source (bucket as
owner / as fallback, each peer, local copies), busy answers and retries, the tail (the chunks
that ended last and what held them up) and, with ``--png``, one horizontal bar per chunk coloured
by source (matplotlib, if installed). Run bench/swarm with ``--bdn-env BDN_CHUNK_LOG=/tmp/…`` per
node to get the logs.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path


def load(path: Path) -> list[dict]:
    """The lines of one chunk log (malformed lines are skipped and counted)."""
    out, bad = [], 0
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(rec, dict) and {"start", "end", "bytes", "source"} <= rec.keys():
            out.append(rec)
        else:
            bad += 1
    if bad:
        print(f"{path}: {bad} malformed lines skipped")
    return out


def summary(name: str, recs: list[dict], tail: int = 5) -> str:
    if not recs:
        return f"{name}: no chunks"
    t0 = min(r["start"] for r in recs)
    t1 = max(r["end"] for r in recs)
    by_src: Counter[str] = Counter()
    for r in recs:
        by_src[r["source"]] += r["bytes"]
    busy, retries = sum(r.get("busy", 0) for r in recs), sum(r.get("retries", 0) for r in recs)
    lines = [
        f"{name}: {len(recs)} chunks, {sum(by_src.values()) / 1e6:.1f} MB in {t1 - t0:.2f} s; "
        f"busy answers {busy}, retries {retries}"
    ]
    for src, n in by_src.most_common():
        lines.append(f"  {src:24s} {n / 1e6:9.1f} MB")
    lines.append("  tail (last to end):")
    for r in sorted(recs, key=lambda r: r["end"])[-tail:]:
        lines.append(
            f"    {r.get('file', '?')}#{r.get('index', '?')} from {r['source']} at +{r['start'] - t0:.2f}"
            f"..+{r['end'] - t0:.2f} s, busy {r.get('busy', 0)}, retries {r.get('retries', 0)}"
        )
    return "\n".join(lines)


def fleet(logs: dict[str, list[dict]]) -> str:
    """The fleet's view of one download: when each chunk first existed in the fleet (its owner's
    bucket read ended), how long after that the other nodes had it (the spread lag), and how the
    bucket phase and the nodes' finishing times relate (a swarm phase that trails the bucket)."""
    recs = [r for rs in logs.values() for r in rs]
    if not recs:
        return "fleet: no chunks"
    t0 = min(r["start"] for r in recs)
    key = lambda r: (r.get("file"), r.get("index"))  # noqa: E731
    first: dict = {}
    for r in recs:
        if r["source"].startswith("bucket"):
            first[key(r)] = min(first.get(key(r), r["end"]), r["end"])
    lags = sorted(r["end"] - first[key(r)] for r in recs if not r["source"].startswith("bucket") and key(r) in first)
    ends = sorted(max(r["end"] for r in rs) - t0 for rs in logs.values() if rs)
    bucket_ends = sorted(v - t0 for v in first.values())
    q = lambda xs, f: xs[min(len(xs) - 1, int(f * len(xs)))] if xs else float("nan")  # noqa: E731
    lines = [
        f"fleet: {len(first)} chunks read from the bucket; first ready +{q(bucket_ends, 0):.2f} s, "
        f"half +{q(bucket_ends, 0.5):.2f} s, last +{q(bucket_ends, 1):.2f} s",
        f"  nodes done: +{ends[0]:.2f} .. +{ends[-1]:.2f} s",
        f"  peer copies: {len(lags)}, lag after the bucket read ended: median {q(lags, 0.5):.2f} s, "
        f"p90 {q(lags, 0.9):.2f} s, max {q(lags, 1):.2f} s",
        f"  busy answers {sum(r.get('busy', 0) for r in recs)}, retries {sum(r.get('retries', 0) for r in recs)}",
    ]
    dur = sorted(r["end"] - r["start"] for r in recs if r["source"].startswith("bucket"))
    if dur:
        lines.append(f"  bucket reads: median {q(dur, 0.5):.2f} s, max {q(dur, 1):.2f} s per chunk")
    return "\n".join(lines)


def plot(logs: dict[str, list[dict]], out: Path) -> None:
    import matplotlib  # optional, only for --png

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min(r["start"] for recs in logs.values() for r in recs)
    fig, axes = plt.subplots(len(logs), 1, figsize=(10, 2 + 1.5 * len(logs)), squeeze=False)
    for ax, (name, recs) in zip(axes[:, 0], logs.items(), strict=True):
        srcs = sorted({r["source"] for r in recs})
        colour = {s: f"C{i % 10}" for i, s in enumerate(srcs)}
        for i, r in enumerate(sorted(recs, key=lambda r: r["start"])):
            ax.barh(i, r["end"] - r["start"], left=r["start"] - t0, color=colour[r["source"]], height=1.0)
        ax.set_title(name, fontsize=9)
        ax.set_yticks([])
        ax.legend(
            handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in colour.values()],
            labels=list(colour),
            fontsize=7,
            loc="lower right",
        )
    axes[-1, 0].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logs", nargs="+", type=Path)
    ap.add_argument("--png", type=Path)
    ap.add_argument("--tail", type=int, default=5)
    a = ap.parse_args(argv)
    stems = [p.stem for p in a.logs]
    names = [p.stem if stems.count(p.stem) == 1 else f"{p.parent.name}/{p.stem}" for p in a.logs]
    if len(set(names)) < len(names):
        names = [str(p) for p in a.logs]
    logs = {n: load(p) for n, p in zip(names, a.logs, strict=True)}
    for name, recs in logs.items():
        print(summary(name, recs, a.tail))
    if len(logs) > 1:
        print(fleet(logs))
    if a.png:
        plot(logs, a.png)
        print(f"wrote {a.png}")


if __name__ == "__main__":
    main()
