"""Bounded per-snapshot memory (issue 31, round 3): the pure parts of the memory probe and of the
catalog's bounds (no I/O, no clock), then one real bdnd under the probe taking hot-loads that
supersede each other: its structures stay within their bounds, and the probe says so."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bdn.daemon.observe.memprobe import anon_maps, parse_pymalloc
from bdn.daemon.snapshots.recent import RecentSet

# ---- pure ------------------------------------------------------------------------------------


def test_a_recent_set_keeps_only_the_newest_names() -> None:
    s = RecentSet(3)
    for name in ("a", "b", "c", "a", "d"):  # "a" added again: newest
        s.add(name)
    assert len(s) == 3 and "b" not in s and all(n in s for n in ("a", "c", "d"))
    s.discard("c")
    s.discard("zzz")
    assert len(s) == 2 and "c" not in s
    for i in range(10_000):
        s.add(f"step{i:06d}")
    assert len(s) == 3 and "step009999" in s and "step009996" not in s
    with pytest.raises(ValueError):
        RecentSet(0)


SMAPS = """\
55d0c0a00000-55d0c1a00000 rw-p 00000000 00:00 0                          [heap]
Size:              16384 kB
Anonymous:          8000 kB
7f0000000000-7f0000100000 rw-p 00000000 00:00 0
Anonymous:          1024 kB
7f0000200000-7f0000a00000 rw-p 00000000 00:00 0
Anonymous:            12 kB
7f0000a00000-7f0000a40000 rw-p 00000000 00:00 0
Anonymous:            40 kB
7f0000b00000-7f0000c00000 r--p 00000000 08:01 1234                       /usr/lib/libc.so.6
Anonymous:             4 kB
7f0000d00000-7f0000e00000 rw-p 00000000 00:00 0
Anonymous:             0 kB
"""


def test_anonymous_memory_is_split_by_mapping_kind() -> None:
    got = anon_maps(SMAPS.splitlines())
    assert got == {
        "heap": {"n": 1, "kb": 8000},
        "1MiB": {"n": 1, "kb": 1024},
        "stack_or_arena": {"n": 1, "kb": 12},
        "other": {"n": 1, "kb": 40},
    }  # a file's pages and empty maps left out


def test_pymalloc_figures_are_read_from_debugmallocstats() -> None:
    text = (
        "Small block threshold = 512, in 32 size classes.\n"
        "# arenas allocated total           =                   18\n"
        "# arenas highwater mark            =                   20\n"
        "# arenas allocated current         =                   18\n"
        "# bytes in allocated blocks        =           18,006,688\n"
        "# bytes in available blocks        =              292,112\n"
        "Total                              =           18,874,368\n"
    )
    assert parse_pymalloc(text) == {"arenas": 18, "arenas_highwater": 20, "allocated_kb": 17584, "available_kb": 285}


def test_untraced_the_probe_reports_pymalloc_arenas_and_the_census(tmp_path: Path) -> None:
    """CPython reports pymalloc's arenas only while tracemalloc does not wrap its allocator."""
    import asyncio

    from bdn.daemon.observe.memprobe import MemProbe

    probe = MemProbe(tmp_path, 60.0, frames=1, top=5, census=lambda: {"jobs": 3}, trace=False)
    line = asyncio.run(probe.once())
    assert line["pymalloc"]["arenas"] > 0 and line["pymalloc"]["allocated_kb"] > 0
    assert line["census"] == {"jobs": 3} and "grew" not in line and "traced_kb" not in line
    assert json.loads((tmp_path / "memprobe.jsonl").read_text()) == line


# ---- a real daemon ---------------------------------------------------------------------------


def _lines(path: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except (OSError, ValueError):
        return []


@pytest.mark.timeout(900)  # a deadline for a hang: at load 58 on 2 cores the run took over 300 s
def test_superseded_hot_loads_leave_bounded_records_and_the_probe_reports_them(tmp_path: Path) -> None:
    """N full snapshots hot-loaded one after the other through a throttled bucket: each load is
    cancelled by the next (a failed record with a manifest), the last one is served. The memory
    probe (memory_probe_dir) writes its lines; once GC ran, no failed record holds its manifest,
    and the catalog holds the ready snapshots GC keeps, the failed records and nothing else."""
    import sys

    from bdn.client import hot_load, hot_load_status
    from bdn.publish import publish_full, publish_startup
    from support.api import wait_for
    from support.swarm import Swarm

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "engine"))
    import tinygpt

    cfg = tinygpt.TinyGPTConfig(n_layer=2, n_head=4, n_embd=128, n_positions=256)
    bucket = f"file://{tmp_path}/bucket"
    n = 4
    w = tinygpt.init_weights(cfg, 0)
    for i in range(1, n + 1):
        w = tinygpt.optimizer_step(w, 0.02, i)
        d = tinygpt.save_checkpoint(tmp_path / "trainer" / f"step{i:06d}", cfg, w)
        publish_full(bucket, f"step{i:06d}", i, dir=d, chunk_size=64 << 10)
    publish_startup(bucket, "step000001")
    probe = tmp_path / "probe"
    # 250 KB/s from the bucket: a 0.9 MB snapshot loads in ~4 s, longer than the next POST takes.
    # A probe line every 2 s: each one snapshots the whole traced heap and compares it with the
    # last (seconds of CPU at load); every 0.5 s kept the daemon busy with its own probe.
    env = {
        "BDN_MEMORY_PROBE_DIR": str(probe),
        "BDN_MEMORY_PROBE_EVERY_S": "2",
        "BDN_KEEP_READY": "2",
        "BDN_BUCKET_MBIT": "2",
    }
    with Swarm(tmp_path / "nodes", 1, bucket, extra_env=env) as swarm:
        d = swarm.daemons[0]
        wait_for(
            lambda: hot_load_status(d.url),
            180,
            "step000001 served",
            0.2,
            until=lambda reps: reps and reps[0]["current_snapshot_identity"] == "step000001",
        )
        for i in range(2, n + 1):
            hot_load(d.url, f"step{i:06d}")
        last = f"step{n:06d}"
        wait_for(
            lambda: hot_load_status(d.url),
            300,
            f"{last} served",
            0.2,
            until=lambda reps: (
                reps and reps[0]["current_snapshot_identity"] == last and reps[0]["loading_state"]["stage"] == "done"
            ),
        )
        snaps = {s["identity"]: s for s in d.get("/v1/snapshots")["snapshots"]}
        failed = [i for i, s in snaps.items() if s["state"] == "failed"]
        assert failed and all("superseded" in snaps[i]["reason"] for i in failed), snaps
        line = wait_for(
            lambda: _lines(probe / "memprobe.jsonl"),
            120,
            "a probe line after the last load",
            0.2,
            until=lambda ls: (
                bool(ls) and ls[-1]["census"]["failed_holding_manifest"] == 0 and ls[-1]["census"]["jobs"] == len(snaps)
            ),
        )[-1]
    c = line["census"]
    ready = sum(1 for s in snaps.values() if s["state"] == "ready")
    assert c["jobs"] == ready + len(failed), (c, snaps)  # nothing but the ready ones (GC's) and the failed records
    assert c["collected"] <= n and c["engines"] == 0 and c["tasks"] > 0 and c["threads"] > 0
    assert line["rss_anon_kb"] > 0 and line["traced_kb"] >= 0 and "pymalloc" not in line  # traced: no pymalloc figures
    assert set(line["anon_maps"]) == {"heap", "1MiB", "stack_or_arena", "other"}
    assert all(set(g) == {"where", "kb", "blocks", "now_kb"} for g in line["grew"])
