"""Plot a soak result: every daemon's RssAnon and open fds over the run, faults and hot-loads marked.

```sh
.venv/bin/python -m bench.soak.plot bench/results/soak.json bench/results/soak.png
```

Reads the result JSON of ``python -m bench.soak`` (``samples``: ``[t_s, node, pid, rss_kb, fds,
cpu_s, log_lines, anon_kb]``; ``chaos``: the faults; ``hotload_records``: the POSTs) and writes one
PNG with two panels that share the time axis. Needs matplotlib (the ``bench`` extra).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any


def series(result: dict[str, Any]) -> dict[str, list[tuple[float, float, int]]]:
    """``{node: [(t_s, anon_mb, fds), ...]}`` in time order (a restarted daemon's lives joined)."""
    cols = result["samples_columns"]
    t_i, n_i, a_i, f_i = cols.index("t_s"), cols.index("node"), cols.index("anon_kb"), cols.index("fds")
    out: dict[str, list[tuple[float, float, int]]] = defaultdict(list)
    for s in result["samples"]:
        out[s[n_i]].append((float(s[t_i]), s[a_i] / 1024.0, int(s[f_i])))
    return {k: sorted(v) for k, v in sorted(out.items())}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m bench.soak.plot RESULT.json OUT.png", file=sys.stderr)
        return 2
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = json.loads(Path(args[0]).read_text())
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(11, 7))
    for node, pts in series(result).items():
        ts = [p[0] / 60 for p in pts]
        top.plot(ts, [p[1] for p in pts], lw=0.8, label=node)
        bottom.plot(ts, [p[2] for p in pts], lw=0.8, label=node)
    faults = [e for e in result.get("chaos", []) if e.get("fault")]
    for ax in (top, bottom):
        for e in faults:
            ax.axvline(e["t_s"] / 60, color="grey", lw=0.4, alpha=0.5)
    top.set_ylabel("RssAnon, MB")
    bottom.set_ylabel("open fds")
    bottom.set_xlabel("minutes (grey: a fault injected)")
    h = result.get("hotloads", {})
    top.set_title(
        f"soak: {len(faults)} faults, {h.get('posted', '?')} hot-loads posted, "
        f"{result.get('verify', {}).get('wrong_bytes_handed_out', '?')} wrong bytes handed out"
    )
    top.legend(ncol=5, fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(args[1], dpi=110)
    print(f"wrote {args[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
