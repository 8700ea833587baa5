"""Helpers for the fault tests (tests/test_faults.py): chunk-only S3 faults, an shm watcher, a
small real tmpfs, and HRW ownership of a manifest's chunks.

- :class:`ChunkFaultProxy`: an :class:`~support.s3server.S3Proxy` whose extra faults hit only
  *ranged* GETs (the daemons' chunk reads), so a burst of throttling lands on the transfer itself
  rather than being eaten by the manifest reads that come first.
- :class:`ShmWatcher`: a thread that keeps scanning a daemon's ``<shm_dir>/<swarm_id>/`` while a
  fault happens and records every snapshot directory it ever saw without its ``READY`` marker
  (DESIGN.md, "The store": a directory under an identity always holds READY and every file; it
  appears by one rename with READY already inside).
- :func:`small_tmpfs`: mount a real tmpfs of a given size (root only); skips the test with the
  reason when mounting is not permitted, and always unmounts.
- :func:`owned_bytes`: bytes of a manifest's stored chunks that each node owns by HRW.
- :class:`FaultSwarm` / :func:`listen_ports`: daemons listening on ports *below* the kernel's
  ephemeral range, claimed across test processes (``swarm.free_port()``): an outgoing connection
  never takes such a port, and no other test process draws it while this one runs. A FaultSwarm also stops the daemons it started when starting
  fails (``Swarm.__enter__`` leaks them then).
"""

from __future__ import annotations

import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from bdn.proto import hrw
from bdn.proto.manifest import Manifest
from support.s3server import S3Proxy, _error_xml
from support.swarm import SECRET, Daemon, Swarm, free_port

__all__ = ["ChunkFaultProxy", "FaultSwarm", "ShmWatcher", "listen_ports", "owned_bytes", "small_tmpfs", "stable_ports"]


def listen_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports, free now, below the ephemeral range (see module doc), each
    claimed for this process among every test process of the machine (``swarm.free_port``): an
    unclaimed draw let two pytest-xdist workers start daemons on one port ("peer_listen
    127.0.0.1:16192 is in use", a CI replica's test_soak_short)."""
    return [free_port() for _ in range(n)]


def stable_ports(d: Daemon) -> Daemon:
    """Move ``d``'s peer, local and transfer ports out of the ephemeral range (before it first starts)."""
    d.peer_port, d.local_port, d.transfer_port = listen_ports(3)
    d.env.update(
        BDN_PEER_LISTEN=f"127.0.0.1:{d.peer_port}",
        BDN_ADVERTISE_URL=d.peer_url,
        BDN_LOCAL_LISTEN=f"127.0.0.1:{d.local_port}",
        BDN_TRANSFER_LISTEN=f"127.0.0.1:{d.transfer_port}",
    )
    return d


class FaultSwarm(Swarm):
    """A :class:`Swarm` on stable ports that cleans up after a failed start."""

    def __init__(
        self, workdir: Path, n: int, bucket: str, secret: str = SECRET, extra_env: dict[str, str] | None = None
    ) -> None:
        super().__init__(workdir, n, bucket, secret, extra_env)
        for d in self.daemons:
            stable_ports(d)

    def start(self) -> FaultSwarm:
        try:
            super().start()
        except BaseException:
            self.stop()
            raise
        return self


@dataclass
class _ChunkFault:
    remaining: int
    status: int
    code: str
    truncate_after: int | None


class ChunkFaultProxy(S3Proxy):
    """S3Proxy plus faults that only ranged GETs (chunk reads) receive.

    ``fail_chunk_gets(n, status, code)`` answers the next ``n`` ranged GETs with an S3 XML error;
    ``truncate_chunk_gets(n, after_bytes)`` forwards them but cuts the body short. Faults queue up
    in the order they were added. The records (``requests()``) mark them ``injected`` /
    ``truncated`` as the base proxy does.
    """

    def __init__(self, upstream: str) -> None:
        super().__init__(upstream)
        self._chunk_faults: list[_ChunkFault] = []

    def fail_chunk_gets(self, n: int, status: int = 503, code: str = "SlowDown") -> None:
        with self._lock:
            self._chunk_faults.append(_ChunkFault(n, status, code, None))

    def truncate_chunk_gets(self, n: int, after_bytes: int) -> None:
        with self._lock:
            self._chunk_faults.append(_ChunkFault(n, 206, "", after_bytes))

    def pending_chunk_faults(self) -> int:
        with self._lock:
            return sum(f.remaining for f in self._chunk_faults)

    def _take_chunk_fault(self) -> _ChunkFault | None:
        with self._lock:
            if not self._chunk_faults:
                return None
            f = self._chunk_faults[0]
            f.remaining -= 1
            if f.remaining <= 0:
                self._chunk_faults.pop(0)
            return f

    async def _answer(self, request: web.Request, record, finished: Callable[[], None]) -> web.StreamResponse:  # type: ignore[no-untyped-def]
        fault = self._take_chunk_fault() if request.method == "GET" and record.range else None
        if fault is None:
            return await super()._answer(request, record, finished)
        if fault.truncate_after is not None:
            return await self._forward(request, record, fault.truncate_after, finished)
        body = _error_xml(fault.code, "Injected by ChunkFaultProxy.", record.path).encode()
        record.status, record.injected, record.response_bytes = fault.status, True, len(body)
        return web.Response(
            status=fault.status,
            body=body,
            content_type="application/xml",
            headers={"x-amz-request-id": uuid.uuid4().hex[:16].upper()},
        )


class ShmWatcher:
    """Scan ``root`` every ``interval`` s; remember snapshot directories seen without READY.

    Use as a context manager; ``violations`` lists ``(path, what)`` pairs. Dot-directories
    (``.staging``, ``.stored``) are where half-built snapshots legitimately live and are skipped.
    """

    def __init__(self, roots: Iterable[Path], interval: float = 0.01) -> None:
        self.roots = list(roots)
        self.interval = interval
        self.violations: list[tuple[str, str]] = []
        self.scans = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shm-watcher", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for root in self.roots:
                try:
                    entries = list(root.iterdir())
                except OSError:
                    continue
                for d in entries:
                    if d.name.startswith("."):
                        continue
                    try:
                        if d.is_dir() and not (d / "READY").is_file():
                            # Re-check: a GC may be removing it this instant (files first).
                            if d.is_dir() and not (d / "READY").is_file():
                                self.violations.append((str(d), "snapshot directory without READY"))
                    except OSError:
                        pass
            self.scans += 1
            self._stop.wait(self.interval)

    def __enter__(self) -> ShmWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


@contextmanager
def small_tmpfs(path: Path, size_bytes: int) -> Iterator[Path]:
    """A real tmpfs of ``size_bytes`` mounted at ``path`` (unmounted on exit).

    Skips the calling test, printing why, when the mount is not permitted (not root, no
    CAP_SYS_ADMIN in a container, no ``mount`` binary).
    """
    import pytest

    path.mkdir(parents=True, exist_ok=True)
    try:
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=0700", "tmpfs", str(path)],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        reason = f"cannot run mount: {e}"
        print(f"SKIP small_tmpfs: {reason}")
        pytest.skip(reason)
    if r.returncode != 0:
        reason = f"mount -t tmpfs not permitted here (exit {r.returncode}): {r.stderr.strip()}"
        print(f"SKIP small_tmpfs: {reason}")
        pytest.skip(reason)
    try:
        yield path
    finally:
        for _ in range(50):  # a daemon that just exited may still hold a file for a moment
            if subprocess.run(["umount", str(path)], capture_output=True).returncode == 0:
                break
            time.sleep(0.1)
        else:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def owned_bytes(m: Manifest, nodes: list[str]) -> dict[str, int]:
    """Bytes of ``m``'s stored chunks whose HRW owner among ``nodes`` is each node."""
    out = dict.fromkeys(nodes, 0)
    for ref in m.stored_chunks():
        out[hrw.owner(nodes, ref.digest)] += ref.length  # type: ignore[index]
    return out
