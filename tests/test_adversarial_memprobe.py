"""The memory probe (memory_probe_dir) against a directory it cannot make, a full disk and a huge
interval, in a real bdnd: one warning line, the daemon keeps serving, the probe writes again once
it can, and its file never holds a partial line."""

from __future__ import annotations

import json
import os
from pathlib import Path

from bdn.publish import publish_full, publish_startup
from support.api import wait_for
from support.swarm import Daemon


def _bucket(tmp_path: Path) -> str:
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_bytes(b"{}")
    url = f"file://{tmp_path / 'bucket'}"
    publish_full(url, "step000001", 1, dir=src)
    publish_startup(url, "step000001")
    return url


def _lines(path: Path) -> list[dict[str, object]]:
    try:
        text = path.read_text()
    except OSError:
        return []
    assert not text or text.endswith("\n"), "a partial line"
    return [json.loads(line) for line in text.splitlines()]


def test_a_probe_directory_that_cannot_be_made_is_one_warning_and_the_probe_recovers(tmp_path: Path) -> None:
    url = _bucket(tmp_path)
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the probe's parent directory should be")
    probe = blocker / "probe"
    d = Daemon(
        tmp_path / "n0",
        "n0",
        url,
        extra_env={"BDN_MEMORY_PROBE_DIR": str(probe), "BDN_MEMORY_PROBE_EVERY_S": "0.2"},
    )
    d.start([])
    try:
        d.wait_healthy()
        wait_for(
            lambda: d.log(), 120, "the probe's warning", 0.1, until=lambda log: "memory probe: cannot write" in log
        )
        d.wait_ready("step000001", timeout=180)  # the daemon serves meanwhile
        assert d.log().count("memory probe: cannot write") == 1  # one line, not one per interval
        blocker.unlink()
        blocker.mkdir()
        wait_for(lambda: _lines(probe / "memprobe.jsonl"), 120, "probe lines once the directory can be made", 0.1)
        wait_for(
            lambda: d.log(), 120, "the probe's recovery line", 0.1, until=lambda log: "memory probe: writing" in log
        )
    finally:
        d.stop()


def test_a_full_disk_and_a_huge_interval_leave_the_daemon_serving(tmp_path: Path) -> None:
    """memprobe.jsonl is a link to /dev/full (every write fails with ENOSPC): one warning; a probe
    with an interval of 1e9 s (the longest bdnd takes) writes its first line and sleeps without an error."""
    url = _bucket(tmp_path)
    full = tmp_path / "full"
    full.mkdir()
    os.symlink("/dev/full", full / "memprobe.jsonl")
    huge = tmp_path / "huge"
    a = Daemon(
        tmp_path / "a", "a", url, extra_env={"BDN_MEMORY_PROBE_DIR": str(full), "BDN_MEMORY_PROBE_EVERY_S": "0.2"}
    )
    b = Daemon(
        tmp_path / "b", "b", url, extra_env={"BDN_MEMORY_PROBE_DIR": str(huge), "BDN_MEMORY_PROBE_EVERY_S": "1e9"}
    )
    a.start([])
    b.start([])
    try:
        a.wait_healthy()
        b.wait_healthy()
        wait_for(lambda: a.log(), 120, "the probe's warning", 0.1, until=lambda log: "No space left on device" in log)
        wait_for(lambda: _lines(huge / "memprobe.jsonl"), 120, "the huge-interval probe's first line", 0.1)
        a.wait_ready("step000001", timeout=180)
        b.wait_ready("step000001", timeout=180)
        assert a.log().count("memory probe: cannot write") == 1
        assert "Traceback" not in a.log() and "Traceback" not in b.log()
        assert len(_lines(huge / "memprobe.jsonl")) == 1
    finally:
        a.stop()
        b.stop()
