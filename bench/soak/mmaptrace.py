"""Which code made the anonymous mappings a process still holds (issue 31).

Record a daemon's mapping calls with their C call chains, then read the record against the
process's live ``/proc/PID/smaps``::

    strace -f -k -tt -e trace=mmap,munmap,mremap -p PID -o trace.txt   # root or same uid; Ctrl-C ends it
    python -m bench.soak.mmaptrace trace.txt PID [--frames 6]

The record is replayed (``mmap`` adds a range, ``munmap`` removes any part of one, ``mremap``
moves or resizes one); the ranges still mapped at the end and still present in smaps are grouped by
their call chain (the first ``--frames`` frames below libc, from strace's ``-k`` lines) and printed
with their count, size and resident anonymous kB (``Anonymous:``), largest first. Mappings made
before strace attached are not in the record: attach early, or compare two moments. strace(1)
``-k`` needs strace built with unwinding (Debian's is).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

_CALL = re.compile(r"^(\d+)\s+\S+\s+(mmap|munmap|mremap)\((.*)$")
_RESUMED = re.compile(r"^(\d+)\s+\S+\s+<\.\.\. (mmap|munmap|mremap) resumed>(.*)$")
_RET = re.compile(r"\)\s*=\s*(0x[0-9a-f]+|-?\d+)")
_FRAME = re.compile(r"^ > (\S+)\((\S*?)\+0x[0-9a-f]+\)")


def _frames(lines: list[str], depth: int) -> str:
    out = []
    for line in lines:
        m = _FRAME.match(line)
        if not m:
            continue
        lib, fn = m.group(1).rsplit("/", 1)[-1], m.group(2)
        if lib.startswith("libc.so") and fn in ("mmap64", "__mmap", "__munmap", "mremap", "__mremap"):
            continue
        out.append(f"{fn or '?'}@{lib.split('.')[0]}")
        if len(out) >= depth:
            break
    return " < ".join(out) or "?"


def replay(text: str, depth: int) -> dict[int, tuple[int, str]]:
    """``{start: (length, call chain)}`` of the anonymous ranges the record leaves mapped."""
    live: dict[int, tuple[int, str]] = {}
    pending: dict[str, tuple[str, str]] = {}  # tid -> (call, args so far) of an unfinished call
    events: list[tuple[str, str, list[str]]] = []  # (call, full args + result, frames)
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        frames: list[str] = []
        j = i + 1
        while j < len(lines) and lines[j].startswith(" > "):
            frames.append(lines[j])
            j += 1
        m = _CALL.match(line)
        if m:
            tid, call, rest = m.groups()
            if rest.endswith("<unfinished ...>"):
                pending[tid] = (call, rest[: -len("<unfinished ...>")])
            else:
                events.append((call, rest, frames))
        else:
            r = _RESUMED.match(line)
            if r and r.group(1) in pending:
                call, head = pending.pop(r.group(1))
                events.append((call, head + r.group(3), frames))
        i = j
    for call, args, frames in events:
        ret = _RET.search(args)
        if not ret or ret.group(1).startswith("-"):
            continue
        parts = [p.strip() for p in args.split(")")[0].split(",")]
        if call == "mmap":
            if "MAP_ANONYMOUS" not in args:
                continue
            start, length = int(ret.group(1), 16), int(parts[1], 0)
            _unmap(live, start, length)
            live[start] = (length, _frames(frames, depth))
        elif call == "munmap":
            _unmap(live, int(parts[0], 16), int(parts[1], 0))
        elif call == "mremap":
            old, old_len, new_len = int(parts[0], 16), int(parts[1], 0), int(parts[2], 0)
            new = int(ret.group(1), 16)
            chain = next((c for s, (n, c) in live.items() if s <= old < s + n), _frames(frames, depth))
            _unmap(live, old, old_len)
            live[new] = (new_len, chain)
    return live


def _unmap(live: dict[int, tuple[int, str]], start: int, length: int) -> None:
    end = start + length
    for s, (n, chain) in list(live.items()):
        e = s + n
        if e <= start or s >= end:
            continue
        del live[s]
        if s < start:
            live[s] = (start - s, chain)
        if e > end:
            live[end] = (e - end, chain)


def resident(pid: int) -> list[tuple[int, int, int]]:
    """``[(start, end, anon_kb)]`` of the process's anonymous mappings now."""
    out: list[tuple[int, int, int]] = []
    head = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) \S{4} \S+ \S+ \d+\s*(.*)$")
    cur: list[int] | None = None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            m = head.match(line)
            if m:
                cur = [int(m.group(1), 16), int(m.group(2), 16), 0] if not m.group(3).strip() else None
                if cur is not None:
                    out.append(cur)  # type: ignore[arg-type]
            elif cur is not None and line.startswith("Anonymous:"):
                cur[2] = int(line.split()[1])
    return [tuple(x) for x in out]  # type: ignore[misc]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak.mmaptrace", description=__doc__.splitlines()[0])
    p.add_argument("trace", type=Path, help="strace -f -k output")
    p.add_argument("pid", type=int, help="the traced process, still running")
    p.add_argument("--frames", type=int, default=6, help="call-chain frames per group (default %(default)s)")
    a = p.parse_args(argv)
    live = replay(a.trace.read_text(errors="replace"), a.frames)
    vmas = resident(a.pid)
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for s, (n, chain) in live.items():
        kb = 0
        for vs, ve, akb in vmas:
            lo, hi = max(s, vs), min(s + n, ve)
            if lo < hi and ve > vs:
                kb += akb * (hi - lo) // (ve - vs)  # a VMA merged from several mappings: pro rata
        g = groups[chain]
        g[0] += 1
        g[1] += n >> 10
        g[2] += kb
    total = sum(g[2] for g in groups.values())
    print(f"{len(live)} anonymous ranges made during the record still mapped, ~{total / 1024:.1f} MB resident")
    for chain, (n, vkb, kb) in sorted(groups.items(), key=lambda x: -x[1][2]):
        print(f"{kb / 1024:8.2f} MB resident {vkb / 1024:8.1f} MB mapped {n:4d} ranges  {chain}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
