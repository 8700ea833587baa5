"""Which C call sites allocate large blocks in a running process: ``perf`` uprobes on glibc's
``malloc``, ``calloc`` and ``realloc`` filtered to blocks of at least ``--min`` bytes (128 KiB:
glibc's initial mmap threshold), with DWARF call chains, grouped by the first frames that are not
the allocator's.

Large short-lived blocks are what fragments glibc's heaps once its dynamic mmap threshold has risen
above them (mallopt(3)); in issue 12's soak they were msgpack's 256 KiB ``Packer`` buffer, one per
``packb`` call, and a 1 MiB read buffer per ``config.json``. Needs root (uprobes) and
``perf``; the probes are added if missing and left in place (``perf probe -d 'probe_libc:*'``).

    python -m bench.soak.bigalloc PID [--seconds 240] [--min 131072] [--out perf.data]
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys

LIBC = "/lib/x86_64-linux-gnu/libc.so.6"
PROBES = {
    "malloc": "malloc size=%di:u64",
    "calloc": "calloc nmemb=%di:u64 size=%si:u64",
    "realloc": "realloc ptr=%di:u64 size=%si:u64",
}
_ALLOC = re.compile(r"malloc|Malloc|calloc|Calloc|realloc|Realloc|PyMem_|inlined")


def ensure_probes() -> None:
    """Add the three libc uprobes unless ``perf probe -l`` lists them."""
    have = subprocess.run(["perf", "probe", "-l"], capture_output=True, text=True).stdout
    for name, spec in PROBES.items():
        if f"probe_libc:{name} " not in have:
            subprocess.run(["perf", "probe", "-x", LIBC, spec], check=True, capture_output=True)


def record(pid: int, seconds: float, min_bytes: int, out: str) -> None:
    """``perf record`` of every thread of ``pid`` for ``seconds``, large allocations only."""
    big = f"size >= {min_bytes}"
    cmd = [
        "timeout",
        str(seconds),
        "perf",
        "record",
        "-o",
        out,
        "-e",
        "probe_libc:malloc",
        "--filter",
        big,
        "-e",
        "probe_libc:calloc",
        "--filter",
        f"{big} || nmemb >= {min_bytes}",
        "-e",
        "probe_libc:realloc",
        "--filter",
        big,
        "--call-graph",
        "dwarf,32768",
        "-p",
        str(pid),
    ]
    subprocess.run(cmd, capture_output=True)


def sites(data: str, frames: int = 4) -> collections.Counter[tuple[str, str]]:
    """(size, call site) -> count, the call site being the first ``frames`` frames that are not
    the allocator's."""
    text = subprocess.run(["perf", "script", "-i", data], capture_output=True, text=True).stdout
    out: collections.Counter[tuple[str, str]] = collections.Counter()
    for block in text.split("\n\n"):
        lines = [ln for ln in block.strip().splitlines() if ln.strip()]
        if not lines:
            continue
        m = re.search(r"size=(\d+)", lines[0])
        size = m.group(1) if m else "?"
        names = []
        for ln in lines[1:]:
            parts = ln.split(None, 1)
            name = re.sub(r"\+0x.*", "", parts[1] if len(parts) > 1 else ln)
            if not _ALLOC.search(name):
                names.append(name)
            if len(names) == frames:
                break
        out[(size, " < ".join(names))] += 1
    return out


def main(argv: list[str] | None = None) -> int:
    """Record ``pid`` and print the call sites, most frequent first."""
    ap = argparse.ArgumentParser(prog="python -m bench.soak.bigalloc", description=__doc__.split("\n\n")[0])
    ap.add_argument("pid", type=int)
    ap.add_argument("--seconds", type=float, default=240.0)
    ap.add_argument("--min", type=int, default=128 << 10, help="smallest block counted, bytes")
    ap.add_argument("--out", default="bigalloc.perf.data")
    a = ap.parse_args(argv)
    ensure_probes()
    record(a.pid, a.seconds, a.min, a.out)
    found = sites(a.out)
    print(f"pid {a.pid}, {a.seconds:g} s: {sum(found.values())} allocations of >= {a.min} bytes")
    for (size, where), n in found.most_common(20):
        print(f"{n:7d}  {size:>9} B  {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
