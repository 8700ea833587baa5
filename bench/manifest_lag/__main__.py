"""How late does a real bdnd's event loop run while it takes a 10^6-chunk or a 10^5-file manifest?

Issue 12, item 2: no step may block the daemon's event loop for more than about 100 ms. This
starts one real ``bdnd`` on a ``file://`` bucket holding one huge snapshot (sparse objects, 4 KiB
chunks: the manifest is 40 MB of JSON), its bucket reads throttled to a trickle
(``BDN_BUCKET_MBIT``) so that it stays ``downloading`` with the whole plan in hand, and reads the
daemon's own lateness probe (``bdn.daemon.observe.looplag``: a 50 ms sleep loop on the event loop) from
``/metrics`` once a second, in three phases of each run:

- ``idle``: the daemon up, nothing asked of it: the baseline of the same run (what the machine's
  load alone does to a 50 ms sleep);
- ``take``: from the prefetch POST until the snapshot is ``downloading`` (the manifest fetched,
  parsed, validated, the plan and the bitfields built);
- ``download``: ``--download-s`` seconds of downloading with the plan in hand;

then SIGTERM and the time to exit. ``bdn_event_loop_lag_max_seconds`` is the largest lateness of
the last minute, ``bdn_event_loop_slow_total`` the count of probes later than 100 ms, and the
``..._cpu`` pair the same probe's process CPU time (see looplag.py: on a loaded machine the wall
figure also counts waiting for a CPU). Each scrape's health round trip is recorded too.

    .venv/bin/python -m bench.manifest_lag --runs 3 --out bench/results/manifest_lag.json

Exit 0; the JSON has every run and, per shape and phase, median/min/max (bench/runs.py).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from bdn.proto.manifest import MANIFEST_NAME
from bench.runs import add_runs_arg, summarize

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from support.swarm import Daemon  # noqa: E402

CHUNK = 4 << 10
IDENTITY = "step000001"
SHAPES = {"chunks": (1_000_000, 1), "files": (1_000_000, 100_000)}  # (chunks, files)


def publish_huge(root: Path, n_chunks: int, n_files: int) -> int:
    """One full snapshot of ``n_chunks`` 4 KiB chunks over ``n_files`` sparse objects; the
    manifest's size in bytes (digests made up: the trickling bucket delivers few chunks)."""
    snap = root / IDENTITY
    snap.mkdir(parents=True)
    per = n_chunks // n_files
    files = []
    for i in range(n_files):
        name = f"shard-{i:06d}.bin"
        with open(snap / name, "wb") as f:
            f.truncate(per * CHUNK)
        files.append({"path": name, "size": per * CHUNK, "chunks": [f"{(i * per + c):032x}" for c in range(per)]})
    m = {
        "format": "bdn.snapshot/1",
        "identity": IDENTITY,
        "kind": "full",
        "policy_version": 1,
        "created_at": "2026-12-01T00:00:00Z",
        "chunk_size": CHUNK,
        "files": files,
    }
    data = (json.dumps(m, indent=1, sort_keys=True) + "\n").encode()
    (snap / MANIFEST_NAME).write_bytes(data)
    return len(data)


def scrape(d: Daemon) -> dict[str, float]:
    """The lag metrics and the round trip of one health request (s)."""
    t0 = time.monotonic()
    d.get("/v1/health", timeout=120)
    out = {"health_s": time.monotonic() - t0}
    with urllib.request.urlopen(d.url + "/metrics", timeout=120) as r:
        for line in r.read().decode().splitlines():
            name, _, value = line.partition(" ")
            if name in (
                "bdn_event_loop_lag_max_seconds",
                "bdn_event_loop_slow_total",
                "bdn_event_loop_lag_cpu_max_seconds",
                "bdn_event_loop_slow_cpu_total",
            ):
                out[name] = float(value)
    return out


def phase(samples: list[dict[str, float]], slow0: dict[str, float]) -> dict[str, float | None]:
    def mx(k: str) -> float | None:
        vs = [s[k] for s in samples if k in s]
        return round(max(vs), 4) if vs else None

    last = samples[-1] if samples else {}
    return {
        "lag_max_s": mx("bdn_event_loop_lag_max_seconds"),
        "lag_cpu_max_s": mx("bdn_event_loop_lag_cpu_max_seconds"),
        "slow": last.get("bdn_event_loop_slow_total", 0) - slow0.get("bdn_event_loop_slow_total", 0),
        "slow_cpu": last.get("bdn_event_loop_slow_cpu_total", 0) - slow0.get("bdn_event_loop_slow_cpu_total", 0),
        "health_max_s": mx("health_s"),
        "scrapes": len(samples),
    }


def one_run(work: Path, bucket: Path, idle_s: float, download_s: float) -> dict[str, Any]:
    d = Daemon(
        work,
        "node0",
        f"file://{bucket}",
        extra_env={
            "BDN_LOAD_STARTUP": "false",
            "BDN_STARTUP_SETTLE_S": "0",
            "BDN_BUCKET_MBIT": "0.01",
            "BDN_LOG_LEVEL": "info",
        },
    )
    d.start([])
    try:
        d.wait_healthy(600)
        out: dict[str, Any] = {}
        # idle: 65 s would be one whole lag window; idle_s of scrapes is the baseline's worst
        s0 = scrape(d)
        idle = []
        t_end = time.monotonic() + idle_s
        while time.monotonic() < t_end:
            idle.append(scrape(d))
            time.sleep(1)
        out["idle"] = phase(idle, s0)
        s1 = idle[-1] if idle else s0
        t0 = time.monotonic()
        assert d.prefetch(IDENTITY)[0] in (200, 202)
        take: list[dict[str, float]] = []
        deadline = t0 + 900
        while True:
            take.append(scrape(d))
            st = d.request("GET", f"/v1/snapshots/{IDENTITY}", timeout=120)[1]
            state = st.get("state") if isinstance(st, dict) else None
            if state == "downloading":
                break
            if state == "failed" or time.monotonic() > deadline:
                raise RuntimeError(f"not downloading: {st}\n{d.log()}")
            time.sleep(0.5)
        out["take_s"] = round(time.monotonic() - t0, 2)
        out["take"] = phase(take, s1)
        down = []
        t_end = time.monotonic() + download_s
        while time.monotonic() < t_end:
            down.append(scrape(d))
            time.sleep(1)
        out["download"] = phase(down, take[-1])
        rss = [ln for ln in Path(f"/proc/{d.proc.pid}/status").read_text().splitlines() if ln.startswith("RssAnon")]  # type: ignore[union-attr]
        out["rss_anon_mb"] = round(int(rss[0].split()[1]) / 1024, 1)
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        out["sigterm_rc"] = d.proc.wait(120)  # type: ignore[union-attr]
        out["sigterm_to_exit_s"] = round(time.monotonic() - t0, 2)
        return out
    finally:
        d.kill()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.manifest_lag", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--shapes", default="chunks,files", help="chunks (10^6 chunks, 1 file), files (10^6 chunks, 10^5 files)"
    )
    ap.add_argument("--idle-s", type=float, default=15.0)
    ap.add_argument("--download-s", type=float, default=20.0)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/manifest_lag.json")
    add_runs_arg(ap)
    a = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bdn-manifest-lag-") as tmp:
        for shape in a.shapes.split(","):
            n_chunks, n_files = SHAPES[shape]
            bucket = Path(tmp) / f"bucket-{shape}"
            size = publish_huge(bucket, n_chunks, n_files)
            runs = []
            for i in range(a.runs):
                r = one_run(Path(tmp) / f"work-{shape}-{i}", bucket, a.idle_s, a.download_s)
                print(shape, i, json.dumps(r), flush=True)
                runs.append(r)
            flat = {
                f"{p}.{k}": [r[p][k] for r in runs]
                for p in ("idle", "take", "download")
                for k in ("lag_max_s", "lag_cpu_max_s", "slow", "slow_cpu", "health_max_s")
            }
            flat.update({k: [r[k] for r in runs] for k in ("take_s", "rss_anon_mb", "sigterm_to_exit_s")})
            rows.append(
                {
                    "shape": shape,
                    "chunks": n_chunks,
                    "files": n_files,
                    "manifest_bytes": size,
                    "raw": runs,
                    **summarize(flat),
                }
            )
    load = os.getloadavg()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(
        json.dumps(
            {"bench": "manifest_lag", "loadavg_at_end": [round(x, 1) for x in load], "runs": a.runs, "rows": rows},
            indent=1,
        )
        + "\n"
    )
    for row in rows:
        m = row["median"]
        print(
            f"{row['shape']}: take {m['take_s']} s; lag max idle {m['idle.lag_max_s']} / take {m['take.lag_max_s']} / "
            f"download {m['download.lag_max_s']} s (cpu {m['idle.lag_cpu_max_s']} / {m['take.lag_cpu_max_s']} / "
            f"{m['download.lag_cpu_max_s']}); SIGTERM {m['sigterm_to_exit_s']} s"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
