"""The local API: loopback TCP or a unix socket, for the engine and the operator on this node.

Endpoints and shapes are listed in README.md ("Local API"). Errors are a status code and a JSON
body ``{"error": "<one line>"}``; the status of a domain error comes from ``http/errors.py``.
Each handler parses the request, calls one service and maps the answer; nothing else.
"""

from __future__ import annotations

import json
import math
from typing import Any

from aiohttp import web

from bdn.daemon.http import hotload
from bdn.daemon.http.common import MAX_BODY, BodyIncomplete, error, json_response, json_route_errors, request_body
from bdn.daemon.http.errors import status_of
from bdn.daemon.http.sendfile import RangeNotSatisfiable, byte_range, send_file
from bdn.daemon.http.services import SERVICES, Services, services
from bdn.daemon.observe.bodies import BodyTooLarge
from bdn.daemon.replica.engines import Engine
from bdn.proto.errors import BdnError
from bdn.proto.identity import validate_identity, validate_relpath
from bdn.proto.states import WAITABLE

MAX_WAIT_S = 300.0


def _identity(request: web.Request) -> str:
    try:
        return validate_identity(request.match_info["identity"])
    except BdnError as e:
        raise web.HTTPBadRequest(text=json.dumps({"error": str(e)}), content_type="application/json") from None


def _timeout(request: web.Request, name: str = "timeout", most: float = MAX_WAIT_S) -> float | web.Response:
    try:
        timeout = float(request.query.get(name, "30"))
    except ValueError:
        return error(400, f"{name} must be a number of seconds")
    if not 0 <= timeout <= most:  # (NaN fails too)
        return error(400, f"{name} must be in [0, {most:g}] seconds")
    return timeout


async def health(request: web.Request) -> web.Response:
    """GET /v1/health -> 200 {"status": "ok", "node_id", "swarm_id"}."""
    return json_response(services(request).status.health())


async def ready(request: web.Request) -> web.Response:
    """GET /v1/ready -> 200 {"ready": true, "reasons": [], "warnings", "waiting_for", "node_id"},
    or 503 with the reasons (bdn.daemon.observe.readiness: both ports listening, the bucket reachable and
    not empty, the target loading, nothing misconfigured)."""
    doc = await services(request).readiness.check()
    return json_response(doc, 200 if doc["ready"] else 503)


async def status(request: web.Request) -> web.Response:
    """GET /v1/status -> 200: node, readiness (as /v1/ready), peers, bucket and byte counters,
    snapshot records."""
    svc = services(request)
    return json_response({**svc.status.status(), "readiness": await svc.readiness.check()})


async def list_snapshots(request: web.Request) -> web.Response:
    """GET /v1/snapshots -> 200 {"snapshots": [record, ...]}."""
    return json_response({"snapshots": services(request).catalog.records()})


async def get_snapshot(request: web.Request) -> web.Response:
    """GET /v1/snapshots/{id} -> 200 record; 400 bad identity; 404 unknown here."""
    try:
        return json_response(services(request).catalog.record(_identity(request)))
    except BdnError as e:
        return error(status_of(e), str(e))


#: How long a prefetch answer waits for the job's first look at the bucket (a manifest read and,
#: when absent, one listing: milliseconds unless the bucket is retrying); past it, 202 as queued.
PREFETCH_LOOK_S = 10.0  # well below bdn.client's 30 s read timeout


async def prefetch(request: web.Request) -> web.Response:
    """POST /v1/snapshots/{id}/prefetch[?wait_publish=1][&publish_timeout=S] -> 202 record once
    the daemon has looked at the bucket (at most ``PREFETCH_LOOK_S``): the download started, or
    the snapshot waits for its manifest (the reason says so), or it failed at once (state
    ``failed`` with the reason: nothing in the bucket under the identity unless
    ``wait_publish=1``, which waits up to ``manifest_wait_s``, or ``publish_timeout`` seconds
    when the asker gives up sooner; a manifest refused; no room in shm). 400 for a bad ``publish_timeout``."""
    wait_publish = request.query.get("wait_publish", "0") in ("1", "true", "yes")
    bound = _timeout(request, "publish_timeout", 1e9) if "publish_timeout" in request.query else None
    if isinstance(bound, web.Response):
        return bound
    job = await services(request).catalog.prefetch_looked(_identity(request), wait_publish, PREFETCH_LOOK_S, bound)
    return json_response(job.describe(), 202)


async def cancel_snapshot(request: web.Request) -> web.Response:
    """DELETE /v1/snapshots/{id} -> 200 record (a load in progress is cancelled: failed,
    reason "cancelled by the operator", and forgotten like any failed record; a ready one is
    left to GC); 404 unknown here."""
    try:
        job = await services(request).catalog.delete(_identity(request))
    except BdnError as e:
        return error(status_of(e), str(e))
    return json_response(job.describe())


async def wait(request: web.Request) -> web.Response:
    """GET /v1/snapshots/{id}/wait?state=&timeout= (s, <= 300) -> 200 reached, 202 timed out, 409 failed."""
    ident = _identity(request)
    state = request.query.get("state", "ready")
    if state not in WAITABLE:
        return error(400, f"state must be one of {', '.join(WAITABLE)}; got {state!r}")
    timeout = _timeout(request)
    if isinstance(timeout, web.Response):
        return timeout
    job = await services(request).catalog.wait_state(ident, state, timeout)
    if job is None:
        return error(404, f"snapshot {ident!r} is not known to this daemon")
    if job.state == "failed":
        return error(409, job.reason or "failed", snapshot=job.describe())
    return json_response(job.describe(), 200 if job.state == state else 202)


async def list_files(request: web.Request) -> web.Response:
    """GET /v1/snapshots/{id}/files -> 200 {"files": [{"path", "size"}]}; 409 not ready."""
    ident = _identity(request)
    try:
        body = await services(request).catalog.files_json(ident)
        return web.Response(body=body, content_type="application/json")
    except BdnError as e:
        return error(status_of(e), str(e))


async def get_file(request: web.Request) -> web.StreamResponse:
    """GET /v1/snapshots/{id}/files/{path} -> the file (Range supported); 404 no such file; 409 not ready."""
    ident = _identity(request)
    cat = services(request).catalog
    try:
        cat.ready(ident)
    except BdnError as e:
        return error(status_of(e), str(e))
    try:
        rel = validate_relpath(request.match_info["path"])
        path = cat.file(ident, rel)
        size = cat.file_size(ident, rel)  # the snapshot's, never the disk's (a file truncated here)
        rng = byte_range(request, size)
    except BdnError as e:
        return error(status_of(e), str(e))
    except RangeNotSatisfiable as e:
        return web.json_response({"error": str(e)}, status=416, headers={"Content-Range": f"bytes */{size}"})
    headers = {"Content-Type": "application/octet-stream", "Accept-Ranges": "bytes"}
    start, length, code = (0, size, 200) if rng is None else (*rng, 206)
    if rng is not None:
        headers["Content-Range"] = f"bytes {start}-{start + length - 1}/{size}"
    return await _send(request, ident, path, start, length, code, headers, size)


async def _send(
    request: web.Request, ident: str, path: Any, start: int, length: int, code: int, headers: dict[str, str], size: int
) -> web.StreamResponse:
    """send_file, its refusals mapped: 404 no such file, 500 a file changed on this node."""
    try:
        return await send_file(request, path, start, length, status=code, headers=headers, file_size=size)
    except FileNotFoundError:
        return error(404, f"snapshot {ident}: {path.name}: No such file or directory on this node")
    except OSError as e:  # FileChanged, or another reason it cannot be opened
        return error(500, f"snapshot {ident}: {e.strerror or e}; not served (POST /v1/snapshots/{ident}/repair)")


async def get_tensor(request: web.Request) -> web.StreamResponse:
    """GET /v1/snapshots/{id}/tensors/{name} -> raw bytes; X-BDN-Dtype/Shape/File headers; 404 unknown tensor."""
    ident = _identity(request)
    cat = services(request).catalog
    try:
        cat.ready(ident)
    except BdnError as e:
        return error(status_of(e), str(e))
    name = request.match_info["name"]
    try:
        path, fname, info = await cat.tensor(ident, name)
    except BdnError as e:
        if status_of(e) == 500:
            return error(500, f"cannot read safetensors headers: {e}")
        return error(status_of(e), str(e))
    headers = {
        "Content-Type": "application/octet-stream",
        "X-BDN-Dtype": info.dtype,
        "X-BDN-Shape": ",".join(str(x) for x in info.shape),
        "X-BDN-File": fname,
    }
    return await _send(
        request, ident, path, info.start, info.end - info.start, 200, headers, cat.file_size(ident, fname)
    )


async def repair(request: web.Request) -> web.Response:
    """POST /v1/snapshots/{id}/repair -> 200 {identity, chunks, corrupted: [{path, chunk, offset,
    length}], state, reason}: the ready snapshot re-hashed; corrupted chunks are quarantined and
    fetched again (state ``downloading`` until it is ``ready`` again). 404 unknown, 409 not ready."""
    identity = _identity(request)
    try:
        ans = await services(request).catalog.repair(identity)
    except BdnError as e:
        return error(status_of(e), str(e))
    return json_response(ans)


async def get_metrics(request: web.Request) -> web.Response:
    """GET /metrics -> Prometheus text exposition (see docs/OPERATIONS.md)."""
    body, ctype = services(request).metrics.render()
    return web.Response(body=body, headers={"Content-Type": ctype})


# ---- engines, leases, gc ------------------------------------------------------------------
async def _body_json(request: web.Request) -> dict[str, Any]:
    try:
        raw = await request_body(request, MAX_BODY)
    except BodyIncomplete as e:
        answer = web.HTTPRequestTimeout if e.status == 408 else web.HTTPBadRequest
        raise answer(text=json.dumps({"error": str(e)}), content_type="application/json") from None
    except BodyTooLarge as e:
        raise web.HTTPRequestEntityTooLarge(
            max_size=MAX_BODY,
            actual_size=request.content_length or MAX_BODY + 1,
            text=json.dumps({"error": f"request {e}"}),
            content_type="application/json",
        ) from None
    if not raw:
        return {}
    try:
        obj = json.loads(raw, parse_constant=_not_a_number)
    except RecursionError:
        raise web.HTTPBadRequest(
            text=json.dumps({"error": "body is nested too deeply"}), content_type="application/json"
        ) from None
    except ValueError as e:
        raise web.HTTPBadRequest(
            text=json.dumps({"error": f"body is not JSON: {e}"}), content_type="application/json"
        ) from None
    if not isinstance(obj, dict):
        raise web.HTTPBadRequest(
            text=json.dumps({"error": "body must be a JSON object"}), content_type="application/json"
        )
    _check_utf8(obj)
    return obj


def _check_utf8(obj: Any) -> None:
    """Refuse a body whose strings hold a lone surrogate (``"\\udc80"``): ``json.loads`` accepts
    the escape, but such a string is not Unicode text (RFC 8259 section 8.2), and an engine's
    error or name holding one could not be sent on: every msgpack status report of this replica
    failed on it (tests/test_adversarial_local.py)."""
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise web.HTTPBadRequest(
            text=json.dumps(
                {"error": f"body holds a lone surrogate \\u{ord(e.object[e.start]):04x} in a string (not Unicode text)"}
            ),
            content_type="application/json",
        ) from None


def _not_a_number(name: str) -> None:
    """``json.loads`` accepts ``NaN`` and ``Infinity``, which JSON (RFC 8259) does not; refuse them."""
    raise ValueError(f"{name} is not a JSON number")


def _as_float(x: int | float) -> float:
    """``x`` as a float; an int too large for one (JSON allows 4,300 digits) is ``inf``."""
    try:
        return float(x)
    except OverflowError:
        return math.inf


def _engine(request: web.Request) -> Engine:
    e = services(request).replica.engine(request.match_info["engine_id"])
    if e is None:
        raise web.HTTPNotFound(
            text=json.dumps({"error": "unknown engine id (register with POST /v1/engines)"}),
            content_type="application/json",
        )
    return e


async def current(request: web.Request) -> web.Response:
    """GET /v1/current -> 200 {"identity", "policy_version", "path", "link"}; 404 nothing served yet."""
    rec = services(request).replica.current_record()
    if rec is None:
        return error(404, "this replica serves no snapshot yet")
    return json_response(rec)


async def register_engine(request: web.Request) -> web.Response:
    """POST /v1/engines {"name", "serving"?} -> 201 {"engine_id", "serving"} (``serving``: the
    identity the engine already serves, taken as acknowledged when it is ready here, else null)."""
    body = await _body_json(request)
    name, serving = body.get("name", "engine"), body.get("serving")
    if not isinstance(name, str):
        return error(400, "name must be a string")
    if serving is not None:
        try:
            serving = validate_identity(serving)
        except BdnError as ex:
            return error(400, f"serving: {ex}")
    replica = services(request).replica
    try:
        e = replica.register_engine(name, serving)
    except BdnError as err:
        return error(status_of(err), str(err))
    await replica.poke()
    return json_response({"engine_id": e.engine_id, "serving": e.acked}, 201)


async def unregister_engine(request: web.Request) -> web.Response:
    """DELETE /v1/engines/{id} -> 200; its leases are released; 404 unknown engine."""
    replica = services(request).replica
    engine_id = request.match_info["engine_id"]
    if not replica.unregister_engine(engine_id):
        return error(404, f"unknown engine id {engine_id[:80]!r} (GET /v1/engines, or bdnctl engines, lists them)")
    await replica.poke()
    return json_response({"ok": True})


async def list_engines(request: web.Request) -> web.Response:
    """GET /v1/engines -> 200 {"engine_ttl_s", "engine_stale_s", "engines": [{"engine_id", "name", "serving", "stale", ...}]}."""
    replica = services(request).replica
    return json_response(
        {
            "engine_ttl_s": replica.engine_ttl_s,
            "engine_stale_s": replica.engine_stale_s,
            "engines": replica.describe_engines(),
        }
    )


async def engine_next(request: web.Request) -> web.Response:
    """GET /v1/engines/{id}/next?after=&timeout= (s)&serving=? -> 200 offer with a lease; 204 on
    timeout; 400 a ``serving`` that is no identity."""
    e = _engine(request)
    after, serving = request.query.get("after") or None, request.query.get("serving") or None
    if serving is not None:
        try:
            serving = validate_identity(serving)
        except BdnError as ex:
            return error(400, f"serving: {ex}")
    timeout = _timeout(request)
    if isinstance(timeout, web.Response):
        return timeout

    def connected() -> bool:  # a poll on a closed connection no longer keeps its engine alive
        t = request.transport
        return t is not None and not t.is_closing()

    ans = await services(request).replica.next_for(e, after, timeout, connected, serving)
    if ans is None:
        return web.Response(status=204)
    return json_response(ans)


async def engine_ack(request: web.Request) -> web.Response:
    """POST /v1/engines/{id}/ack {"identity", "pause_ms" (ms), "error"?, "prompt_cache_policy"?,
    "inflight_policy"?, "swap"?} -> 200; 409 never offered."""
    e = _engine(request)
    body = await _body_json(request)
    ident, pause, err = body.get("identity"), body.get("pause_ms"), body.get("error")
    swap, pcp, ifp = body.get("swap"), body.get("prompt_cache_policy"), body.get("inflight_policy")
    if swap is not None and not isinstance(swap, dict):
        return error(400, "swap must be an object")
    if not all(v is None or isinstance(v, str) for v in (pcp, ifp)):
        return error(400, "prompt_cache_policy and inflight_policy must be strings")
    try:
        ident = validate_identity(ident)
    except BdnError as ex:
        return error(400, f"identity: {ex}")
    if pause is not None and (
        isinstance(pause, bool) or not isinstance(pause, (int, float)) or not 0 <= _as_float(pause) < math.inf
    ):
        return error(400, "pause_ms must be a finite non-negative number")
    if err is not None and not isinstance(err, str):
        return error(400, "error must be a string")
    try:
        await services(request).replica.ack(e, ident, float(pause) if pause is not None else None, err, swap, pcp, ifp)
    except BdnError as ex:
        return error(status_of(ex), str(ex))
    return json_response({"ok": True})


async def engine_heartbeat(request: web.Request) -> web.Response:
    """POST /v1/engines/{id}/heartbeat -> 200 {"engine_ttl_s", "engine_stale_s"}: the engine is alive (while it prepares); 404 dropped."""
    e = _engine(request)
    replica = services(request).replica
    await replica.heartbeat(e)
    return json_response({"ok": True, "engine_ttl_s": replica.engine_ttl_s, "engine_stale_s": replica.engine_stale_s})


async def take_lease(request: web.Request) -> web.Response:
    """POST /v1/snapshots/{id}/leases {"holder"} -> 201 {"lease_id"}; 409 not ready."""
    ident = _identity(request)
    body = await _body_json(request)
    holder = body.get("holder", "")
    if not isinstance(holder, str):
        return error(400, "holder must be a string")
    try:
        lid = services(request).replica.lease(ident, holder)
    except BdnError as e:
        return error(status_of(e), str(e))
    return json_response({"lease_id": lid, "identity": ident}, 201)


async def drop_lease(request: web.Request) -> web.Response:
    """DELETE /v1/leases/{lease_id} -> 200; 404 unknown lease."""
    if not services(request).replica.release(request.match_info["lease_id"]):
        return error(404, "unknown lease id")
    return json_response({"ok": True})


async def run_gc(request: web.Request) -> web.Response:
    """POST /v1/gc -> 200 {"removed": [...], "kept": [...]}."""
    return json_response(services(request).catalog.gc())


def make_local_app(svc: Services) -> web.Application:
    """The local API application (bind it to loopback or a unix socket only: it has no auth)."""
    app = web.Application(middlewares=[json_route_errors])
    app[SERVICES] = svc
    r = app.router
    r.add_get("/v1/health", health)
    r.add_get("/v1/ready", ready)
    r.add_get("/v1/status", status)
    r.add_get("/v1/snapshots", list_snapshots)
    r.add_get("/v1/snapshots/{identity}", get_snapshot)
    r.add_delete("/v1/snapshots/{identity}", cancel_snapshot)
    r.add_post("/v1/snapshots/{identity}/prefetch", prefetch)
    r.add_get("/v1/snapshots/{identity}/wait", wait)
    r.add_get("/v1/snapshots/{identity}/files", list_files)
    r.add_get("/v1/snapshots/{identity}/files/{path:.+}", get_file)
    r.add_get("/v1/snapshots/{identity}/tensors/{name}", get_tensor)
    r.add_post("/v1/snapshots/{identity}/repair", repair)
    r.add_get("/metrics", get_metrics)
    r.add_post(hotload.PATH, hotload.post)
    r.add_get(hotload.PATH, hotload.get)
    r.add_get("/v1/current", current)
    r.add_post("/v1/engines", register_engine)
    r.add_get("/v1/engines", list_engines)
    r.add_delete("/v1/engines/{engine_id}", unregister_engine)
    r.add_get("/v1/engines/{engine_id}/next", engine_next)
    r.add_post("/v1/engines/{engine_id}/ack", engine_ack)
    r.add_post("/v1/engines/{engine_id}/heartbeat", engine_heartbeat)
    r.add_post("/v1/snapshots/{identity}/leases", take_lease)
    r.add_delete("/v1/leases/{lease_id}", drop_lease)
    r.add_post("/v1/gc", run_gc)
    return app
