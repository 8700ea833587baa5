"""Wrong bytes and lost service (issue 12, items 1, 3, 4, 5 and 16), on real bdnd processes.

- item 4: two daemons on one ``shm_dir``: the second exits 2 before it listens, naming the pid
  of the first;
- item 16: a signed peer request a real daemon made for one daemon is refused (401) by another
  daemon of the swarm, and accepted by the one it was made for;
"""

from __future__ import annotations

import http.client
import http.server
import re
import subprocess
import threading
import time
from pathlib import Path

from support.swarm import Daemon, free_port


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


# ---- item 16: a signature is bound to the daemon it is for -----------------------------------

class _Capture(http.server.ThreadingHTTPServer):
    """A listener posing as a peer: answers a request signed for nobody in particular the way a
    daemon does (401 naming ``pose_as``), and records every request signed for ``pose_as``."""

    def __init__(self, pose_as: str) -> None:
        self.pose_as = pose_as
        self.captured: list[tuple[str, str, dict[str, str], bytes]] = []
        self.seen_targets: list[str] = []
        super().__init__(("127.0.0.1", free_port()), _CaptureHandler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _CaptureHandler(http.server.BaseHTTPRequestHandler):
    server: _Capture

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        auth = self.headers.get("Authorization") or ""
        m = re.search(r"\bto=([^,]+),", auth)
        to = m.group(1) if m else ""
        self.server.seen_targets.append(to)
        if to == self.server.pose_as:
            self.server.captured.append((self.command, self.path, dict(self.headers), body))
        self.send_response(401)
        self.send_header("X-BDN-Node", self.server.pose_as)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def _replay(url: str, req: tuple[str, str, dict[str, str], bytes]) -> int:
    method, path, headers, body = req
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        keep = {k: v for k, v in headers.items() if k.lower() in ("authorization", "content-type")}
        conn.request(method, path, body=body, headers=keep)
        r = conn.getresponse()
        r.read()
        return r.status
    finally:
        conn.close()


def test_request_captured_on_its_way_to_one_daemon_is_refused_by_another(tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    target = Daemon(tmp_path, "target", f"file://{bucket}")
    other = Daemon(tmp_path, "other", f"file://{bucket}")
    signer = Daemon(tmp_path, "signer", f"file://{bucket}")
    capture = _Capture(pose_as="target")
    threading.Thread(target=capture.serve_forever, daemon=True).start()
    try:
        target.start([])
        other.start([])
        target.wait_healthy()
        other.wait_healthy()
        # The signer's membership rounds go to the capture, which says it is "target": the signer
        # signs its next POST members for "target", and that request is what an eavesdropper has.
        signer.start([capture.url])
        signer.wait_healthy()
        deadline = time.monotonic() + 60
        while not capture.captured:
            assert time.monotonic() < deadline, f"no request signed for 'target':\n{signer.log()}"
            time.sleep(0.05)
        assert capture.seen_targets[0] == "-"  # it did not know whom it reached: signed for nobody
        req = capture.captured[0]
        assert "to=target," in req[2]["Authorization"]
        assert _replay(other.peer_url, req) == 401  # another daemon of the swarm refuses it
        assert _replay(target.peer_url, req) == 200  # the daemon it was made for takes it, once
        assert _replay(target.peer_url, req) == 401
    finally:
        capture.shutdown()
        for d in (signer, other, target):
            d.stop()
