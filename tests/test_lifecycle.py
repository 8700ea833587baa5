"""bdnd's lifecycle (bdn/daemon/app.py) on a real process: signal handlers are installed before
anything else, so SIGTERM during the startup settling stops the daemon cleanly (exit 0) instead
of killing it, and SIGHUP is ignored with a log line."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

from support.api import wait_for
from support.swarm import Daemon, free_port


def _wait_log(d: Daemon, needle: str, timeout: float = 120.0) -> None:
    def logged() -> bool:
        if needle in d.log():
            return True
        assert d.proc is not None and d.proc.poll() is None, f"bdnd exited {d.proc.returncode}:\n{d.log()}"
        return False

    wait_for(logged, timeout, f"{needle!r} in the log", detail=d.log)


def test_sigterm_during_startup_settling_stops_cleanly_and_sighup_is_ignored(tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    # A static peer nobody answers for: the daemon settles for startup_settle_s (600 s) unless stopped.
    d = Daemon(tmp_path, "n1", f"file://{bucket}", extra_env={"BDN_STARTUP_SETTLE_S": "600"})
    d.start([f"http://127.0.0.1:{free_port()}"])
    try:
        d.wait_healthy(240)  # generous: a loaded machine imports for tens of seconds
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


def _maps_site_package_extension(pid: int) -> bool:
    """Whether the process has mapped a C extension from site-packages: it is in its imports."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return any("site-packages/" in line and ".so" in line for line in f)
    except OSError:
        return False


def test_sigterm_during_the_imports_exits_0(tmp_path: Path) -> None:
    """The handler is in place before aiohttp, numpy & co. are imported (~0.3 s idle, seconds on a
    busy machine): a SIGTERM then is a clean stop (exit 0), not death by the signal (-15)."""
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    d = Daemon(tmp_path, "n1", f"file://{bucket}")
    d.start([])
    assert d.proc is not None
    try:
        proc = d.proc

        def importing() -> bool:
            if _maps_site_package_extension(proc.pid):
                return True
            assert proc.poll() is None, d.log()
            return False

        wait_for(importing, 120, "bdnd to start importing", 0.001)
        d.proc.send_signal(signal.SIGTERM)
        code = d.proc.wait(120)
        assert code == 0, f"exit {code}:\n{d.log()}"
    finally:
        d.kill()
