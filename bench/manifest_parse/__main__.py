"""How long does parsing a 10^6-chunk manifest stall the daemon's event loop?

A daemon parses manifests on a worker thread; what its event loop feels is how long the parse
holds the GIL at a stretch. This measures that directly: a probe thread sleeps 1 ms in a loop and
records its worst lateness (wall, and the process CPU time between two of its wake-ups: the GIL
hold an idle core would see) while the main thread parses the manifest, for

- ``json`` (the baseline, the code before): ``Manifest.from_dict(json.loads(data))``;
- ``windowed`` (the code now): ``Manifest.from_json(data)`` (msgspec, chunk lists in windows).

Each is run ``--runs`` times alternately; the JSON has every run, the medians and the spread.

    .venv/bin/python -m bench.manifest_parse --chunks 1000000 --runs 5 --out bench/results/manifest_parse.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from pathlib import Path

from bdn.proto.manifest import Manifest


def make_manifest(n: int) -> bytes:
    """A full snapshot of ``n`` 4 KiB chunks in one file, written as the publisher writes."""
    files = [{"path": "shard-00000.bin", "size": n * 4096, "chunks": [f"{c:032x}" for c in range(n)]}]
    m = {
        "format": "bdn.snapshot/1",
        "identity": "step000001",
        "kind": "full",
        "policy_version": 1,
        "created_at": "2026-12-01T00:00:00Z",
        "chunk_size": 4096,
        "files": files,
    }
    return (json.dumps(m, indent=1, sort_keys=True) + "\n").encode()


def probe_while(fn) -> tuple[float, float, float]:  # type: ignore[no-untyped-def]
    """(seconds ``fn`` took, worst wall lateness of a 1 ms sleep loop on another thread, worst
    process CPU time spent between two of its wake-ups).

    The CPU figure is the GIL hold as an idle core would see it: on a shared, loaded machine the
    wall lateness also counts the time the process waited for a CPU at all, while the process's
    CPU time between two wake-ups of the probe is what the parse did while holding the GIL."""
    stop = threading.Event()
    worst = [0.0, 0.0]

    def probe() -> None:
        while not stop.is_set():
            t, c = time.perf_counter(), time.process_time()
            time.sleep(0.001)
            worst[0] = max(worst[0], time.perf_counter() - t - 0.001)
            worst[1] = max(worst[1], time.process_time() - c)

    th = threading.Thread(target=probe)
    th.start()
    time.sleep(0.05)
    t0 = time.perf_counter()
    fn()
    took = time.perf_counter() - t0
    stop.set()
    th.join()
    return took, worst[0], worst[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, default=1_000_000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("bench/results/manifest_parse.json"))
    a = ap.parse_args()
    loadavg = os.getloadavg()
    data = make_manifest(a.chunks)
    ways = {"json": lambda: Manifest.from_dict(json.loads(data)), "windowed": lambda: Manifest.from_json(data)}
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in ways}
    for _ in range(a.runs):
        for name, fn in ways.items():
            took, stall, cpu = probe_while(fn)
            runs[name].append(
                {"parse_s": round(took, 4), "max_stall_s": round(stall, 4), "max_stall_cpu_s": round(cpu, 4)}
            )
            print(
                f"{name:9s} parse {took:.3f} s, longest stall {stall * 1000:.0f} ms wall, {cpu * 1000:.0f} ms of CPU",
                flush=True,
            )
    summary = {}
    for name, rs in runs.items():
        st = [r["max_stall_s"] for r in rs]
        sc = [r["max_stall_cpu_s"] for r in rs]
        pt = [r["parse_s"] for r in rs]
        summary[name] = {
            "max_stall_s_median": statistics.median(st),
            "max_stall_s_min": min(st),
            "max_stall_s_max": max(st),
            "max_stall_cpu_s_median": statistics.median(sc),
            "max_stall_cpu_s_min": min(sc),
            "max_stall_cpu_s_max": max(sc),
            "parse_s_median": statistics.median(pt),
            "parse_s_min": min(pt),
            "parse_s_max": max(pt),
        }
    out = {
        "bench": "manifest_parse",
        "chunks": a.chunks,
        "manifest_bytes": len(data),
        "runs": runs,
        "summary": summary,
        "loadavg_start": loadavg,
        "loadavg_end": os.getloadavg(),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
