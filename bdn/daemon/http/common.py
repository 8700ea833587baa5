"""Small helpers the HTTP adapters share: JSON answers, the one-line error body, and reading a
request body under a size limit and a deadline."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from bdn.daemon.http.services import services
from bdn.daemon.observe.bodies import read_body

log = logging.getLogger("bdn.http")
MAX_BODY = 64 << 10


class BodyIncomplete(Exception):
    """The request body did not arrive whole: ``status`` 408 (not within ``timeout_s``) or 400
    (the connection was cut in the middle of it)."""

    def __init__(self, status: int, msg: str) -> None:
        super().__init__(msg)
        self.status = status


async def request_body(request: web.Request, limit: int) -> bytes:
    """The whole body of ``request``, at most ``limit`` bytes, complete within the listener's
    ``http_header_timeout_s`` of this call.

    Why the deadline here: the guard (``http/guard.py``) times the headers only, and a body that
    trickles in (one byte every few seconds) held its connection for as long as the sender
    liked, so ``http_max_connections`` such requests shut a listener for everyone
    (tests/test_adversarial_http.py). Every body bdnd reads is at most 1 MiB. A body cut short
    by its sender is an answer too, not aiohttp's traceback of the ConnectionResetError.

    Raises:
        bdn.daemon.observe.bodies.BodyTooLarge: the declared or actual length is over ``limit``.
        BodyIncomplete: not complete in time (408), or the connection was cut (400).
    """
    timeout_s = services(request).cfg.http_header_timeout_s
    try:
        return await asyncio.wait_for(read_body(request.content, limit, request.content_length), timeout_s)
    except TimeoutError:
        raise BodyIncomplete(408, f"request body not complete after {timeout_s:g} s") from None
    except ConnectionResetError:
        log.debug("%s %s: request body cut short by the sender", request.method, request.path)
        raise BodyIncomplete(400, "request body cut short: the connection was lost") from None


def json_response(obj: Any, status: int = 200) -> web.Response:
    """``obj`` as a JSON body (``application/json``) with ``status``."""
    return web.Response(status=status, text=json.dumps(obj), content_type="application/json")


def error(status: int, msg: str, **extra: Any) -> web.Response:
    """``{"error": msg, **extra}`` with ``status``."""
    return json_response({"error": msg, **extra}, status)


@web.middleware
async def json_route_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """The local API's answer to a path it does not have (404) or a method the path does not take
    (405, with ``Allow``): ``{"error": "<one line>"}`` like every other error of it (README.md,
    "Local API"), not aiohttp's plain-text ``404: Not Found`` page. The path is shown raw (as
    sent, at most 200 characters), so it stays one line."""
    exc = request.match_info.http_exception
    if exc is None:
        return await handler(request)
    path = request.raw_path[:200]
    if isinstance(exc, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(exc.allowed_methods))
        answer = error(405, f"{request.method} is not allowed on {path} (allowed: {allowed})")
        answer.headers["Allow"] = ",".join(sorted(exc.allowed_methods))
        return answer
    return error(exc.status, f'no endpoint {request.method} {path} (README.md, "Local API", lists them)')


def text(status: int, msg: str) -> web.Response:
    """A one-line plain-text answer (the peer protocol's error bodies)."""
    return web.Response(status=status, text=msg + "\n")
