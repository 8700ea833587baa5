"""A fake peer run as its own process (``support.liar``, ``support.growliar``): the part they share.

``PeerProcess`` picks a free port, writes the swarm secret to ``<workdir>/<node_id>/secret``, starts
``python <script> --port P --bucket B --secret-file F --node-id N <args>`` with its output in
``liar.log``, waits (polling, ``timeout`` s) until the port accepts, and stops it
(SIGTERM, then SIGKILL after 10 s)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Self


def wait_started(
    proc: subprocess.Popen[bytes] | None,
    up: Callable[[], bool],
    timeout: float,
    name: str,
    what: str,
    log: Callable[[], str],
) -> None:
    """Poll ``up()`` every 50 ms until it is true. RuntimeError (with ``log()``) when ``proc`` (None:
    a process started elsewhere) exits first, TimeoutError after ``timeout`` s (``"<name> not <what> after <timeout> s"``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{name} exited {proc.returncode}:\n{log()}")
        if up():
            return
        time.sleep(0.05)
    raise TimeoutError(f"{name} not {what} after {timeout} s:\n{log()}")


def tail(path: Path, chars: int) -> str:
    """The last ``chars`` characters of the text file at ``path`` ("" if it cannot be read)."""
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


class PeerProcess:
    """Subclasses give ``script`` (the file run) and :meth:`args` (its own flags)."""

    script: Path

    def __init__(self, workdir: Path, bucket: str, secret: str, node_id: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.node_id = node_id
        self.bucket = bucket
        self.dir = workdir / node_id
        self.dir.mkdir(parents=True, exist_ok=True)
        self.secret_file = self.dir / "secret"
        self.secret_file.write_text(secret + "\n")
        self.log_path = self.dir / "liar.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def args(self) -> list[str]:
        """The process's flags after the common ones."""
        return []

    def start(self, timeout: float = 240.0) -> Self:  # a process start-up: at load 20+ the imports alone take tens of s
        name = self.script.stem
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    str(self.script),
                    "--port",
                    str(self.port),
                    "--bucket",
                    self.bucket,
                    "--secret-file",
                    str(self.secret_file),
                    "--node-id",
                    self.node_id,
                    *self.args(),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        wait_started(self.proc, self._listening, timeout, name, "listening", self.log)
        return self

    def _listening(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                return True
        except OSError:
            return False

    def log(self) -> str:
        """The last 4000 characters of the process's output."""
        return tail(self.log_path, 4000)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it has not exited after 10 s; nothing if it is not running."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
