"""An opt-in memory probe inside bdnd: what grows, written down every few minutes (issue 31).

Off unless the config key ``memory_probe_dir`` (env ``BDN_MEMORY_PROBE_DIR``) names a directory.
Then bdnd starts ``tracemalloc`` (8 frames; not with ``memory_probe_trace = false``) and every
``memory_probe_every_s`` seconds appends one JSON line to ``<dir>/memprobe.jsonl``::

    {"t_s": float,                 # seconds since the probe started
     "rss_anon_kb": int,           # /proc/self/status RssAnon (proc(5))
     "anon_maps": {kind: {"n": int, "kb": int}},   # anonymous memory by mapping kind (below)
     "traced_kb": int, "traced_peak_kb": int,      # tracemalloc: Python allocations since the start
     "pymalloc": {"arenas": int, "arenas_highwater": int, "allocated_kb": int, "available_kb": int},  # untraced only
     "census": {name: int},        # sizes of the daemon's long-lived structures (App.census)
     "grew": [{"where": "bdn/x.py:12", "kb": float, "blocks": int, "now_kb": float}, ...]}

``grew`` is the ``memory_probe_top`` largest growths against the previous line's snapshot,
grouped by the innermost frame in bdn (an allocation made by a library on bdn's behalf is
charged to the bdn line that called it; ``lib:`` when no bdn frame is in the traceback).
``anon_maps`` splits RssAnon by mapping, from /proc/self/smaps: ``heap`` (glibc's main arena),
``1MiB`` (pymalloc's arenas and 1 MiB buffers), ``stack_or_arena`` (mappings of 8 MiB and more:
thread stacks, glibc thread arenas) and ``other``. A structure whose census keeps rising with the
number of hot-loads is a leak; Python allocations flat while RssAnon rises point at the
allocator (glibc's and pymalloc's free pages; docs/decisions/0025-flat-rss.md). ``pymalloc`` is CPython's small-object
allocator as ``sys._debugmallocstats()`` reports it: its 1 MiB arenas in use (each an anonymous
mapping, counted in RssAnon, returned only when every object in it is freed), the bytes of live
blocks in them and of free blocks in their used pools; ``arenas`` x 1 MiB well above
``allocated_kb`` is fragmentation, not live data. CPython reports them only while its allocator
is not wrapped by tracemalloc, so only with ``memory_probe_trace = false`` (then ``traced_kb`` and
``grew`` are absent); the two modes answer different questions, one run each. (That call writes to file descriptor 2, which
the probe points at a temporary file for the few milliseconds it takes: a log line written to
stderr by another thread meanwhile is lost.)

Costly (tracemalloc slows every allocation and doubles their size): for diagnosis, not for
production. Snapshots are taken on the probe's own thread (not the loop's default executor, whose
few threads a busy daemon may keep waiting on peers); the census is read on the event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import json
import logging
import os
import re
import sys
import tempfile
import time
import tracemalloc
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger("bdn.memprobe")
_MAP = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) \S{4} \S+ \S+ \d+\s*(.*)$")
_BDN = "/bdn/"


def anon_maps(lines: list[str]) -> dict[str, dict[str, int]]:
    """Anonymous resident kB and mapping counts by kind (``heap``, ``1MiB``, ``stack_or_arena``,
    ``other``) from the text of an smaps file (proc(5)); mappings of a file are left out."""
    out = {k: {"n": 0, "kb": 0} for k in ("heap", "1MiB", "stack_or_arena", "other")}
    kind: str | None = None
    for line in lines:
        m = _MAP.match(line)
        if m:
            size, path = int(m.group(2), 16) - int(m.group(1), 16), m.group(3).strip()
            if path == "[heap]":
                kind = "heap"
            elif path:
                kind = None
            elif size == 1 << 20:
                kind = "1MiB"
            elif size >= 8 << 20:
                kind = "stack_or_arena"
            else:
                kind = "other"
        elif kind is not None and line.startswith("Anonymous:"):
            kb = int(line.split()[1])
            if kb:
                out[kind]["n"] += 1
                out[kind]["kb"] += kb
    return out


_PYMALLOC = {
    "arenas allocated current": "arenas",
    "arenas highwater mark": "arenas_highwater",
    "bytes in allocated blocks": "allocated_kb",
    "bytes in available blocks": "available_kb",
}


def parse_pymalloc(text: str) -> dict[str, int]:
    """The arena figures of ``sys._debugmallocstats()``'s text (``# name = 1,234`` lines; bytes
    turned into KiB); the keys it lacks are left out."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        if not line.startswith("#") or "=" not in line:
            continue
        name, _, value = line[1:].partition("=")
        key = _PYMALLOC.get(name.strip())
        if key is not None:
            v = int(value.strip().replace(",", ""))
            out[key] = v >> 10 if key.endswith("_kb") else v
    return out


def pymalloc_stats() -> dict[str, int]:
    """:func:`parse_pymalloc` of this process now (fd 2 pointed at a temporary file meanwhile)."""
    if not hasattr(sys, "_debugmallocstats"):
        return {}
    with tempfile.TemporaryFile() as tmp:
        saved = os.dup(2)
        try:
            sys.stderr.flush()
            os.dup2(tmp.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        return parse_pymalloc(tmp.read().decode("utf-8", "replace"))


def grew(old: tracemalloc.Snapshot | None, new: tracemalloc.Snapshot, top: int) -> list[dict[str, Any]]:
    """The ``top`` largest growths from ``old`` to ``new`` (everything in ``new`` when ``old`` is
    None), by the innermost bdn frame of each allocation's traceback."""

    def by_site(snap: tracemalloc.Snapshot) -> tuple[Counter[str], Counter[str]]:
        size: Counter[str] = Counter()
        count: Counter[str] = Counter()
        for t in snap.traces:
            frames = list(t.traceback)  # oldest first
            site = next(
                (f"bdn/{f.filename.rsplit(_BDN, 1)[1]}:{f.lineno}" for f in reversed(frames) if _BDN in f.filename),
                None,
            )
            if site is None:
                f = frames[-1]
                site = f"lib:{f.filename.rsplit('/', 2)[-1]}:{f.lineno}"
            size[site] += t.size
            count[site] += 1
        return size, count

    ns, nc = by_site(new)
    os_, oc = by_site(old) if old is not None else (Counter(), Counter())
    rows = sorted(set(ns) | set(os_), key=lambda k: os_[k] - ns[k])[:top]
    return [
        {"where": k, "kb": round((ns[k] - os_[k]) / 1024, 1), "blocks": nc[k] - oc[k], "now_kb": round(ns[k] / 1024, 1)}
        for k in rows
        if ns[k] > os_[k]
    ]


def _status_kb(key: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


class MemProbe:
    """Appends one line to ``<dir>/memprobe.jsonl`` every ``every_s`` seconds (see the module)."""

    def __init__(
        self,
        out_dir: Path,
        every_s: float,
        frames: int,
        top: int,
        census: Callable[[], Mapping[str, int]],
        trace: bool = True,
    ) -> None:
        self.path = out_dir / "memprobe.jsonl"
        self.every_s = every_s
        self.frames = frames
        self.top = top
        self.census = census
        self.trace = trace
        self._last: tracemalloc.Snapshot | None = None
        self._t0 = time.monotonic()
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="bdn-memprobe")

    def _measure(self) -> dict[str, Any]:
        """The tracemalloc and /proc part of a line (on a worker thread: a snapshot takes a while)."""
        try:
            maps = anon_maps(Path("/proc/self/smaps").read_text().splitlines())
        except OSError:
            maps = {}
        line: dict[str, Any] = {"rss_anon_kb": _status_kb("RssAnon"), "anon_maps": maps}
        if not tracemalloc.is_tracing():
            return {**line, "pymalloc": pymalloc_stats()}
        snap = tracemalloc.take_snapshot()
        traced, peak = tracemalloc.get_traced_memory()
        line.update(traced_kb=traced >> 10, traced_peak_kb=peak >> 10, grew=grew(self._last, snap, self.top))
        self._last = snap
        return line

    def _census(self) -> dict[str, int]:
        try:
            return {k: int(v) for k, v in self.census().items()}
        except Exception as e:  # a diagnosis must not take the daemon down
            log.warning("memory probe: census failed: %s", e)
            return {}

    async def once(self) -> dict[str, Any]:
        """Measure and append one line; the line."""
        census = self._census()
        measured = await asyncio.get_running_loop().run_in_executor(self._thread, self._measure)
        line = {"t_s": round(time.monotonic() - self._t0, 1), **measured, "census": census}
        self._append((json.dumps(line) + "\n").encode())
        return line

    def _append(self, data: bytes) -> None:
        """Append ``data`` (one line) to the file, creating its directory; a write that fails
        part-way (a full disk) is cut back off, so that the file holds whole lines only. Raises
        OSError."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            end = os.lseek(fd, 0, os.SEEK_END)
            try:
                n = os.write(fd, data)
                if n != len(data):
                    raise OSError(errno.ENOSPC, f"wrote {n} of {len(data)} bytes")
            except OSError:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, end)
                raise
        finally:
            os.close(fd)

    async def run(self) -> None:
        """Start tracemalloc and write a line every ``every_s`` s until cancelled (tracing stops then).

        A line that cannot be written (the directory cannot be made or written, a full disk) is
        one warning, the first time only; the probe keeps trying every ``every_s`` s and says
        so once when a line gets written again."""
        if self.trace:
            tracemalloc.start(self.frames)
        log.warning(
            "memory probe on: %s, a line every %g s in %s",
            f"tracemalloc ({self.frames} frames; slows the daemon)"
            if self.trace
            else "pymalloc's arenas (no tracemalloc)",
            self.every_s,
            self.path,
        )
        failing = False
        try:
            while True:
                try:
                    await self.once()
                    if failing:
                        log.warning("memory probe: writing %s again", self.path)
                    failing = False
                except OSError as e:
                    if not failing:
                        log.warning(
                            "memory probe: cannot write %s: %s (no lines until it can; trying every %g s)",
                            self.path,
                            e.strerror or e,
                            self.every_s,
                        )
                    failing = True
                await asyncio.sleep(self.every_s)
        finally:
            self._thread.shutdown(wait=False)
            if self.trace:
                tracemalloc.stop()
