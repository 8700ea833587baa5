"""Where a daemon's anonymous memory lives, from ``/proc/<pid>/smaps`` (proc(5), "/proc/pid/smaps").

The soak's RssAnon is one number; a leak and allocator fragmentation look the same in it. This
splits it by the allocator that owns each mapping:

- ``heap``: the ``[heap]`` mapping, glibc's main arena (brk): what the main thread (the event loop)
  mallocs, and everything pymalloc does not take (objects > 512 bytes);
- ``arenas``: glibc's thread arenas: each ``HEAP_MAX_SIZE`` (64 MiB on 64-bit) reservation aligned
  to its size, an ``rw-p`` part in use followed by a ``---p`` rest (glibc malloc/arena.c,
  ``new_heap``); ``arena_heaps`` counts them (one arena can chain several);
- ``other``: every other anonymous mapping: pymalloc's 1 MiB arenas, mmapped large blocks, thread
  stacks, numpy/zstd buffers.

Each figure is the mappings' ``Anonymous:`` kB (resident anonymous pages), so the three sum to
about ``RssAnon`` of ``/proc/<pid>/status``. Written here rather than taken from a library:
psutil's ``memory_maps()`` drops the addresses and the permissions this needs.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

HEAP_MAX = 64 << 20  # glibc HEAP_MAX_SIZE on 64-bit (2 * DEFAULT_MMAP_THRESHOLD_MAX)
_HEAD = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S{4}) \S+ \S+ \d+\s*(.*)$")


def parse_smaps(lines: Iterable[str]) -> dict[str, int]:
    """``{"heap_kb", "arenas_kb", "arena_heaps", "other_kb"}`` from the text of an smaps file."""
    maps: list[list[object]] = []  # [start, end, perms, path, anon_kb]
    for line in lines:
        m = _HEAD.match(line)
        if m:
            maps.append([int(m.group(1), 16), int(m.group(2), 16), m.group(3), m.group(4).strip(), 0])
        elif line.startswith("Anonymous:") and maps:
            maps[-1][4] = int(line.split()[1])
    out = {"heap_kb": 0, "arenas_kb": 0, "arena_heaps": 0, "other_kb": 0}
    for i, (start, end, perms, path, anon) in enumerate(maps):
        assert isinstance(start, int) and isinstance(end, int) and isinstance(anon, int)
        if path == "[heap]":
            out["heap_kb"] += anon
            continue
        if path or not anon:
            if not path:
                out["other_kb"] += anon
            continue
        nxt = maps[i + 1] if i + 1 < len(maps) else None
        whole = end - start == HEAP_MAX and start % HEAP_MAX == 0
        reserved_rest = (
            nxt is not None
            and nxt[0] == end
            and nxt[2] == "---p"
            and not nxt[3]
            and isinstance(nxt[1], int)
            and nxt[1] % HEAP_MAX == 0
            and nxt[1] - start <= HEAP_MAX
        )
        if perms == "rw-p" and (whole or reserved_rest):
            out["arenas_kb"] += anon
            out["arena_heaps"] += 1
        else:
            out["other_kb"] += anon
    return out


def read_smaps(pid: int) -> dict[str, int] | None:
    """:func:`parse_smaps` of a live process, None when it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/smaps") as f:
            return parse_smaps(f)
    except (OSError, ValueError):
        return None


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.soak.maps PID...``: one line per process, MB of each owner."""
    import sys

    pids = [int(a) for a in (argv if argv is not None else sys.argv[1:])]
    if not pids:
        print("usage: python -m bench.soak.maps PID...", file=sys.stderr)
        return 2
    for pid in pids:
        m = read_smaps(pid)
        if m is None:
            print(f"{pid}: gone or unreadable")
            continue
        print(
            f"{pid}: main heap {m['heap_kb'] / 1024:.1f} MB, thread arenas {m['arenas_kb'] / 1024:.1f} MB "
            f"({m['arena_heaps']} heaps), other anonymous {m['other_kb'] / 1024:.1f} MB"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
