"""Small helpers the HTTP adapters share: JSON answers and the one-line error body."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

MAX_BODY = 64 << 10


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, text=json.dumps(obj), content_type="application/json")


def error(status: int, msg: str, **extra: Any) -> web.Response:
    """``{"error": msg, **extra}`` with ``status``."""
    return json_response({"error": msg, **extra}, status)


def text(status: int, msg: str) -> web.Response:
    """A one-line plain-text answer (the peer protocol's error bodies)."""
    return web.Response(status=status, text=msg + "\n")
