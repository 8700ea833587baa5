"""A minimal stand-in for bdnd's local API, for tests of bdn.client and bdnctl only.

bdnd is a separate component still being written; this serves the same shapes as
README.md's local API from real READY directories on disk, over a real aiohttp server on
127.0.0.1 (and optionally a unix socket) running in a background thread. Snapshot progress is
simulated: each poll of a pending snapshot advances it one step. The lead replaces it with the real
daemon once bdnd lands.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from bdn.proto.chunks import file_digests
from bdn.proto.errors import BdnError
from bdn.proto.identity import validate_identity, validate_relpath
from bdn.proto.safetensors_fmt import read_header

STATE_ORDER = ["queued", "downloading", "applying", "verifying", "ready"]


def write_ready(
    directory: Path,
    identity: str,
    policy_version: int,
    *,
    kind: str = "full",
    base_identity: str | None = None,
    chunk_size: int = 4096,
) -> dict[str, Any]:
    """Write ``directory/READY`` (format bdn.ready/1) describing every file now in ``directory``."""
    files = []
    for p in sorted(directory.rglob("*")):
        if p.is_file() and p.name != "READY":
            rel = p.relative_to(directory).as_posix()
            files.append({"path": rel, "size": p.stat().st_size, "chunks": file_digests(p, chunk_size)})
    ready = {
        "format": "bdn.ready/1", "identity": identity, "kind": kind, "policy_version": policy_version,
        "base_identity": base_identity, "chunk_size": chunk_size, "files": files,
    }
    (directory / "READY").write_text(json.dumps(ready))
    return ready


@dataclass
class FakeSnapshot:
    identity: str
    path: Path | None = None
    kind: str = "full"
    policy_version: int = 0
    state: str = "queued"
    reason: str | None = None
    steps: int = 0  # polls left before it becomes ready (or failed, when fail_reason is set)
    fail_reason: str | None = None
    bytes_total: int = 0
    bytes_done: int = 0
    announced: bool = False  # known to the daemon (preset, or after a prefetch)
    never_ready: bool = False
    created_at: float = field(default_factory=time.time)

    def view(self) -> dict[str, Any]:
        return {
            "identity": self.identity, "kind": self.kind, "policy_version": self.policy_version,
            "base_identity": None, "state": self.state, "reason": self.reason,
            "path": str(self.path) if self.state == "ready" and self.path else None,
            "bytes_total": self.bytes_total, "bytes_done": self.bytes_done,
            "result_bytes": self.bytes_total, "stored_bytes": self.bytes_total,
            "bytes_from_bucket": self.bytes_done, "bytes_from_peers": 0,
            "stages": {}, "created_at": self.created_at, "updated_at": time.time(),
        }

    def advance(self) -> None:
        if self.state in ("ready", "failed", "queued") or self.never_ready:
            return
        self.steps -= 1
        if self.steps > 0:
            self.bytes_done = min(self.bytes_total, self.bytes_done + max(1, self.bytes_total // 4))
            return
        if self.fail_reason:
            self.state, self.reason = "failed", self.fail_reason
        else:
            self.state, self.bytes_done = "ready", self.bytes_total


def _err(status: int, message: str, **extra: Any) -> web.Response:
    return web.json_response({"error": message, **extra}, status=status)


class FakeLocalApi:
    """Serve the local API from registered snapshots; ``start()`` returns the http URL."""

    def __init__(self, unix_path: str | None = None) -> None:
        self.snaps: dict[str, FakeSnapshot] = {}
        self.unix_path = unix_path
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # -- registry ------------------------------------------------------------------------------

    def add_ready(self, path: Path, *, announced: bool = True) -> FakeSnapshot:
        ready = json.loads((path / "READY").read_text())
        total = sum(f["size"] for f in ready["files"])
        snap = FakeSnapshot(ready["identity"], path, ready["kind"], ready["policy_version"], "ready",
                            bytes_total=total, bytes_done=total, announced=announced)
        self.snaps[snap.identity] = snap
        return snap

    def add_pending(self, path: Path, steps: int = 4) -> FakeSnapshot:
        """A snapshot that appears on prefetch and becomes ready after ``steps`` polls."""
        snap = self.add_ready(path, announced=False)
        snap.state, snap.bytes_done, snap.steps = "queued", 0, steps
        return snap

    def add_failing(self, identity: str, reason: str, steps: int = 2) -> FakeSnapshot:
        snap = FakeSnapshot(identity, None, bytes_total=1000, steps=steps, fail_reason=reason)
        self.snaps[identity] = snap
        return snap

    def add_stuck(self, identity: str) -> FakeSnapshot:
        snap = FakeSnapshot(identity, None, bytes_total=1000, never_ready=True)
        self.snaps[identity] = snap
        return snap

    # -- handlers ------------------------------------------------------------------------------

    def _get(self, request: web.Request) -> FakeSnapshot | web.Response:
        identity = request.match_info["id"]
        try:
            validate_identity(identity)
        except BdnError as exc:
            return _err(400, str(exc))
        snap = self.snaps.get(identity)
        if snap is None or not snap.announced:
            return _err(404, f"snapshot {identity} is not known to this daemon")
        return snap

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "node_id": "fake-node", "swarm_id": "0123456789abcdef"})

    async def status(self, request: web.Request) -> web.Response:
        return web.json_response({
            "node_id": "fake-node", "swarm_id": "0123456789abcdef", "peer_url": "http://127.0.0.1:7080",
            "version": "0.1.0", "peers": [{"node_id": "peer-1", "url": "http://127.0.0.1:7090", "alive": True}],
            "bucket": {"url": "file:///tmp/bucket", "get_requests": 3, "get_bytes": 12345},
            "counters": {"bucket_bytes_owner": 12345, "bucket_bytes_fallback": 0, "peer_bytes_in": 0,
                         "peer_bytes_out": 0, "chunk_verify_failures": 0},
            "snapshots": [s.view() for s in self.snaps.values() if s.announced],
        })

    async def snapshots(self, request: web.Request) -> web.Response:
        return web.json_response({"snapshots": [s.view() for s in self.snaps.values() if s.announced]})

    async def snapshot(self, request: web.Request) -> web.Response:
        snap = self._get(request)
        if isinstance(snap, web.Response):
            return snap
        snap.advance()
        return web.json_response(snap.view())

    async def prefetch(self, request: web.Request) -> web.Response:
        identity = request.match_info["id"]
        try:
            validate_identity(identity)
        except BdnError as exc:
            return _err(400, str(exc))
        snap = self.snaps.get(identity)
        if snap is None:  # not published: the real daemon waits for the manifest
            snap = self.snaps[identity] = FakeSnapshot(identity, None)
        if not snap.announced or snap.state == "queued":
            snap.announced = True
            if snap.steps > 0 or snap.never_ready:
                snap.state = "downloading"
        return web.json_response(snap.view(), status=202)

    async def wait(self, request: web.Request) -> web.Response:
        snap = self._get(request)
        if isinstance(snap, web.Response):
            return snap
        target = request.query.get("state", "ready")
        if target not in STATE_ORDER + ["failed"]:
            return _err(400, f"state {target!r} is not a snapshot state")
        try:
            timeout = float(request.query.get("timeout", "30"))
        except ValueError:
            return _err(400, "timeout must be a number of seconds")
        if not (math.isfinite(timeout) and 0 <= timeout <= 300):
            return _err(400, "timeout must be between 0 and 300 seconds")
        snap.advance()
        if snap.state == "failed" and target != "failed":
            return _err(409, snap.reason or "failed", snapshot=snap.view())
        if snap.state == target or (
            snap.state in STATE_ORDER and target in STATE_ORDER
            and STATE_ORDER.index(snap.state) >= STATE_ORDER.index(target)
        ):
            return web.json_response(snap.view())
        await asyncio.sleep(min(timeout, 0.05))
        return web.json_response(snap.view(), status=202)

    def _ready(self, request: web.Request) -> FakeSnapshot | web.Response:
        snap = self._get(request)
        if isinstance(snap, web.Response):
            return snap
        if snap.state != "ready" or snap.path is None:
            return _err(409, f"snapshot {snap.identity} is {snap.state}, not ready")
        return snap

    async def files(self, request: web.Request) -> web.Response:
        snap = self._ready(request)
        if isinstance(snap, web.Response):
            return snap
        assert snap.path is not None
        ready = json.loads((snap.path / "READY").read_text())
        return web.json_response({"files": [{"path": f["path"], "size": f["size"]} for f in ready["files"]]})

    async def file(self, request: web.Request) -> web.StreamResponse:
        snap = self._ready(request)
        if isinstance(snap, web.Response):
            return snap
        assert snap.path is not None
        try:
            rel = validate_relpath(request.match_info["path"])
        except BdnError as exc:
            return _err(400, str(exc))
        full = snap.path / rel
        if rel == "READY" or not full.is_file():
            return _err(404, f"no file {rel!r} in snapshot {snap.identity}")
        return web.FileResponse(full)

    async def tensor(self, request: web.Request) -> web.Response:
        snap = self._ready(request)
        if isinstance(snap, web.Response):
            return snap
        assert snap.path is not None
        name = request.match_info["name"]
        for shard in sorted(snap.path.rglob("*.safetensors")):
            header = read_header(shard)
            info = header.tensors.get(name)
            if info is None:
                continue
            start, end = info.start, info.end  # absolute file offsets
            with open(shard, "rb") as f:
                f.seek(start)
                data = f.read(end - start)
            return web.Response(body=data, content_type="application/octet-stream", headers={
                "X-BDN-Dtype": info.dtype, "X-BDN-Shape": ",".join(str(d) for d in info.shape),
                "X-BDN-File": shard.relative_to(snap.path).as_posix(),
            })
        return _err(404, f"no tensor {name!r} in snapshot {snap.identity}")

    # -- lifecycle -----------------------------------------------------------------------------

    def _app(self) -> web.Application:
        app = web.Application()
        r = app.router
        r.add_get("/v1/health", self.health)
        r.add_get("/v1/status", self.status)
        r.add_get("/v1/snapshots", self.snapshots)
        r.add_get("/v1/snapshots/{id}", self.snapshot)
        r.add_post("/v1/snapshots/{id}/prefetch", self.prefetch)
        r.add_get("/v1/snapshots/{id}/wait", self.wait)
        r.add_get("/v1/snapshots/{id}/files", self.files)
        r.add_get("/v1/snapshots/{id}/files/{path:.+}", self.file)
        r.add_get("/v1/snapshots/{id}/tensors/{name}", self.tensor)
        return app

    def start(self) -> str:
        started = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                runner = web.AppRunner(self._app(), access_log=None)
                loop.run_until_complete(runner.setup())
                site = web.TCPSite(runner, "127.0.0.1", 0)
                loop.run_until_complete(site.start())
                if self.unix_path:
                    loop.run_until_complete(web.UnixSite(runner, self.unix_path).start())
                self._runner = runner
                host, port = runner.addresses[0][:2]
                self.url = f"http://{host}:{port}"
            except BaseException as exc:  # surfaced to the caller of start()
                errors.append(exc)
                started.set()
                return
            started.set()
            loop.run_forever()
            loop.run_until_complete(runner.cleanup())
            loop.close()

        self._thread = threading.Thread(target=run, name="fake-local-api", daemon=True)
        self._thread.start()
        started.wait(10)
        if errors:
            raise errors[0]
        return self.url

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

