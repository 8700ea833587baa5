"""Wrong bytes and lost service (issue 12, items 1, 3, 4, 5 and 16), on real bdnd processes.

- item 4: two daemons on one ``shm_dir``: the second exits 2 before it listens, naming the pid
  of the first;
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from support.swarm import Daemon


def _exit_code(d: Daemon, timeout: float = 60.0) -> int:
    assert d.proc is not None
    try:
        return d.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"bdnd {d.node_id} did not exit:\n{d.log()}") from None


# ---- item 4: one daemon per shm_dir ------------------------------------------------------------

def test_second_daemon_on_the_same_shm_dir_exits_2_naming_the_first(tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    first = Daemon(tmp_path, "first", f"file://{bucket}")
    second = Daemon(tmp_path, "second", f"file://{bucket}", extra_env={"BDN_SHM_DIR": str(first.shm_dir)})
    first.start([])
    try:
        first.wait_healthy()
        second.start([])
        assert _exit_code(second) == 2, second.log()
        assert first.proc is not None
        lines = [ln for ln in second.log().splitlines() if ln.strip()]
        assert lines == [f"bdnd: error: shm_dir {str(first.shm_dir)!r} is in use by pid {first.proc.pid} "
                         "(one bdnd per shm_dir)"], lines
        first.get("/v1/health")  # the first one is untouched
        # once the first is gone, the directory is free again (the kernel drops the flock)
        first.stop()
        assert first.proc.returncode == 0, first.log()
        second.start([])
        second.wait_healthy()
    finally:
        second.stop()
        first.stop()
