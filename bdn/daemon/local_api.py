"""The local API: loopback TCP or a unix socket, for the engine and the operator on this node.

Endpoints and shapes are listed in README.md ("Local API"). Errors are a status code and a JSON
body ``{"error": "<one line>"}``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from bdn.daemon import metrics
from bdn.proto.errors import BdnError
from bdn.proto.identity import validate_identity, validate_relpath

if TYPE_CHECKING:
    from bdn.daemon.node import Node

NODE_KEY = web.AppKey("node", object)
MAX_WAIT_S = 300.0


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, text=json.dumps(obj), content_type="application/json")


def _error(status: int, msg: str, **extra: Any) -> web.Response:
    return _json({"error": msg, **extra}, status)


def _node(request: web.Request) -> Node:
    return request.app[NODE_KEY]  # type: ignore[return-value]


def _identity(request: web.Request) -> str:
    ident = request.match_info["identity"]
    try:
        return validate_identity(ident)
    except BdnError as e:
        raise web.HTTPBadRequest(text=json.dumps({"error": str(e)}), content_type="application/json") from None


def _ready_dir(request: web.Request) -> tuple[str, Path]:
    node = _node(request)
    ident = _identity(request)
    job = node.jobs.get(ident)
    if job is None:
        raise web.HTTPNotFound(text=json.dumps({"error": f"snapshot {ident!r} is not known to this daemon"}),
                               content_type="application/json")
    if job.state != "ready":
        raise web.HTTPConflict(text=json.dumps({"error": f"snapshot {ident!r} is {job.state}, not ready"}),
                               content_type="application/json")
    return ident, node.store.ready_dir(ident)


async def health(request: web.Request) -> web.Response:
    node = _node(request)
    return _json({"status": "ok", "node_id": node.node_id, "swarm_id": node.keys.swarm_id})


async def status(request: web.Request) -> web.Response:
    return _json(_node(request).status())


async def list_snapshots(request: web.Request) -> web.Response:
    return _json({"snapshots": [j.describe() for j in _node(request).jobs.values()]})


async def get_snapshot(request: web.Request) -> web.Response:
    node = _node(request)
    ident = _identity(request)
    job = node.jobs.get(ident)
    if job is None:
        return _error(404, f"snapshot {ident!r} is not known to this daemon (POST .../prefetch to load it)")
    return _json(job.describe())


async def prefetch(request: web.Request) -> web.Response:
    node = _node(request)
    ident = _identity(request)
    job = node.prefetch(ident)
    return _json(job.describe(), 202)


async def wait(request: web.Request) -> web.Response:
    node = _node(request)
    ident = _identity(request)
    state = request.query.get("state", "ready")
    if state not in ("queued", "downloading", "applying", "verifying", "ready"):
        return _error(400, f"state must be one of queued, downloading, applying, verifying, ready; got {state!r}")
    try:
        timeout = float(request.query.get("timeout", "30"))
    except ValueError:
        return _error(400, "timeout must be a number of seconds")
    if not 0 <= timeout <= MAX_WAIT_S:
        return _error(400, f"timeout must be in [0, {MAX_WAIT_S:g}] seconds")
    job = await node.wait_state(ident, state, timeout)
    if job is None:
        return _error(404, f"snapshot {ident!r} is not known to this daemon")
    if job.state == "failed":
        return _error(409, job.reason or "failed", snapshot=job.describe())
    return _json(job.describe(), 200 if job.state == state else 202)


async def list_files(request: web.Request) -> web.Response:
    ident, d = _ready_dir(request)
    job = _node(request).jobs[ident]
    assert job.manifest is not None
    return _json({"files": [{"path": f.path, "size": f.result_size} for f in job.manifest.files]})


async def get_file(request: web.Request) -> web.StreamResponse:
    ident, d = _ready_dir(request)
    try:
        rel = validate_relpath(request.match_info["path"])
    except BdnError as e:
        return _error(400, str(e))
    job = _node(request).jobs[ident]
    assert job.manifest is not None
    try:
        job.manifest.file(rel)
    except KeyError:
        return _error(404, f"snapshot {ident!r} has no file {rel!r}")
    return web.FileResponse(d / rel, headers={"Content-Type": "application/octet-stream"})


def _tensor_index(node: Node, ident: str, d: Path) -> dict[str, tuple[str, Any]]:
    job = node.jobs[ident]
    cache = job.__dict__.get("_tensor_index")
    if cache is None:
        from bdn.proto.safetensors_fmt import read_header

        cache = {}
        assert job.manifest is not None
        for f in job.manifest.files:
            if f.path.endswith(".safetensors"):
                h = read_header(d / f.path)
                for name, info in h.tensors.items():
                    cache.setdefault(name, (f.path, info))
        job.__dict__["_tensor_index"] = cache
    return cache


async def get_tensor(request: web.Request) -> web.StreamResponse:
    node = _node(request)
    ident, d = _ready_dir(request)
    name = request.match_info["name"]
    try:
        index = _tensor_index(node, ident, d)
    except BdnError as e:
        return _error(500, f"cannot read safetensors headers: {e}")
    hit = index.get(name)
    if hit is None:
        return _error(404, f"snapshot {ident!r} has no tensor {name!r}")
    path, info = hit
    resp = web.StreamResponse(
        headers={
            "Content-Type": "application/octet-stream",
            "X-BDN-Dtype": info.dtype,
            "X-BDN-Shape": ",".join(str(x) for x in info.shape),
            "X-BDN-File": path,
        }
    )
    resp.content_length = info.end - info.start
    await resp.prepare(request)
    with open(d / path, "rb") as f:
        f.seek(info.start)
        left = info.end - info.start
        while left > 0:
            piece = f.read(min(left, 8 << 20))
            if not piece:
                raise ConnectionResetError("tensor data shorter than its header says")
            await resp.write(piece)
            left -= len(piece)
    await resp.write_eof()
    return resp


async def get_metrics(request: web.Request) -> web.Response:
    body, ctype = metrics.render(_node(request))
    return web.Response(body=body, headers={"Content-Type": ctype})


def make_local_app(node: Node) -> web.Application:
    app = web.Application()
    app[NODE_KEY] = node
    r = app.router
    r.add_get("/v1/health", health)
    r.add_get("/v1/status", status)
    r.add_get("/v1/snapshots", list_snapshots)
    r.add_get("/v1/snapshots/{identity}", get_snapshot)
    r.add_post("/v1/snapshots/{identity}/prefetch", prefetch)
    r.add_get("/v1/snapshots/{identity}/wait", wait)
    r.add_get("/v1/snapshots/{identity}/files", list_files)
    r.add_get("/v1/snapshots/{identity}/files/{path:.+}", get_file)
    r.add_get("/v1/snapshots/{identity}/tensors/{name}", get_tensor)
    r.add_get("/metrics", get_metrics)
    return app


