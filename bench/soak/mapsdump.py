"""Every anonymous mapping of running daemons, named, every few seconds (issue 31).

``python -m bench.soak.mapsdump --match /tmp/soak/work --every 30 --out maps.jsonl`` appends one
JSON line per matching process (``/proc/PID/cmdline`` contains ``--match``) and tick::

    {"t_s": float, "pid": int, "cmd": str, "rss_anon_kb": int, "threads": int,
     "kinds": {kind: {"n": int, "kb": int, "vm_kb": int}}}   # Anonymous: kB / size per kind

Kinds, from ``/proc/PID/smaps`` (proc(5)) and each thread's stack pointer
(``/proc/PID/task/TID/syscall``, its next-to-last field; "running" threads have none):

- ``heap``: glibc's main arena (``[heap]``);
- ``arena``: a glibc thread arena (a ``rw-p`` mapping inside a 64 MiB-aligned reservation,
  glibc malloc/arena.c ``new_heap``; bench/soak/maps.py);
- ``stack``: a thread stack in use: a ``rw-p`` mapping right after a ``---p`` guard page that
  holds a live thread's stack pointer, or of the stack size (``ulimit -s``) after a guard;
- ``stack_cached``: of a thread stack's shape, no live thread in it: glibc's cache of the stacks
  of exited threads (nptl ``stack_cache``, 40 MiB by default), reused by the next thread;
- ``pymalloc``: exactly 1 MiB (CPython's arenas, ``ARENA_SIZE`` since 3.10);
- ``exec``: anonymous executable pages (numba/llvm JIT code);
- ``other_small`` (< 1 MiB), ``other_mid`` (1-8 MiB) and ``other_big`` (larger): everything else
  (glibc's mmapped blocks over ``M_MMAP_THRESHOLD``, numpy/zstd buffers, mmapped frame buffers).

``python -m bench.soak.mapsdump --summary maps.jsonl`` prints, per process sampled for 10 minutes
or more, a row every ``--step`` seconds: RssAnon, threads, and each kind's mappings and MB. The
split by size is approximate: the kernel merges adjacent anonymous mappings of the same
permissions into one (several pymalloc arenas, or a 1 MiB buffer next to one, read as one
``other_mid``); thread stacks, split by their guard pages, and glibc's arenas are exact.
``--stacks`` adds ``"stacks": [[tid or null, anon_kb], ...]`` (each stack-shaped mapping, its
thread) to every line. The stdlib only: psutil's ``memory_maps()`` drops the
addresses and permissions this needs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import sys
import time
from pathlib import Path
from typing import Any

_HEAD = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S{4}) \S+ \S+ \d+\s*(.*)$")
HEAP_MAX = 64 << 20
MIB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")


def _stack_size() -> int:
    soft = resource.getrlimit(resource.RLIMIT_STACK)[0]
    return soft if soft not in (resource.RLIM_INFINITY, -1) and soft > 0 else 8 * MIB


def read_maps(pid: int) -> list[tuple[int, int, str, str, int]]:
    """``[(start, end, perms, path, anon_kb)]`` of ``/proc/PID/smaps``; [] when the process is gone."""
    out: list[tuple[int, int, str, str, int]] = []
    cur: list[Any] | None = None
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                m = _HEAD.match(line)
                if m:
                    if cur is not None:
                        out.append(tuple(cur))  # type: ignore[arg-type]
                    cur = [int(m.group(1), 16), int(m.group(2), 16), m.group(3), m.group(4).strip(), 0]
                elif cur is not None and line.startswith("Anonymous:"):
                    cur[4] = int(line.split()[1])
    except OSError:
        return []
    if cur is not None:
        out.append(tuple(cur))  # type: ignore[arg-type]
    return out


def thread_sps(pid: int) -> dict[int, int | None]:
    """``{tid: stack pointer or None}`` from ``/proc/PID/task/TID/syscall`` (None: running or unreadable)."""
    sps: dict[int, int | None] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return sps
    for t in tids:
        try:
            with open(f"/proc/{pid}/task/{t}/syscall") as f:
                parts = f.read().split()
            sps[int(t)] = int(parts[-2], 16) if len(parts) >= 3 else None
        except (OSError, ValueError):
            sps[int(t)] = None
    return sps


def classify(maps: list[tuple[int, int, str, str, int]], sps: dict[int, int | None], stack_size: int) -> dict[str, Any]:
    """``{"kinds": {kind: {"n", "kb", "vm_kb"}}, "stacks": [[tid, kb], ...]}`` (see the module docstring)."""
    kinds: dict[str, dict[str, int]] = {}
    stacks: list[list[Any]] = []
    live = [(sp, tid) for tid, sp in sps.items() if sp is not None]

    def add(kind: str, start: int, end: int, kb: int) -> None:
        k = kinds.setdefault(kind, {"n": 0, "kb": 0, "vm_kb": 0})
        k["n"] += 1
        k["kb"] += kb
        k["vm_kb"] += (end - start) >> 10

    for i, (start, end, perms, path, kb) in enumerate(maps):
        if path == "[heap]":
            add("heap", start, end, kb)
            continue
        if path or perms.startswith("---"):
            continue
        prev = maps[i - 1] if i else None
        nxt = maps[i + 1] if i + 1 < len(maps) else None
        size = end - start
        # glibc malloc/arena.c new_heap: a HEAP_MAX-aligned reservation, its used part rw-p, the rest ---p
        arena = perms == "rw-p" and (
            (size == HEAP_MAX and start % HEAP_MAX == 0)
            or (
                nxt is not None
                and nxt[0] == end
                and nxt[2] == "---p"
                and not nxt[3]
                and nxt[1] % HEAP_MAX == 0
                and nxt[1] - start <= HEAP_MAX
            )
        )
        guarded = (
            prev is not None
            and prev[1] == start
            and prev[2] == "---p"
            and not prev[3]
            and prev[1] - prev[0] <= 64 * PAGE
        )
        owner = [tid for sp, tid in live if start <= sp < end]
        if "x" in perms:
            add("exec", start, end, kb)
        elif guarded and (owner or size == stack_size):
            kind = "stack" if owner else "stack_cached"
            add(kind, start, end, kb)
            stacks.append([owner[0] if owner else None, kb])
        elif arena:
            add("arena", start, end, kb)
        elif size == MIB:
            add("pymalloc", start, end, kb)
        elif size < MIB:
            add("other_small", start, end, kb)
        elif size <= 8 * MIB:
            add("other_mid", start, end, kb)
        else:
            add("other_big", start, end, kb)
    return {"kinds": kinds, "stacks": stacks}


def rss_anon(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _ppid(pid: str) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def matching(match: str, parent: int | None = None) -> dict[int, str]:
    """``{pid: command line}`` of the processes whose command line holds ``match`` (and whose parent is ``parent``)."""
    out: dict[int, str] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if match in cmd and "mapsdump" not in cmd and (parent is None or _ppid(d) == parent):
            out[int(d)] = cmd
    return out


def one(pid: int, cmd: str, t0: float, stack_size: int) -> dict[str, Any]:
    sps = thread_sps(pid)
    c = classify(read_maps(pid), sps, stack_size)
    return {
        "t_s": round(time.monotonic() - t0, 1),
        "pid": pid,
        "cmd": cmd[-120:],
        "rss_anon_kb": rss_anon(pid),
        "threads": len(sps),
        **c,
    }


def summary(path: Path, step_s: float = 300.0, min_life_s: float = 600.0) -> None:
    """Per process that was sampled for ``min_life_s`` or more: a row every ``step_s`` seconds
    of its life with RssAnon, threads, and each kind's mappings and resident MB."""
    rows: dict[int, list[dict[str, Any]]] = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        rows.setdefault(r["pid"], []).append(r)
    for pid, rs in rows.items():
        if rs[-1]["t_s"] - rs[0]["t_s"] < min_life_s:
            continue
        kinds = sorted({k for r in rs for k in r["kinds"]})
        print(f"pid {pid}, sampled {rs[0]['t_s']:.0f}-{rs[-1]['t_s']:.0f} s; per kind: mappings/resident MB")
        print(f"  {'min':>5s} {'RssAnon':>8s} {'thr':>4s} " + " ".join(f"{k:>14s}" for k in kinds))
        next_t = rs[0]["t_s"]
        for r in rs:
            if r["t_s"] + 1e-6 < next_t and r is not rs[-1]:
                continue
            next_t = r["t_s"] + step_s
            cells = []
            for k in kinds:
                v = r["kinds"].get(k, {"n": 0, "kb": 0})
                cells.append(f"{v['n']:>5d}/{v['kb'] / 1024:>7.1f}  ")
            mins = (r["t_s"] - rs[0]["t_s"]) / 60
            print(f"  {mins:5.1f} {r['rss_anon_kb'] / 1024:8.1f} {r['threads']:4d} " + " ".join(cells))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak.mapsdump", description=__doc__.splitlines()[0])
    p.add_argument("--match", help="a string of the processes' command lines")
    p.add_argument("--parent", type=int, help="only children of this pid (the soak harness)")
    p.add_argument("--every", type=float, default=30.0, help="seconds between samples (default %(default)s)")
    p.add_argument("--minutes", type=float, default=0.0, help="stop after this long (default 0: until killed)")
    p.add_argument("--stacks", action="store_true", help="also list each thread stack and its thread")
    p.add_argument("--out", type=Path, help="JSON lines to append to")
    p.add_argument("--summary", type=Path, help="print a summary of a finished file instead")
    p.add_argument("--step", type=float, default=300.0, help="summary: seconds between rows (default %(default)s)")
    a = p.parse_args(argv)
    if a.summary:
        summary(a.summary, a.step)
        return 0
    if not a.match or not a.out:
        p.error("need --match and --out (or --summary)")
    t0 = time.monotonic()
    stack_size = _stack_size()
    with a.out.open("a") as out:
        while not a.minutes or time.monotonic() - t0 < a.minutes * 60:
            for pid, cmd in matching(a.match, a.parent).items():
                r = one(pid, cmd, t0, stack_size)
                if not a.stacks:
                    del r["stacks"]
                if r["threads"]:
                    out.write(json.dumps(r) + "\n")
            out.flush()
            time.sleep(a.every)
    return 0


if __name__ == "__main__":
    sys.exit(main())
