"""bdnd's lifecycle (bdn/daemon/app.py) on a real process: signal handlers are installed before
anything else, so SIGTERM during the startup settling stops the daemon cleanly (exit 0) instead
of killing it, and SIGHUP is ignored with a log line."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

from support.swarm import Daemon, free_port


def _wait_log(d: Daemon, needle: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while needle not in d.log():
        assert d.proc is not None and d.proc.poll() is None, f"bdnd exited {d.proc.returncode}:\n{d.log()}"
        assert time.monotonic() < deadline, f"no {needle!r} in the log after {timeout} s:\n{d.log()}"
        time.sleep(0.05)


def test_sigterm_during_startup_settling_stops_cleanly_and_sighup_is_ignored(tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    # A static peer nobody answers for: the daemon settles for startup_settle_s (600 s) unless stopped.
    d = Daemon(tmp_path, "n1", f"file://{bucket}", extra_env={"BDN_STARTUP_SETTLE_S": "600"})
    d.start([f"http://127.0.0.1:{free_port()}"])
    try:
        d.wait_healthy()
        _wait_log(d, "listening")
        assert d.proc is not None
        d.proc.send_signal(signal.SIGHUP)
        _wait_log(d, "SIGHUP ignored")
        assert d.proc.poll() is None
        d.proc.send_signal(signal.SIGTERM)
        try:
            code = d.proc.wait(60)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"bdnd did not stop on SIGTERM while settling:\n{d.log()}") from None
        assert code == 0, d.log()
        assert "stopping" in d.log()
    finally:
        d.kill()
