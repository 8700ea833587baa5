"""Link rates over time in the emulated cluster of bench/swarm: the bucket's egress and every
node's downlink and uplink, from the bridge-side veth counters, binned against the chunk logs.

    .venv/bin/python -m bench.swarm.links sample OUT.txt        # while a run goes (root; Ctrl-C ends)
    .venv/bin/python -m bench.swarm.links table OUT.txt LOGS... [--bin 2]

``sample`` appends one line every ``--every`` seconds: unix time, the bucket veth's rx bytes (what
the bucket sent), each node veth's tx bytes (what the node received) and rx bytes (what it sent).
``table`` prints MB/s per bin, time 0 being the first chunk start in the chunk logs
(``/tmp/bdnbench/logs/<tag>-n<i>.chunks.jsonl``). A node's downlink below its NIC rate while the
fleet holds chunks it lacks is time the swarm lost (the gap HAVE pushes were made to close).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

SYS = Path("/sys/class/net")


def _read(dev: str, what: str) -> int:
    try:
        return int((SYS / dev / "statistics" / what).read_text())
    except (OSError, ValueError):
        return -1


def sample(out: Path, nodes: int, every: float) -> None:
    with out.open("a") as f:
        while True:
            if (SYS / "bdnb-vb").exists():
                vals = [_read("bdnb-vb", "rx_bytes")]
                vals += [_read(f"bdnb-v{i}", "tx_bytes") for i in range(1, nodes + 1)]
                vals += [_read(f"bdnb-v{i}", "rx_bytes") for i in range(1, nodes + 1)]
                f.write(f"{time.time():.3f} " + " ".join(map(str, vals)) + "\n")
                f.flush()
            time.sleep(every)


def table(samples: Path, logs: list[Path], width: float) -> str:
    rows = [list(map(float, line.split())) for line in samples.read_text().splitlines() if line.strip()]
    full = max(len(r) for r in rows)
    rows = [r for r in rows if len(r) == full]  # a line written while the cluster came up is short
    t0 = min(json.loads(line)["start"] for p in logs for line in p.read_text().splitlines() if line.strip())
    n = (len(rows[0]) - 2) // 2
    bins: dict[int, list[float]] = {}
    for a, b in zip(rows, rows[1:]):
        if len(a) != len(b) or min(a[1:] + b[1:]) < 0:
            continue
        acc = bins.setdefault(int((b[0] - t0) // width), [0.0] * (2 * n + 1))
        for i in range(2 * n + 1):
            acc[i] += (b[i + 1] - a[i + 1]) / 1e6
    out = [f"{'t s':>6} {'bucket':>6} | downlinks MB/s (n1..n{n}) | uplinks MB/s"]
    for k in sorted(bins):
        v = bins[k]
        if k < -1 or not any(x > 0.05 for x in v):
            continue
        out.append(
            f"{k * width:6.1f} {v[0] / width:6.1f} | "
            + " ".join(f"{x / width:4.1f}" for x in v[1 : n + 1])
            + " | "
            + " ".join(f"{x / width:4.1f}" for x in v[n + 1 :])
        )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sample")
    s.add_argument("out", type=Path)
    s.add_argument("--nodes", type=int, default=8)
    s.add_argument("--every", type=float, default=0.25)
    t = sub.add_parser("table")
    t.add_argument("samples", type=Path)
    t.add_argument("logs", type=Path, nargs="+")
    t.add_argument("--bin", type=float, default=2.0)
    a = ap.parse_args()
    if a.cmd == "sample":
        try:
            sample(a.out, a.nodes, a.every)
        except KeyboardInterrupt:
            pass
    else:
        print(table(a.samples, a.logs, a.bin))


if __name__ == "__main__":
    main()
