"""A memory probe inside one soak daemon: tracemalloc snapshots and glibc's ``mallinfo2`` over time.

The fleet starts a daemon as ``python -m bench.soak.tmprobe`` instead of ``-m bdn.daemon.main``
when its environment has ``SOAK_TRACEMALLOC=START_S,EVERY_S,FRAMES`` (``--node-env
nodeN:SOAK_TRACEMALLOC=1200,600,10``). A daemon thread then waits ``START_S`` seconds after
the process started (the warm-up is not traced: tracing every allocation from the start costs
CPU and doubles the heap), starts tracemalloc with
``FRAMES`` frames, and every ``EVERY_S`` seconds dumps a snapshot (``tracemalloc.Snapshot.dump``)
to ``SOAK_TRACEMALLOC_DIR`` as ``snap-<seconds since start>.tm``; every 60 s it appends one
JSON line to ``probe.jsonl`` there: ``{"t_s", "traced_kb", "traced_peak_kb", "mallinfo2": {...}}``
(glibc's mallinfo2(3) fields in KiB: ``arena`` non-mmapped bytes from the system, ``uordblks``
in use, ``fordblks`` free in the heaps, ``hblkhd`` mmapped blocks). Then it runs the daemon's
``__main__`` in this process (runpy), so signals and exit codes are the daemon's own.

Allocations made before tracemalloc started are not traced; a snapshot diff between two later
snapshots shows what was allocated after the start and is still held (what grows).
``python -m bench.soak.tmprobe diff OLD.tm NEW.tm [--top 25] [--json OUT]`` prints that diff
grouped by traceback, tracemalloc's and this probe's own frames filtered out.

tracemalloc, not an own allocator hook: the standard library's tracer is exact for every Python
allocation and adds nothing to install.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import runpy
import sys
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

ENV = "SOAK_TRACEMALLOC"
DIR_ENV = "SOAK_TRACEMALLOC_DIR"
_T0 = time.monotonic()


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def mallinfo2() -> dict[str, int] | None:
    """glibc's mallinfo2(3), sizes in KiB (counts as they are); None where libc has no mallinfo2."""
    try:
        f = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    f.restype = _Mallinfo2
    m = f()
    counts = ("ordblks", "smblks", "hblks")
    return {n: (getattr(m, n) if n in counts else getattr(m, n) >> 10) for n, _ in _Mallinfo2._fields_}


def parse_spec(spec: str) -> tuple[float, float, int]:
    """``"START_S,EVERY_S,FRAMES"`` -> ``(start_s, every_s, frames)``; ValueError naming the problem."""
    parts = spec.split(",")
    if len(parts) != 3:
        raise ValueError(f"{ENV} must be START_S,EVERY_S,FRAMES, got {spec!r}")
    start_s, every_s, frames = float(parts[0]), float(parts[1]), int(parts[2])
    if start_s < 0 or every_s <= 0 or not 1 <= frames <= 100:
        raise ValueError(f"{ENV} needs START_S >= 0, EVERY_S > 0, 1 <= FRAMES <= 100, got {spec!r}")
    return start_s, every_s, frames


def _probe(start_s: float, every_s: float, frames: int, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    started = False
    next_snap = start_s
    next_line = 0.0
    while True:
        t = time.monotonic() - _T0
        if not started and t >= start_s:
            tracemalloc.start(frames)
            started = True
        if t >= next_line:
            cur, peak = tracemalloc.get_traced_memory() if started else (0, 0)
            line = {"t_s": round(t, 1), "traced_kb": cur >> 10, "traced_peak_kb": peak >> 10, "mallinfo2": mallinfo2()}
            with open(out / "probe.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")
            next_line = t + 60.0
        if started and t >= next_snap:
            tracemalloc.take_snapshot().dump(str(out / f"snap-{int(t):05d}.tm"))
            next_snap += every_s
        time.sleep(max(0.5, min(next_line, next_snap) - (time.monotonic() - _T0)))


def diff(old: Path, new: Path, top: int = 25) -> dict[str, Any]:
    """What ``new`` holds beyond ``old``, grouped by traceback, largest growth first: totals in KiB
    and the ``top`` tracebacks as ``{"size_kb", "size_diff_kb", "count_diff", "frames": [...]}``."""
    keep = [
        tracemalloc.Filter(False, tracemalloc.__file__),
        tracemalloc.Filter(False, __file__),
        tracemalloc.Filter(False, "<frozen importlib._bootstrap*>"),
    ]
    a = tracemalloc.Snapshot.load(str(old)).filter_traces(keep)
    b = tracemalloc.Snapshot.load(str(new)).filter_traces(keep)
    stats = b.compare_to(a, "traceback")
    total_a = sum(s.size for s in a.statistics("filename"))
    total_b = sum(s.size for s in b.statistics("filename"))
    rows = [
        {
            "size_kb": round(s.size / 1024, 1),
            "size_diff_kb": round(s.size_diff / 1024, 1),
            "count_diff": s.count_diff,
            "frames": [f"{fr.filename}:{fr.lineno}" for fr in reversed(s.traceback)],
        }
        for s in stats[:top]
    ]  # allocation site first
    by_file = b.compare_to(a, "filename")
    return {
        "old": old.name,
        "new": new.name,
        "traced_kb_old": total_a >> 10,
        "traced_kb_new": total_b >> 10,
        "growth_kb": (total_b - total_a) >> 10,
        "by_file": [
            {"file": s.traceback[0].filename, "size_diff_kb": round(s.size_diff / 1024, 1), "count_diff": s.count_diff}
            for s in by_file[:top]
        ],
        "by_traceback": rows,
    }


def _diff_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.soak.tmprobe diff")
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    d = diff(a.old, a.new, a.top)
    print(f"{d['old']} -> {d['new']}: traced {d['traced_kb_old']} -> {d['traced_kb_new']} KiB ({d['growth_kb']:+d})")
    for r in d["by_traceback"]:
        print(
            f"{r['size_diff_kb']:+9.1f} KiB {r['count_diff']:+7d} blocks (now {r['size_kb']} KiB)  "
            + " <- ".join(r["frames"][:4])
        )
    if a.json:
        a.json.write_text(json.dumps(d, indent=1) + "\n")
    return 0


def main() -> None:
    if sys.argv[1:2] == ["diff"]:
        sys.exit(_diff_main(sys.argv[2:]))
    spec = os.environ.get(ENV)
    if spec:
        start_s, every_s, frames = parse_spec(spec)
        out = Path(os.environ.get(DIR_ENV) or ".")
        threading.Thread(target=_probe, args=(start_s, every_s, frames, out), name="tmprobe", daemon=True).start()
    sys.argv = ["bdnd", *sys.argv[1:]]
    runpy.run_module("bdn.daemon.main", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
