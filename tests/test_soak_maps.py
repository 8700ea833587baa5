"""bench/soak/maps.py: the split of a process's anonymous memory into glibc main heap, thread
arenas and the rest, on a real process's /proc/PID/smaps and on the format's edge cases."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from bench.soak.maps import HEAP_MAX, parse_smaps, read_smaps
from support.procmem import rss_anon_kib as _rss_anon_kb

# A child whose threads each keep 16 MB of 4000-byte blocks: glibc serves those from thread arenas.
CHILD = textwrap.dedent("""
    import sys, threading
    keep = []
    def work():
        keep.extend(bytearray(4000) for _ in range(4000))
    ts = [threading.Thread(target=work) for _ in range(3)]
    for t in ts: t.start()
    for t in ts: t.join()
    print("ready", flush=True)
    sys.stdin.read()
""")


def test_real_process_thread_arenas_and_sum() -> None:
    p = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        m = read_smaps(p.pid)
        anon = _rss_anon_kb(p.pid)
    finally:
        p.communicate("")
    assert m is not None
    assert m["arena_heaps"] >= 1
    assert m["arenas_kb"] >= 30_000, m  # 48 MB kept by three threads; at least two arenas' worth seen as arenas
    total = m["heap_kb"] + m["arenas_kb"] + m["other_kb"]
    assert abs(total - anon) <= max(2048, anon // 20), (m, anon)


def test_gone_process_is_none() -> None:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert read_smaps(p.pid) is None


def _map(start: int, end: int, perms: str, path: str, anon_kb: int) -> str:
    return f"{start:x}-{end:x} {perms} 00000000 00:00 0 {path}\nRss: {anon_kb} kB\nAnonymous: {anon_kb} kB\n"


def test_synthetic_layout() -> None:
    base = 0x7F00_0000_0000  # a multiple of 64 MiB
    text = "".join(
        [
            _map(0x5555_0000_0000, 0x5555_0040_0000, "rw-p", "[heap]", 4000),
            _map(base, base + (8 << 20), "rw-p", "", 3000),  # arena heap in use ...
            _map(base + (8 << 20), base + HEAP_MAX, "---p", "", 0),  # ... and its reserved rest
            _map(base + HEAP_MAX, base + 2 * HEAP_MAX, "rw-p", "", 64),  # a whole 64 MiB arena heap
            _map(base + 3 * HEAP_MAX, base + 3 * HEAP_MAX + 4096, "---p", "", 0),  # a thread stack's guard
            _map(base + 3 * HEAP_MAX + 4096, base + 3 * HEAP_MAX + (8 << 20), "rw-p", "", 100),  # its stack
            _map(0x7F10_0000_1000, 0x7F10_0010_1000, "rw-p", "", 1024),  # pymalloc arena, not aligned
            _map(0x7F20_0000_0000, 0x7F20_0001_0000, "r--p", "/usr/lib/libc.so.6", 0),
        ]
    )
    assert parse_smaps(text.splitlines(keepends=True)) == {
        "heap_kb": 4000,
        "arenas_kb": 3064,
        "arena_heaps": 2,
        "other_kb": 1124,
    }
