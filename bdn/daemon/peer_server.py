"""The swarm's HTTP endpoints, under ``/bdn/v1/{swarm_id}`` (DESIGN.md, "Moving chunks").

- ``GET chunks/{address}[?wait=S&snapshot=ID]``: 200 the chunk's bytes (only verified chunks are
  ever indexed), 404 not here, 503 + ``Retry-After`` when upload slots are full.
- ``GET snapshots/{identity}/have[?since=V&wait=S]``: msgpack ``{v, state, ns, stored, nr,
  result}`` with bitfields over the manifest's stored and reconstructed chunk lists; long-polls
  until the version differs from ``since``.
- ``POST members``: msgpack ``{node_id, url, members}`` in, the same shape out.

Every request must carry a valid ``BDN-HMAC`` signature; anything else (including an unknown swarm
id) gets 401 with an empty body, so a stranger learns nothing about what the partition holds.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from typing import TYPE_CHECKING, Any

import msgpack
from aiohttp import web

from bdn.daemon.bodies import BodyTooLarge, read_body
from bdn.proto.errors import AuthError, BdnError
from bdn.proto.identity import validate_identity
from bdn.proto.keys import verify_request

if TYPE_CHECKING:
    from bdn.daemon.node import Node

log = logging.getLogger("bdn.peer_server")
ADDRESS_RE = re.compile(r"\A[0-9a-f]{32}\Z")
MAX_MEMBERS_BODY = 1 << 20
MAX_WAIT_S = 60.0
NODE_KEY = web.AppKey("node", object)


def _text(status: int, msg: str) -> web.Response:
    return web.Response(status=status, text=msg + "\n")


HOT_LOAD_PATH = "/hot_load/v1/models/hot_load"


@web.middleware
async def _auth(request: web.Request, handler):  # type: ignore[no-untyped-def]
    node: Node = request.app[NODE_KEY]  # type: ignore[assignment]
    if request.path == HOT_LOAD_PATH and request.method in ("GET", "POST"):
        return await handler(request)  # bearer-token checked by the handler
    if request.match_info.get("swarm_id") != node.keys.swarm_id:
        return web.Response(status=401)
    try:
        peer = verify_request(
            node.keys, request.headers.get("Authorization"), request.method, request.raw_path, node.nonces
        )
    except AuthError:
        return web.Response(status=401)
    request["peer"] = peer
    from bdn.daemon.logctx import PEER

    PEER.set(peer)  # aiohttp runs each request in its own task: this names the peer in its logs
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


async def get_chunk(request: web.Request) -> web.StreamResponse:
    """GET chunks/{address}[?wait=S&snapshot=ID] -> 200 bytes, 404 not here, 503 + Retry-After busy."""
    node: Node = request.app[NODE_KEY]  # type: ignore[assignment]
    address = request.match_info["address"]
    if not ADDRESS_RE.match(address):
        return _text(400, "chunk address must be 32 lowercase hex characters")
    wait = _float_arg(request, "wait", 0.0, MAX_WAIT_S)
    hint = request.query.get("snapshot")
    if hint is not None:
        try:
            validate_identity(hint)
        except BdnError as e:
            return _text(400, str(e))
    loc = node.lookup(address)
    if loc is None and wait > 0:
        loc = await node.wait_for_address(address, wait, hint)
    if loc is None:
        if wait > 0 and node.fetching(address):
            # still being fetched here: "busy, ask again", so the asker keeps waiting for this
            # live owner instead of counting a failure and reading the bucket itself
            return web.Response(status=503, headers={"Retry-After": "1"}, text="still fetching\n")
        return _text(404, "chunk not here")
    if node.upload_sem.locked():
        return web.Response(status=503, headers={"Retry-After": "1"}, text="upload slots full\n")
    if node.uploads_by_address.get(address, 0) >= node.cfg.uploads_per_chunk:
        # This chunk is already going out to enough peers: the next asker takes it from one of
        # them (they serve it as soon as it is verified), so chunks spread as a tree rather than
        # every copy leaving the owner's uplink.
        return web.Response(status=503, headers={"Retry-After": "0.2"}, text="chunk already uploading\n")
    async with node.upload_sem:
        node.inflight["upload"] += 1
        node.uploads_by_address[address] = node.uploads_by_address.get(address, 0) + 1
        try:
            return await _send_chunk(request, node, address, loc)
        finally:
            node.inflight["upload"] -= 1
            left = node.uploads_by_address[address] - 1
            if left:
                node.uploads_by_address[address] = left
            else:
                del node.uploads_by_address[address]


def _has_sendfile(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether ``loop`` implements ``sendfile`` (asyncio's selector loop does; uvloop inherits the
    abstract method and would raise on every call). Decided once per loop class, off the hot path."""
    cls = type(loop)
    cached = _SENDFILE.get(cls)
    if cached is None:
        cached = _SENDFILE[cls] = cls.sendfile is not asyncio.AbstractEventLoop.sendfile
    return cached


_SENDFILE: dict[type, bool] = {}


def _open_chunk_file(loc: Any) -> int | None:
    """Open the file holding ``loc``. A snapshot's staging directory is renamed to its ready
    directory when it completes; the rename and the job's state change are not one step, so the
    other name is tried too. None if neither exists (the snapshot was collected)."""
    job = loc.job
    f = job.manifest.files[loc.file_index] if job.manifest is not None else None
    candidates = [loc.path()]
    if f is not None and not (loc.layer == "stored" and f.is_diff):
        candidates += [job.store.ready_dir(job.identity) / f.path, job.store.staging_dir(job.identity) / f.path]
    for p in candidates:
        try:
            return os.open(p, os.O_RDONLY)
        except FileNotFoundError:
            continue
    return None


async def _send_chunk(request: web.Request, node: Node, address: str, loc: Any) -> web.StreamResponse:
    """Send a verified chunk: sendfile where the loop has it, else one pread into one write."""
    await node.upload_limit.take(loc.length)
    fd = _open_chunk_file(loc)
    if fd is None:
        return _text(404, "chunk not here")
    try:
        if os.fstat(fd).st_size < loc.offset + loc.length:
            # the file changed under us (truncated by hand?): stop indexing the chunk
            log.error("chunk %s: %s is shorter than its index entry; no longer serving it", address, loc.path())
            node.unindex(address)
            return _text(404, "chunk not here")
        resp = web.StreamResponse(status=200)
        resp.content_type = "application/octet-stream"
        resp.content_length = loc.length
        await resp.prepare(request)
        loop = asyncio.get_running_loop()
        transport = request.transport
        sent = False
        if transport is not None and _has_sendfile(loop):
            try:
                with os.fdopen(os.dup(fd), "rb") as f:
                    await loop.sendfile(transport, f, loc.offset, loc.length, fallback=False)
                sent = True
            except RuntimeError:
                sent = False  # a transport sendfile cannot use (e.g. TLS): pread + write below
        if not sent:
            data = await loop.run_in_executor(node.io, os.pread, fd, loc.length, loc.offset)
            await resp.write(data)
        await resp.write_eof()
    except ConnectionError as e:
        # the asker went away (died, or gave up waiting): nothing to answer, nothing to log loudly
        log.debug("chunk %s: upload cut short: %s", address, e)
        return resp
    finally:
        os.close(fd)
    node.counters["peer_bytes_out"] += loc.length
    node.counters["peer_chunks_out"] += 1
    return resp


async def get_have(request: web.Request) -> web.Response:
    """GET snapshots/{identity}/have[?since=V&wait=S] -> 200 msgpack bitfields; 404 unknown here."""
    node: Node = request.app[NODE_KEY]  # type: ignore[assignment]
    identity = request.match_info["identity"]
    try:
        validate_identity(identity)
    except BdnError as e:
        return _text(400, str(e))
    since = request.query.get("since", "-1")
    if not re.fullmatch(r"-?\d{1,18}", since):
        return _text(400, "since must be an integer")
    wait = _float_arg(request, "wait", 0.0, MAX_WAIT_S)
    job = node.jobs.get(identity)
    if job is None or job.manifest is None:
        return _text(404, "snapshot not known here")
    await job.wait_change(int(since), wait)
    return web.Response(body=msgpack.packb(job.have_map(), use_bin_type=True), content_type="application/msgpack")


async def post_members(request: web.Request) -> web.Response:
    """POST members (msgpack {node_id, url, members, target}) -> 200 our view; 400/413 malformed."""
    node: Node = request.app[NODE_KEY]  # type: ignore[assignment]
    try:
        body = await read_body(request.content, MAX_MEMBERS_BODY, request.content_length)
    except BodyTooLarge as e:
        return _text(413, f"members {e}")
    try:
        obj = msgpack.unpackb(body, raw=False)
        ans = await node.handle_members(obj)
    except (ValueError, msgpack.UnpackException, BdnError, RecursionError) as e:
        return _text(400, f"members body is malformed: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    return web.Response(body=msgpack.packb(ans, use_bin_type=True), content_type="application/msgpack")


async def post_hot_load_peer(request: web.Request) -> web.Response:
    """A hot-load fanned out by the daemon that accepted it (msgpack target)."""
    from bdn.daemon.hotload import Target

    node: Node = request.app[NODE_KEY]  # type: ignore[assignment]
    try:
        body = await read_body(request.content, 64 << 10, request.content_length)
        t = Target.from_wire(msgpack.unpackb(body, raw=False))
    except BodyTooLarge as e:
        return _text(413, f"hot-load {e}")
    except (ValueError, msgpack.UnpackException, RecursionError):
        t = None
    if t is None:
        return _text(400, "hot-load target is malformed")
    await node.hotload.adopt(t, source=f"peer {request['peer']}")
    return web.Response(body=msgpack.packb({"ok": True}), content_type="application/msgpack")


async def get_replica(request: web.Request) -> web.Response:
    """GET replica -> 200 this replica as the hot-load GET lists it (JSON)."""
    node: Node = request.app[NODE_KEY]  # type: ignore[assignment]
    return web.json_response(node.hotload.replica())


async def hot_load_public(request: web.Request) -> web.Response:
    """The fleet hot-load API on the network port: ``Authorization: Bearer <api_token>``."""
    from bdn.daemon.hotload import check_bearer
    from bdn.daemon.local_api import hot_load_get, hot_load_post

    node: Node = request.app[NODE_KEY]  # type: ignore[assignment]
    if not check_bearer(request.headers.get("Authorization"), node.cfg.api_token):
        return web.json_response({"error": "missing or wrong bearer token"}, status=401)
    return await (hot_load_post(request) if request.method == "POST" else hot_load_get(request))


def make_peer_app(node: Node) -> web.Application:
    """The peer server's application (bind it to ``peer_listen``).

    Two kinds of callers reach this port: peers (every ``/bdn/v1/{swarm_id}/...`` request signed
    with the partition's auth key) and the trainer (the fleet hot-load API, bearer token). Any
    other path answers 401 like a bad signature.
    """
    from bdn.daemon.local_api import NODE_KEY as LOCAL_NODE_KEY

    app = web.Application(middlewares=[_auth], client_max_size=1 << 20)
    app[NODE_KEY] = node
    app[LOCAL_NODE_KEY] = node
    p = "/bdn/v1/{swarm_id}"
    app.router.add_get(p + "/chunks/{address}", get_chunk)
    app.router.add_get(p + "/snapshots/{identity}/have", get_have)
    app.router.add_post(p + "/members", post_members)
    app.router.add_post(p + "/hot_load", post_hot_load_peer)
    app.router.add_get(p + "/replica", get_replica)
    app.router.add_route("POST", HOT_LOAD_PATH, hot_load_public)
    app.router.add_route("GET", HOT_LOAD_PATH, hot_load_public)
    return app
