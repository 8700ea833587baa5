"""The fleet hot-load API's HTTP face: ``POST`` and ``GET /hot_load/v1/models/hot_load``.

Mounted on the local API (no token) and on the peer port behind ``Authorization: Bearer
<api_token>`` (compared in constant time; with no token configured the peer port refuses it).
"""

from __future__ import annotations

import hmac

from aiohttp import web

from bdn.daemon.http.common import MAX_BODY, BodyIncomplete, error, json_response, request_body
from bdn.daemon.http.errors import status_of
from bdn.daemon.http.services import services
from bdn.daemon.observe.bodies import BodyTooLarge
from bdn.proto.errors import BdnError

PATH = "/hot_load/v1/models/hot_load"


def check_bearer(header: str | None, token: str) -> bool:
    """Constant-time check of ``Authorization: Bearer <token>`` (False when no token is set)."""
    if not token or not header or not header.startswith("Bearer "):
        return False
    # surrogatepass (as in proto/keys.py): aiohttp decodes header bytes that are not UTF-8 as
    # lone surrogates; such a token is wrong (401), not an encoding error (500)
    return hmac.compare_digest(header[7:].strip().encode("utf-8", "surrogatepass"), token.encode())


async def post(request: web.Request) -> web.Response:
    """POST -> 200 accepted; 400/404/409/413/415/502 with one line."""
    try:
        body = await request_body(request, MAX_BODY)
    except BodyTooLarge as e:
        return error(413, f"request {e}")
    except BodyIncomplete as e:
        return error(e.status, str(e))
    try:
        ans = await services(request).hotload.accept(body)
    except BdnError as e:
        return error(status_of(e), str(e))
    return json_response(ans)


async def get(request: web.Request) -> web.Response:
    """GET[?page_size=&page_token=] -> 200 {"replicas": [one page], "next_page_token",
    "replica_count", "stages"}; 400 a bad page size (1..1000) or token."""
    q = request.query
    try:
        ans = await services(request).hotload.fleet(q.get("page_size"), q.get("page_token"))
    except BdnError as e:
        return error(status_of(e), str(e))
    return json_response(ans)


async def public(request: web.Request) -> web.Response:
    """The same on the network port: ``Authorization: Bearer <api_token>`` or 401."""
    if not check_bearer(request.headers.get("Authorization"), services(request).cfg.api_token):
        return web.json_response({"error": "missing or wrong bearer token"}, status=401)
    return await (post(request) if request.method == "POST" else get(request))
