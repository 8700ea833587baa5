"""A manifest of about a million chunks against a real bdnd (issue 12, item 2).

The snapshot is one sparse 4 GB object cut into 4 KiB chunks (the smallest chunk size a manifest
may name), with a million distinct digests. The daemon's bucket reads are rate-limited to a
trickle (``BDN_BUCKET_MBIT``), so it stays in ``downloading`` with the whole plan in hand while
the test checks that health answers, the memory stays bounded, and SIGTERM ends it. A second
daemon with ``max_chunks_per_snapshot`` / ``max_files_per_snapshot`` below the manifest's refuses
it at once, naming both numbers.

Every wait is on a state (a health answer, a snapshot state), with generous deadlines.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from bdn.proto.manifest import MANIFEST_NAME
from support.api import wait_for
from support.swarm import Daemon

pytestmark = pytest.mark.timeout(900)  # deadlines for a hang: at load 30-40 taking the manifest took minutes

CHUNK = 4 << 10
N_CHUNKS = 1_000_000
IDENTITY = "step000001"
# The daemon's own memory with the plan in hand: 155 MB measured (bench/manifest_lag, RssAnon,
# 2026-12-02) now that the control state per chunk is arrays (~40 B: digest, keyed address,
# position, masks, bitfield bits; tests/test_index.py), against 557 MB when the pending table
# held a dict entry, an address string and a ChunkRef per chunk. 400 MB: room for allocator
# arenas and the manifest decode's transient strings, and below what per-chunk objects cost.
RSS_BOUND = 400_000_000


def _publish_huge(root: Path, n_files: int = 1) -> None:
    """A full snapshot of ``N_CHUNKS`` 4 KiB chunks over ``n_files`` sparse objects (digests made
    up: the bytes never match, and the trickling bucket never delivers many of them anyway)."""
    snap = root / IDENTITY
    snap.mkdir(parents=True)
    per = N_CHUNKS // n_files
    files = []
    for i in range(n_files):
        name = f"shard-{i:05d}.bin"
        with open(snap / name, "wb") as f:
            f.truncate(per * CHUNK)
        files.append({"path": name, "size": per * CHUNK, "chunks": [f"{(i * per + c):032x}" for c in range(per)]})
    manifest = {
        "format": "bdn.snapshot/1",
        "identity": IDENTITY,
        "kind": "full",
        "policy_version": 1,
        "created_at": "2026-12-01T00:00:00Z",
        "chunk_size": CHUNK,
        "files": files,
    }
    (snap / MANIFEST_NAME).write_text(json.dumps(manifest))


def _rss(pid: int) -> int:
    """The daemon's own memory: anonymous resident pages (RssAnon). Its mappings of the snapshot's
    shm files (the fetcher maps each target file, populated, while it downloads) are the snapshot's
    bytes in tmpfs, not control state, and VmRSS would count them."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon")


def _state(d: Daemon) -> dict:
    status, body = d.request("GET", f"/v1/snapshots/{IDENTITY}", timeout=30)
    return body if status == 200 else {}


def _metric(d: Daemon, name: str) -> float | None:
    body = d.get("/metrics", timeout=30)
    text = body.decode() if isinstance(body, bytes) else str(body)
    for line in text.splitlines():
        if line.startswith((name + " ", name + "{")):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_a_million_chunks_keep_health_memory_and_sigterm(tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    _publish_huge(bucket)
    d = Daemon(
        tmp_path / "work",
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
        d.wait_healthy()  # its 240 s default: a start-up at load 34 took over 60 s
        assert d.prefetch(IDENTITY)[0] in (200, 202)
        # Health answers all along while the manifest is parsed and the plan built.
        seen = {"downloading": 0, "peak": 0}

        def sample() -> bool:
            assert d.get("/v1/health", timeout=120)["status"] == "ok"  # a deadline for a hang, not a window
            seen["peak"] = max(seen["peak"], _rss(d.proc.pid))  # type: ignore[union-attr]
            st = _state(d)
            assert st.get("state") != "failed", st
            seen["downloading"] += st.get("state") == "downloading"
            return seen["downloading"] >= 5

        wait_for(sample, 600, "the download to be seen running 5 times", 0.2, detail=d.log)
        peak = seen["peak"]
        peak = max(peak, _rss(d.proc.pid))  # type: ignore[union-attr]
        print(f"peak RSS {peak} bytes")
        assert peak < RSS_BOUND, f"RSS reached {peak} bytes"
        lag = _metric(d, "bdn_event_loop_lag_max_seconds")
        cpu_lag = _metric(d, "bdn_event_loop_lag_cpu_max_seconds")
        print(f"event loop lag max {lag} s (wall), {cpu_lag} s (the loop thread's own CPU time)")
        # The wall lateness counts waiting for a CPU and for the GIL (the plan is built on a worker
        # thread): seconds at load 30, a figure of the machine. What the loop itself did while a
        # probe was due is its own CPU time, at most 45 ms in bench/manifest_lag; the bound is the
        # issue's ~100 ms with room for a CPU shared with dozens of processes (before the plan
        # moved off the loop, health took 17 s).
        assert cpu_lag is not None and cpu_lag < 0.25, f"event loop blocked {cpu_lag} s by its own work"
        # SIGTERM in the middle of it: exits, cleanly.
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        try:
            # A deadline for a hang, not a speed check: at load 27 on 2 cores the exit took 12.5 s.
            rc = d.proc.wait(120)  # type: ignore[union-attr]
            print(f"SIGTERM to exit {time.monotonic() - t0:.2f} s")
        except subprocess.TimeoutExpired:
            raise AssertionError(f"SIGTERM not honoured within 120 s:\n{d.log()}") from None
        assert rc == 0, d.log()
    finally:
        d.kill()


@pytest.mark.parametrize(
    "key,limit,named",
    [
        ("BDN_MAX_CHUNKS_PER_SNAPSHOT", "1000", f"{N_CHUNKS} chunks"),
        ("BDN_MAX_FILES_PER_SNAPSHOT", "10", "20 files"),
    ],
)
def test_limits_on_chunks_and_files_refuse_at_once(tmp_path: Path, key: str, limit: str, named: str) -> None:
    bucket = tmp_path / "bucket"
    _publish_huge(bucket, n_files=20)
    d = Daemon(
        tmp_path / "work",
        "node0",
        f"file://{bucket}",
        extra_env={
            "BDN_LOAD_STARTUP": "false",
            "BDN_STARTUP_SETTLE_S": "0",
            key: limit,
        },
    )
    d.start([])
    try:
        d.wait_healthy()  # its 240 s default: a start-up at load 34 took over 60 s
        d.prefetch(IDENTITY)
        # a deadline for a hang (the refusal itself is immediate once the manifest is read)
        st = wait_for(
            lambda: _state(d),
            300,
            "the load to be refused",
            0.1,
            until=lambda st: st.get("state") == "failed",
            meanwhile=lambda st: st.get("state") in (None, "queued"),
            detail=d.log,
        )
        assert named in st["reason"] and limit in st["reason"], st["reason"]
    finally:
        d.stop()
