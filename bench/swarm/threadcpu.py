"""Per-thread CPU of every running bdnd, by thread name, until SIGTERM/SIGINT: where a daemon's
CPU goes during a swarm run.

Samples ``/proc/PID/task/TID/stat`` (user and system clock ticks) of every process whose command
line runs ``bdnd`` every 0.5 s and names the threads from ``py-spy dump`` (Python's thread names
are not the kernel's). On exit prints user + system seconds per thread name (digits dropped), all
processes together.

    python -m bench.swarm.threadcpu > out.txt &   # then run the bench; then: pkill -f bench.swarm.threadcpu
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import time

TICK = os.sysconf("SC_CLK_TCK")
PYSPY = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")


def bdnd_pids() -> list[str]:
    """Process ids (strings) of the running processes whose command line runs ``bdnd``."""
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            except OSError:
                continue
            if any(c.endswith(b"bdnd") for c in cmd[:3]):
                out.append(pid)
    return out


def main() -> None:
    """Sample until told to stop, then print the table (see the module docstring)."""
    cpu: dict[tuple[str, str], tuple[float, float]] = {}
    names: dict[tuple[str, str], str] = {}
    named: set[str] = set()
    stop = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    signal.signal(signal.SIGINT, lambda *a: stop.append(1))
    first: dict[str, float] = {}
    while not stop:
        for pid in bdnd_pids():
            first.setdefault(pid, time.monotonic())
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tids:
                try:
                    st = open(f"/proc/{pid}/task/{tid}/stat").read()
                except OSError:
                    continue
                f = st[st.rindex(")") + 2 :].split()
                cpu[(pid, tid)] = (int(f[11]) / TICK, int(f[12]) / TICK)
            if pid not in named and time.monotonic() - first[pid] > 8:  # its threads have started
                named.add(pid)
                dump = subprocess.run(
                    [PYSPY, "dump", "--nonblocking", "--pid", pid], capture_output=True, text=True
                ).stdout
                for m in re.finditer(r'Thread (\d+) \(\w+\): "([^"]+)"', dump):
                    names[(pid, m.group(1))] = m.group(2)
        time.sleep(0.5)
    by: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for k, (u, s) in cpu.items():
        n = re.sub(r"[_-]?\d+$", "", names.get(k, "unnamed"))
        by[n][0] += u
        by[n][1] += s
    print(f"{len({p for p, _ in cpu})} processes, {sum(u + s for u, s in cpu.values()):.2f} CPU-s")
    for n, (u, s) in sorted(by.items(), key=lambda kv: -sum(kv[1])):
        print(f"{u + s:8.2f}  user {u:6.2f}  sys {s:6.2f}  {n}")


if __name__ == "__main__":
    main()
