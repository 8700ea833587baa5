"""A process's anonymous resident memory, read from ``/proc/PID/status`` (Linux, proc(5))."""

from __future__ import annotations


def rss_anon_kib(pid: int | str = "self") -> int:
    """``RssAnon`` of process ``pid`` (default: this one), in KiB.

    Raises:
        AssertionError: the status file has no ``RssAnon`` line (not Linux, or the process ended).
    """
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    raise AssertionError(f"no RssAnon in /proc/{pid}/status")
