"""SIGTERM at any moment (issue 12, item 2; bdn/daemon/process/shutdown.py): a real bdnd stopped in the
middle of a download, with a long-poll waiting on it, exits 0 well within ``shutdown_timeout_s``
(aiohttp alone would have held the long-poll 60 s while the download went on), and the next start
on the same shm_dir resumes the half-written snapshot instead of presenting it as READY."""

from __future__ import annotations

import http.client
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

from support.api import wait_for
from support.checkpoints import publish_state
from support.swarm import Daemon

IDENT = "step000001"


def _wait_record(d: Daemon, pred: Any, what: str, timeout: float = 120.0) -> dict[str, Any]:
    return wait_for(
        lambda: d.request("GET", f"/v1/snapshots/{IDENT}"),
        timeout,
        what,
        until=lambda answer: answer[0] == 200 and pred(answer[1]),
        detail=d.log,
    )[1]


def _sigterm_exits_0(d, when: str) -> None:
    """SIGTERM ``d``; it must be gone with exit status 0 within 60 s (a deadline, not a window)."""
    assert d.proc is not None
    d.proc.send_signal(signal.SIGTERM)
    try:
        code = d.proc.wait(60)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"bdnd still running 60 s after SIGTERM {when}:\n{d.log()}") from None
    assert code == 0, d.log()


def test_sigterm_mid_download_with_a_long_poll_exits_0_and_the_next_start_resumes(tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    m, trainer = publish_state(tmp_path, f"file://{bucket}", IDENT, 1, scale=14, chunk_size=256 << 10)
    # 2 Mbit/s: the ~29 MB anchor would take two minutes, so it is mid-download when stopped
    d = Daemon(
        tmp_path,
        "n1",
        f"file://{bucket}",
        extra_env={"BDN_BUCKET_MBIT": "2", "BDN_SHUTDOWN_TIMEOUT_S": "45", "BDN_LOG_LEVEL": "info"},
    )
    d.start([])
    try:
        d.wait_healthy()
        assert d.prefetch(IDENT)[0] in (200, 202)
        rec = _wait_record(d, lambda r: r["state"] == "downloading" and r["bytes_done"] > 0, "download in flight")
        assert rec["bytes_done"] < m.stored_bytes
        # A long-poll in flight (sent before the signal; its answer is read on a thread).
        conn = http.client.HTTPConnection("127.0.0.1", d.local_port, timeout=180)
        conn.request("GET", f"/v1/snapshots/{IDENT}/wait?state=ready&timeout=120")
        answers: list[int] = []

        def read_answer() -> None:
            try:
                answers.append(conn.getresponse().status)
            except OSError:
                pass  # cut by the stop: allowed too

        poll = threading.Thread(target=read_answer, daemon=True)
        poll.start()
        _sigterm_exits_0(d, "mid-download")
        poll.join(60)
        assert answers in ([202], []), answers  # answered "not yet" at once, or cut by the stop
        assert not (d.store / IDENT).exists(), "a half-written snapshot sits under its identity"

        # The next start on the same shm_dir: not READY from shm, resumed, then ready and exact.
        d.env["BDN_BUCKET_MBIT"] = "0"
        d.start([])
        d.wait_healthy()
        rec = d.wait_ready(IDENT)
        log = d.log()
        assert f"snapshot {IDENT}: ready from shm" not in log
        assert f"snapshot {IDENT}: resuming the download a restart interrupted" in log
        assert "resumed with" in log
        for f in m.files:
            assert (Path(rec["path"]) / f.path).read_bytes() == (trainer / f.path).read_bytes(), f.path
    finally:
        d.kill()


def test_sigterm_during_a_local_pull_of_a_big_file_exits_0(tmp_path: Path) -> None:
    """An engine pulling a file over the local API and reading slowly (its socket full) holds a
    request in flight: the stop gives it HTTP_GRACE_S, then closes it (aiohttp alone: 60 s)."""
    bucket = tmp_path / "bucket"
    m, _ = publish_state(tmp_path, f"file://{bucket}", IDENT, 1, scale=14, chunk_size=1 << 20)
    big = max(m.files, key=lambda f: f.size)
    assert big.size > 8 << 20  # well over the loopback socket buffers
    d = Daemon(tmp_path, "n1", f"file://{bucket}", extra_env={"BDN_LOG_LEVEL": "info"})
    d.start([])
    try:
        d.wait_healthy()
        d.prefetch(IDENT)
        d.wait_ready(IDENT)
        conn = http.client.HTTPConnection("127.0.0.1", d.local_port, timeout=180)
        conn.request("GET", f"/v1/snapshots/{IDENT}/files/{big.path}")
        resp = conn.getresponse()
        assert resp.status == 200
        assert len(resp.read(64 << 10)) == 64 << 10  # then it stops reading: the server blocks
        _sigterm_exits_0(d, "during a local pull")
        conn.close()
    finally:
        d.kill()
