"""The swarm's HTTP endpoints, under ``/bdn/v1/{swarm_id}`` (FORMATS.md, "Peer protocol"): membership,
have-lists, hot-load targets, status and bad-chunk reports. No chunk bytes: those move only over
the transfer wire (``bdn.daemon.serve.wire_peer``).

- ``GET snapshots/{identity}/have[?since=V&wait=S]``: msgpack ``{v, state, ns, stored, nr,
  result}`` with bitfields over the manifest's stored and reconstructed chunk lists; long-polls
  until the version differs from ``since``.
- ``POST members``: one SWIM message, msgpack ``{"m": message}`` in, ``{node_id, url, m: [replies]}``
  out (``bdn.daemon.swarm.gossip``).
- ``POST hot_load`` (msgpack target, pushed by gossip), ``GET replica``.
- ``POST status`` (a replica's row to an aggregator), ``GET status?identity=`` (an aggregator's rows).
- ``POST bad_chunk`` (msgpack ``{address, snapshot}``, at most 1 KiB): the asker got bytes from
  this node that do not match the chunk's digest; 202 the chunk is re-hashed here (the report
  is not trusted, ``bdn.daemon.serve.chunkcheck``), 503 too many reports queued, 400 malformed.

Every request must carry a valid ``BDN-HMAC`` signature made for this daemon's node id; anything
else (including an unknown swarm id) gets 401 with an empty body, so a stranger learns nothing
about what the partition holds. A valid signature for another daemon gets 401 with this
daemon's node id in ``X-BDN-Node`` (the signer then signs again for it).
The fleet hot-load API is mounted here too, behind a bearer token (``http/hotload.py``).
"""

from __future__ import annotations

import logging
import re
from typing import Any

import msgpack
from aiohttp import web
from aiohttp.typedefs import Handler

from bdn.daemon.errors import NotAvailable
from bdn.daemon.http import hotload
from bdn.daemon.http.common import BodyIncomplete, request_body, text
from bdn.daemon.http.services import SERVICES, Services, services
from bdn.daemon.observe import logctx
from bdn.daemon.observe.bodies import BodyTooLarge
from bdn.daemon.observe.packing import packb
from bdn.proto.errors import AuthError, BdnError
from bdn.proto.identity import validate_identity
from bdn.proto.keys import NODE_HEADER, WrongTarget, verify_request

log = logging.getLogger("bdn.http.peer")
ADDRESS_RE = re.compile(r"\A[0-9a-f]{32}\Z")
MAX_MEMBERS_BODY = 1 << 20
MAX_TARGET_BODY = 64 << 10
MAX_REPORT_BODY = 1 << 10
MAX_WAIT_S = 60.0


@web.middleware
async def _auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    svc = services(request)
    if request.path == hotload.PATH and request.method in ("GET", "POST"):
        return await handler(request)  # bearer-token checked by the handler
    if request.match_info.get("swarm_id") != svc.keys.swarm_id:
        return web.Response(status=401)
    try:
        peer = verify_request(
            svc.keys,
            request.headers.get("Authorization"),
            request.method,
            request.raw_path,
            svc.nonces,
            me=svc.cfg.node_id,
        )
    except WrongTarget as e:
        # Signed with the partition's key, but for another daemon (or for "not known yet"): say
        # who this is, so a member can sign again for it. A replayed capture learns a node id.
        return web.Response(status=401, headers={NODE_HEADER: e.me})
    except AuthError:
        return web.Response(status=401)
    request["peer"] = peer
    logctx.PEER.set(peer)  # aiohttp runs each request in its own task: this names the peer in its logs
    return await handler(request)


def _float_arg(request: web.Request, name: str, default: float, hi: float) -> float:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        v = float(raw)
    except ValueError:
        raise web.HTTPBadRequest(text=f"{name} must be a number\n") from None
    if not 0 <= v <= hi:
        raise web.HTTPBadRequest(text=f"{name} must be in [0, {hi:g}]\n")
    return v


async def get_have(request: web.Request) -> web.Response:
    """GET snapshots/{identity}/have[?since=V&wait=S] -> 200 msgpack bitfields; 404 unknown here."""
    identity = request.match_info["identity"]
    try:
        validate_identity(identity)
    except BdnError as e:
        return text(400, str(e))
    since = request.query.get("since", "-1")
    if not re.fullmatch(r"-?\d{1,18}", since):
        return text(400, "since must be an integer")
    wait = _float_arg(request, "wait", 0.0, MAX_WAIT_S)
    have = await services(request).catalog.have(identity, int(since), wait)
    if have is None:
        return text(404, "snapshot not known here")
    return web.Response(body=packb(have), content_type="application/msgpack")


async def post_members(request: web.Request) -> web.Response:
    """POST members (msgpack {"m": SWIM message}) -> 200 {node_id, url, m: replies}; 400/413 malformed."""
    try:
        body = await request_body(request, MAX_MEMBERS_BODY)
    except BodyTooLarge as e:
        return text(413, f"members {e}")
    except BodyIncomplete as e:
        return text(e.status, f"members {e}")
    try:
        obj = msgpack.unpackb(body, raw=False)
        ans = await services(request).gossip.handle(obj, request["peer"])
    except (ValueError, msgpack.UnpackException, BdnError, RecursionError) as e:
        return text(400, f"members body is malformed: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    return web.Response(body=packb(ans), content_type="application/msgpack")


_NOT_MSGPACK = object()


async def _msgpack_body(request: web.Request, limit: int) -> Any:
    """The request body decoded as msgpack, or ``_NOT_MSGPACK``; BodyTooLarge past ``limit`` bytes,
    BodyIncomplete when it trickles in."""
    body = await request_body(request, limit)
    try:
        return msgpack.unpackb(body, raw=False)
    except (ValueError, msgpack.UnpackException, RecursionError):
        return _NOT_MSGPACK


async def post_hot_load_peer(request: web.Request) -> web.Response:
    """POST hot_load (msgpack target) -> 200 {"ok": true}; 400 malformed, or its policy version or
    publish time contradicts the manifest read here (``replica/claims.py``); 413 too large."""
    try:
        obj = await _msgpack_body(request, MAX_TARGET_BODY)
    except BodyTooLarge as e:
        return text(413, f"hot-load {e}")
    except BodyIncomplete as e:
        return text(e.status, f"hot-load {e}")
    obj = None if obj is _NOT_MSGPACK else obj
    try:
        await services(request).hotload.from_peer(obj, request["peer"])
    except BdnError as e:
        return text(400, str(e))
    return web.Response(body=packb({"ok": True}), content_type="application/msgpack")


async def get_hot_load_peer(request: web.Request) -> web.Response:
    """GET hot_load -> 200 {"target": this daemon's hot-load target as the wire carries it, or
    null}: what a member asks before it accepts a hot-load POST (``HotLoad.catch_up``)."""
    hotload = services(request).hotload
    hotload.stats.control_request("received", "hot_load_pull")
    return web.json_response(hotload.current_wire())


async def post_status(request: web.Request) -> web.Response:
    """POST status (msgpack {identity, row}: a replica's report to an aggregator) -> 200; 400/413."""
    try:
        obj = await _msgpack_body(request, MAX_TARGET_BODY)
    except BodyTooLarge as e:
        return text(413, f"status report {e}")
    except BodyIncomplete as e:
        return text(e.status, f"status report {e}")
    obj = None if obj is _NOT_MSGPACK else obj
    try:
        services(request).hotload.status.received(obj, request["peer"])
    except NotAvailable as e:
        return text(503, str(e))
    except BdnError as e:
        return text(400, str(e))
    return web.Response(body=packb({"ok": True}), content_type="application/msgpack")


async def get_status(request: web.Request) -> web.Response:
    """GET status?identity=ID -> 200 JSON {"rows": [...]}: the replicas this aggregator holds."""
    try:
        ident = validate_identity(request.query.get("identity"))
    except BdnError as e:
        return text(400, str(e))
    return web.json_response({"rows": services(request).hotload.status.rows_for(ident)})


async def post_bad_chunk(request: web.Request) -> web.Response:
    """POST bad_chunk (msgpack {address, snapshot}) -> 202 queued for a re-hash; 400; 413; 503 full."""
    try:
        obj = await _msgpack_body(request, MAX_REPORT_BODY)
    except BodyTooLarge as e:
        return text(413, f"bad_chunk {e}")
    except BodyIncomplete as e:
        return text(e.status, f"bad_chunk {e}")
    if obj is _NOT_MSGPACK:
        return text(400, "bad_chunk body is not msgpack")
    address = obj.get("address") if isinstance(obj, dict) else None
    if not isinstance(address, str) or not ADDRESS_RE.match(address):
        return text(400, "bad_chunk address must be 32 lowercase hex characters")
    if not services(request).checks.reported(request["peer"], address):
        return web.Response(status=503, headers={"Retry-After": "5"}, text="too many chunk reports queued\n")
    return text(202, "chunk queued for a re-hash")


async def get_replica(request: web.Request) -> web.Response:
    """GET replica -> 200 this replica as the hot-load GET lists it (JSON)."""
    return web.json_response(services(request).replica.replica())


def make_peer_app(svc: Services) -> web.Application:
    """The peer server's application (bind it to ``peer_listen``).

    Two kinds of callers reach this port: peers (every ``/bdn/v1/{swarm_id}/...`` request signed
    with the partition's auth key) and the trainer (the fleet hot-load API, bearer token). Any
    other path answers 401 like a bad signature.
    """
    app = web.Application(middlewares=[_auth], client_max_size=1 << 20)
    app[SERVICES] = svc
    p = "/bdn/v1/{swarm_id}"
    app.router.add_get(p + "/snapshots/{identity}/have", get_have)
    app.router.add_post(p + "/members", post_members)
    app.router.add_post(p + "/hot_load", post_hot_load_peer)
    app.router.add_get(p + "/hot_load", get_hot_load_peer)
    app.router.add_get(p + "/replica", get_replica)
    app.router.add_post(p + "/status", post_status)
    app.router.add_get(p + "/status", get_status)
    app.router.add_post(p + "/bad_chunk", post_bad_chunk)
    app.router.add_route("POST", hotload.PATH, hotload.public)
    app.router.add_route("GET", hotload.PATH, hotload.public)
    return app
