"""Resource samples of every daemon: RSS, open fds, CPU seconds and log lines, every few seconds.

Read from ``/proc/<pid>/status`` (``VmRSS``, kB), ``/proc/<pid>/fd`` (entries), ``/proc/<pid>/stat``
(utime + stime, clock ticks) and the daemon's log file (lines so far, counted incrementally). One
sample: ``[t_s, node, pid, rss_kb, fds, cpu_s, log_lines, anon_kb]`` (``RssAnon``: the heap, without
file pages mapped); ``log_lines`` counts the whole file,
across the daemon's lives. Each tick also calls :meth:`Fleet.reap` so that a daemon that exits
on its own is seen within one interval. Every ``maps_s`` seconds (60) the anonymous memory is also
split by owner (bench/soak/maps.py): one ``maps`` row ``[t_s, node, pid, heap_kb, arenas_kb,
arena_heaps, other_kb, threads]`` (glibc main heap, glibc thread arenas, everything else).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from bench.soak.fleet import Fleet
from bench.soak.maps import read_smaps

CLK = os.sysconf("SC_CLK_TCK")


def proc_sample(pid: int) -> tuple[int, int, float, int] | None:
    """``(rss_kb, open_fds, cpu_s, anon_kb)`` of a live process, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            status = {k: v for k, _, v in (line.partition(":") for line in f)}
        rss = int(status["VmRSS"].split()[0])
        anon = int(status.get("RssAnon", "0 kB").split()[0])
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / CLK
    except (OSError, ValueError, KeyError, IndexError):
        return None
    return rss, fds, cpu, anon


def threads(pid: int) -> int:
    """``Threads:`` of ``/proc/<pid>/status``; 0 when the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Threads:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


class LogCounter:
    """Lines of a growing file, counted from where the last call stopped."""

    def __init__(self, path: Any) -> None:
        self.path, self.offset, self.lines = path, 0, 0

    def count(self) -> int:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                while chunk := f.read(1 << 20):
                    self.lines += chunk.count(b"\n")
                    self.offset += len(chunk)
        except OSError:
            pass
        return self.lines


class Sampler:
    def __init__(self, fleet: Fleet, clock: Any, interval_s: float = 5.0, maps_s: float = 60.0) -> None:
        self.fleet, self.clock, self.interval_s, self.maps_s = fleet, clock, interval_s, maps_s
        self.samples: list[list[Any]] = []
        self.maps: list[list[Any]] = []
        self._maps_t = -maps_s
        self.logs = {nid: LogCounter(n.daemon.log_path) for nid, n in fleet.nodes.items()}
        self.reaped: list[tuple[float, str]] = []

    def one(self) -> None:
        for t, nid in ((self.clock(), n) for n in self.fleet.reap()):
            self.reaped.append((round(t, 1), nid))
        t = round(self.clock(), 1)
        with_maps = t - self._maps_t >= self.maps_s
        if with_maps:
            self._maps_t = t
        for nid, node in self.fleet.nodes.items():
            p = node.daemon.proc
            if p is None or p.poll() is not None:
                continue
            s = proc_sample(p.pid)
            if s is not None:
                self.samples.append([t, nid, p.pid, s[0], s[1], round(s[2], 2), self.logs[nid].count(), s[3]])
            m = read_smaps(p.pid) if with_maps else None
            if m is not None:
                self.maps.append(
                    [t, nid, p.pid, m["heap_kb"], m["arenas_kb"], m["arena_heaps"], m["other_kb"], threads(p.pid)]
                )

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            self.one()
            stop.wait(max(0.2, self.interval_s - (time.monotonic() - t0)))
