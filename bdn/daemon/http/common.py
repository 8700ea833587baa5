"""Small helpers the HTTP adapters share: JSON answers, the one-line error body, and reading a
request body under a size limit and a deadline."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from bdn.daemon.bodies import read_body
from bdn.daemon.http.services import services

MAX_BODY = 64 << 10


class BodyTimeout(Exception):
    """The request body did not arrive within ``timeout_s`` seconds."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"request body not complete after {timeout_s:g} s")
        self.timeout_s = timeout_s


async def request_body(request: web.Request, limit: int) -> bytes:
    """The whole body of ``request``, at most ``limit`` bytes, complete within the listener's
    ``http_header_timeout_s`` of this call.

    Why the deadline here: the guard (``http/guard.py``) times the headers only, and a body that
    trickles in (one byte every few seconds) held its connection for as long as the sender
    liked, so ``http_max_connections`` such requests shut a listener for everyone
    (tests/test_adversarial_http.py). Every body bdnd reads is at most 1 MiB.

    Raises:
        bdn.daemon.bodies.BodyTooLarge: the declared or actual length is over ``limit``.
        BodyTimeout: the body was not complete in time.
    """
    timeout_s = services(request).cfg.http_header_timeout_s
    try:
        return await asyncio.wait_for(read_body(request.content, limit, request.content_length), timeout_s)
    except asyncio.TimeoutError:
        raise BodyTimeout(timeout_s) from None


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, text=json.dumps(obj), content_type="application/json")


def error(status: int, msg: str, **extra: Any) -> web.Response:
    """``{"error": msg, **extra}`` with ``status``."""
    return json_response({"error": msg, **extra}, status)


def text(status: int, msg: str) -> web.Response:
    """A one-line plain-text answer (the peer protocol's error bodies)."""
    return web.Response(status=status, text=msg + "\n")
