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
from bdn.daemon.bodies import BodyTooLarge, read_body
from bdn.proto.errors import BdnError
from bdn.proto.identity import validate_identity, validate_relpath

if TYPE_CHECKING:
    from bdn.daemon.node import Node

NODE_KEY = web.AppKey("node", object)
MAX_WAIT_S = 300.0
MAX_BODY = 64 << 10


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
    """GET /v1/health -> 200 {"status": "ok", "node_id", "swarm_id"}."""
    node = _node(request)
    return _json({"status": "ok", "node_id": node.node_id, "swarm_id": node.keys.swarm_id})


async def status(request: web.Request) -> web.Response:
    """GET /v1/status -> 200: node, peers, bucket and byte counters, snapshot records."""
    return _json(_node(request).status())


async def list_snapshots(request: web.Request) -> web.Response:
    """GET /v1/snapshots -> 200 {"snapshots": [record, ...]}."""
    return _json({"snapshots": [j.describe() for j in _node(request).jobs.values()]})


async def get_snapshot(request: web.Request) -> web.Response:
    """GET /v1/snapshots/{id} -> 200 record; 400 bad identity; 404 unknown here."""
    node = _node(request)
    ident = _identity(request)
    job = node.jobs.get(ident)
    if job is None:
        return _error(404, f"snapshot {ident!r} is not known to this daemon (POST .../prefetch to load it)")
    return _json(job.describe())


async def prefetch(request: web.Request) -> web.Response:
    """POST /v1/snapshots/{id}/prefetch -> 202 record (the download starts or is already on)."""
    node = _node(request)
    ident = _identity(request)
    job = node.prefetch(ident)
    return _json(job.describe(), 202)


async def wait(request: web.Request) -> web.Response:
    """GET /v1/snapshots/{id}/wait?state=&timeout= (s, <= 300) -> 200 reached, 202 timed out, 409 failed."""
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
    """GET /v1/snapshots/{id}/files -> 200 {"files": [{"path", "size"}]}; 409 not ready."""
    ident, d = _ready_dir(request)
    job = _node(request).jobs[ident]
    assert job.manifest is not None
    return _json({"files": [{"path": f.path, "size": f.result_size} for f in job.manifest.files]})


async def get_file(request: web.Request) -> web.StreamResponse:
    """GET /v1/snapshots/{id}/files/{path} -> the file (Range supported); 404 no such file; 409 not ready."""
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
    """GET /v1/snapshots/{id}/tensors/{name} -> raw bytes; X-BDN-Dtype/Shape/File headers; 404 unknown tensor."""
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
    """GET /metrics -> Prometheus text exposition (see docs/OPERATIONS.md)."""
    body, ctype = metrics.render(_node(request))
    return web.Response(body=body, headers={"Content-Type": ctype})


# ---- fleet hot-load (also mounted on the peer port behind a bearer token) -----------------
async def hot_load_post(request: web.Request) -> web.Response:
    """POST /hot_load/v1/models/hot_load -> 200 accepted; 400/404/409/413/415/502 with one line."""
    from bdn.daemon.hotload import HotLoadError

    node = _node(request)
    try:
        body = await read_body(request.content, MAX_BODY, request.content_length)
    except BodyTooLarge as e:
        return _error(413, f"request {e}")
    try:
        ans = await node.hotload.accept(body)
    except HotLoadError as e:
        return _error(e.status, str(e))
    return _json(ans)


async def hot_load_get(request: web.Request) -> web.Response:
    """GET /hot_load/v1/models/hot_load -> 200 {"replicas": [...]} for the whole fleet."""
    return _json(await _node(request).hotload.fleet())


# ---- engines, leases, gc ------------------------------------------------------------------
async def _body_json(request: web.Request) -> dict[str, Any]:
    try:
        raw = await read_body(request.content, MAX_BODY, request.content_length)
    except BodyTooLarge as e:
        raise web.HTTPRequestEntityTooLarge(max_size=MAX_BODY, actual_size=request.content_length or MAX_BODY + 1,
                                            text=json.dumps({"error": f"request {e}"}), content_type="application/json") from None
    if not raw:
        return {}
    try:
        obj = json.loads(raw)
    except RecursionError:
        raise web.HTTPBadRequest(text=json.dumps({"error": "body is nested too deeply"}), content_type="application/json") from None
    except ValueError as e:
        raise web.HTTPBadRequest(text=json.dumps({"error": f"body is not JSON: {e}"}), content_type="application/json") from None
    if not isinstance(obj, dict):
        raise web.HTTPBadRequest(text=json.dumps({"error": "body must be a JSON object"}), content_type="application/json")
    return obj


def _engine(request: web.Request) -> Any:
    e = _node(request).hotload.engines.get(request.match_info["engine_id"])
    if e is None:
        raise web.HTTPNotFound(text=json.dumps({"error": "unknown engine id (register with POST /v1/engines)"}),
                               content_type="application/json")
    return e


async def register_engine(request: web.Request) -> web.Response:
    """POST /v1/engines {"name"} -> 201 {"engine_id"}."""
    body = await _body_json(request)
    name = body.get("name", "engine")
    if not isinstance(name, str):
        return _error(400, "name must be a string")
    e = _node(request).hotload.register_engine(name)
    return _json({"engine_id": e.engine_id}, 201)


async def unregister_engine(request: web.Request) -> web.Response:
    """DELETE /v1/engines/{id} -> 200; its leases are released; 404 unknown engine."""
    if not _node(request).hotload.unregister_engine(request.match_info["engine_id"]):
        return _error(404, "unknown engine id")
    return _json({"ok": True})


async def engine_next(request: web.Request) -> web.Response:
    """GET /v1/engines/{id}/next?after=&timeout= (s) -> 200 offer with a lease; 204 on timeout."""
    e = _engine(request)
    after = request.query.get("after") or None
    try:
        timeout = float(request.query.get("timeout", "30"))
    except ValueError:
        return _error(400, "timeout must be a number of seconds")
    if not 0 <= timeout <= MAX_WAIT_S:
        return _error(400, f"timeout must be in [0, {MAX_WAIT_S:g}] seconds")
    ans = await _node(request).hotload.next_for(e, after, timeout)
    if ans is None:
        return web.Response(status=204)
    return _json(ans)


async def engine_ack(request: web.Request) -> web.Response:
    """POST /v1/engines/{id}/ack {"identity", "pause_ms" (ms), "error"?} -> 200; 409 never offered."""
    e = _engine(request)
    body = await _body_json(request)
    ident, pause, err = body.get("identity"), body.get("pause_ms"), body.get("error")
    try:
        validate_identity(ident)
    except BdnError as ex:
        return _error(400, f"identity: {ex}")
    if pause is not None and (isinstance(pause, bool) or not isinstance(pause, (int, float)) or pause < 0):
        return _error(400, "pause_ms must be a non-negative number")
    if err is not None and not isinstance(err, str):
        return _error(400, "error must be a string")
    if e.offered != ident and e.acked != ident:
        return _error(409, f"engine was not offered {ident!r} (offered {e.offered!r})")
    await _node(request).hotload.ack(e, ident, float(pause) if pause is not None else None, err)
    return _json({"ok": True})


async def take_lease(request: web.Request) -> web.Response:
    """POST /v1/snapshots/{id}/leases {"holder"} -> 201 {"lease_id"}; 409 not ready."""
    from bdn.daemon.hotload import HotLoadError

    ident = _identity(request)
    body = await _body_json(request)
    holder = body.get("holder", "")
    if not isinstance(holder, str):
        return _error(400, "holder must be a string")
    try:
        lid = _node(request).hotload.lease(ident, holder)
    except HotLoadError as e:
        return _error(e.status, str(e))
    return _json({"lease_id": lid, "identity": ident}, 201)


async def drop_lease(request: web.Request) -> web.Response:
    """DELETE /v1/leases/{lease_id} -> 200; 404 unknown lease."""
    if not _node(request).hotload.release(request.match_info["lease_id"]):
        return _error(404, "unknown lease id")
    return _json({"ok": True})


async def run_gc(request: web.Request) -> web.Response:
    """POST /v1/gc -> 200 {"removed": [...], "kept": [...]}."""
    return _json(_node(request).gc())


def make_local_app(node: Node) -> web.Application:
    """The local API application (bind it to loopback or a unix socket only: it has no auth)."""
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
    r.add_post("/hot_load/v1/models/hot_load", hot_load_post)
    r.add_get("/hot_load/v1/models/hot_load", hot_load_get)
    r.add_post("/v1/engines", register_engine)
    r.add_delete("/v1/engines/{engine_id}", unregister_engine)
    r.add_get("/v1/engines/{engine_id}/next", engine_next)
    r.add_post("/v1/engines/{engine_id}/ack", engine_ack)
    r.add_post("/v1/snapshots/{identity}/leases", take_lease)
    r.add_delete("/v1/leases/{lease_id}", drop_lease)
    r.add_post("/v1/gc", run_gc)
    return app


