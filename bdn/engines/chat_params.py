"""Validating an OpenAI chat request's parameters: the one set of rules the transformers engine's
server (bdn/engines/openai_api.py) and the reference numpy engine (examples/engine/server.py)
share. Pure, and free of torch so that the numpy engine runs without it.

Each helper reads one key of a decoded JSON body and raises :class:`ChatError` (HTTP 400, a
one-line message, the parameter at fault) for a value of the wrong type or range, as the OpenAI
API answers ``invalid_request_error``.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["ChatError", "bool_param", "int_param", "number_param"]


class ChatError(Exception):
    """A refused request: HTTP status, one-line message, the parameter at fault."""

    def __init__(
        self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def number_param(body: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    """``body[key]`` as a finite float in ``[lo, hi]``, ``default`` when absent; ChatError 400 otherwise."""
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or not lo <= v <= hi:
        raise ChatError(400, f"{key} must be a number in [{lo:g}, {hi:g}]", key)
    return float(v)


def int_param(body: dict[str, Any], key: str, lo: int, hi: int) -> int | None:
    """``body[key]`` as an int in ``[lo, hi]``, None when absent (bools are not integers here); ChatError 400
    otherwise."""
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ChatError(400, f"{key} must be an integer in [{lo}, {hi}]", key)
    return v


def bool_param(body: dict[str, Any], key: str, default: bool) -> bool:
    """``body[key]`` as a JSON boolean, ``default`` when absent; ChatError 400 otherwise."""
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ChatError(400, f"{key} must be true or false", key)
    return v
