"""What a fixed glibc mmap threshold (``MALLOC_MMAP_THRESHOLD_``) costs bdnd's large allocations.

In the soak's A/B runs (issue 12, one soak with per-daemon environments) ``MALLOC_MMAP_THRESHOLD_=131072``
lowered the level bdnd's memory settles at by 5-10 MB: every block of 128 KiB or more is then
its own mmap, given back at free, instead of glibc raising the threshold after the first such
free (mallopt(3), "M_MMAP_THRESHOLD": dynamic up to 32 MiB) and serving later ones from its
heaps, where they fragment. The price is a fresh mapping, zeroed by page faults, for each such
block; this measures it on the two of bdnd's paths that allocate large blocks per use:

- ``apply``: a delta applied the way bdnd does (``bench.delta.apply_speed.apply_once``: MiniLM
  bf16, 2 % of the values changed, ``arc_v2``, one worker); numpy and zstd scratch per tensor;
- ``pread``: one chunk read into a new ``bytes`` (``bdn.daemon.store.diskio.pread``, the HTTP serving
  path), 16 MiB chunks (the publisher's default) from a /dev/shm file.

Each variant runs in its own interpreter (the variable is read by glibc at start-up), rounds
alternate between them; per round: process CPU seconds per operation and minor page faults per
operation (``getrusage``), which do not depend on the machine's load the way wall time does.

    nice -n 19 .venv/bin/python -m bench.soak.malloc_cost --runs 3 --out bench/results/malloc_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import runs

VARIANTS = {
    "glibc default (dynamic threshold)": {},
    "MALLOC_MMAP_THRESHOLD_=131072": {"MALLOC_MMAP_THRESHOLD_": "131072"},
}
CHUNK = 16 << 20


def _usage() -> tuple[float, int]:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime, ru.ru_minflt


def child(reps: int) -> dict[str, float]:
    """In the variant's interpreter: per-operation CPU s and minor faults of both paths."""
    import numpy as np

    from bdn import fileops
    from bdn.daemon.store import diskio
    from bench.delta import apply_speed, inputs

    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="bdn-malloc-cost-") as tmp:
        work = Path(tmp)
        base = inputs.minilm_bf16()
        pair = inputs.write_pair(work, "minilm", base, inputs.demo_step(base, 0.02, np.random.default_rng(2026)), 0.02)
        diff = work / "minilm.arc_v2.diff"
        fileops.write_diff_file(pair.base, pair.target, diff, "arc_v2", workers=1)
        target = apply_speed.SHM / f"bdn-malloc-cost-{os.getpid()}"
        try:
            apply_speed.apply_once(pair.base, diff, target, "arc_v2", 1)  # warm-up: imports, first mappings
            c0, f0 = _usage()
            for _ in range(reps):
                apply_speed.apply_once(pair.base, diff, target, "arc_v2", 1)
            c1, f1 = _usage()
            assert target.read_bytes() == pair.target.read_bytes()
            out["apply_cpu_ms"], out["apply_minflt"] = (c1 - c0) / reps * 1e3, (f1 - f0) / reps
            with open(target, "wb") as f:
                f.write(os.urandom(CHUNK) * 4)
            fd = os.open(target, os.O_RDONLY)
            try:
                n = reps * 16
                diskio.pread(fd, CHUNK, 0)
                c0, f0 = _usage()
                for i in range(n):
                    data = diskio.pread(fd, CHUNK, (i % 4) * CHUNK)
                    del data
                c1, f1 = _usage()
                out["pread_cpu_ms"], out["pread_minflt"] = (c1 - c0) / n * 1e3, (f1 - f0) / n
            finally:
                os.close(fd)
        finally:
            target.unlink(missing_ok=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.soak.malloc_cost", description=__doc__.splitlines()[0])
    runs.add_runs_arg(ap)
    ap.add_argument("--reps", type=int, default=8, help="operations per round (default %(default)s)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/malloc_cost.json"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.reps)))
        return 0
    got: dict[str, list[dict[str, float]]] = {k: [] for k in VARIANTS}
    for _ in range(a.runs):
        for name, env in VARIANTS.items():
            e = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
            p = subprocess.run(
                [sys.executable, "-m", "bench.soak.malloc_cost", "--child", "--reps", str(a.reps)],
                env={**e, **env},
                capture_output=True,
                text=True,
                check=True,
            )
            got[name].append(json.loads(p.stdout.strip().splitlines()[-1]))
    rows = []
    for name, rs in got.items():
        st = runs.summarize({k: [r[k] for r in rs] for k in rs[0]})
        rows.append({"variant": name, **st["median"], **st})
        print(
            f"{name:36s} apply {runs.spread(rows[-1], 'apply_cpu_ms', 1)} ms CPU, "
            f"{runs.spread(rows[-1], 'apply_minflt', 0)} faults; pread 16 MiB "
            f"{runs.spread(rows[-1], 'pread_cpu_ms', 2)} ms CPU, {runs.spread(rows[-1], 'pread_minflt', 0)} faults"
        )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(
        json.dumps({"bench": "malloc_cost", "reps": a.reps, "load_avg": os.getloadavg(), "rows": rows}, indent=1) + "\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
