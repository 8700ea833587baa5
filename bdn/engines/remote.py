"""The HTTP side shared by adapters that drive an engine server (SGLang, vLLM) through its routes.

``EngineHTTP`` is a small httpx client: JSON in, JSON (or text) out, bounded answers, and every
failure raised as one ``RemoteEngineError`` line naming the route, the status and the engine's
message. Engines are local processes (loopback), but their answers are still input: bodies are
read up to ``MAX_ANSWER_BYTES``.
"""

from __future__ import annotations

import json
from typing import Any

import httpx

from bdn.proto.errors import BdnError

__all__ = ["EngineHTTP", "RemoteEngineError", "MAX_ANSWER_BYTES"]

MAX_ANSWER_BYTES = 4 << 20


class RemoteEngineError(BdnError):
    """An engine route failed: unreachable, a non-2xx status, or an answer that says it failed."""


class EngineHTTP:
    """JSON calls to one engine server at ``base_url`` (e.g. ``http://127.0.0.1:30000``).

    Args:
        timeout_s: per call (a weight reload of a large model takes a while: give it room).
        headers: e.g. ``{"Authorization": "Bearer <key>"}`` for an engine started with an API key.
    """

    def __init__(self, base_url: str, timeout_s: float = 600.0, headers: dict[str, str] | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.client = httpx.Client(base_url=self.base_url, timeout=timeout_s, headers=headers or {})

    def call(
        self,
        method: str,
        route: str,
        body: Any = None,
        params: dict[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        """``method route`` with a JSON ``body``; the parsed JSON answer (or its text, or None).

        ``timeout_s``: seconds for this call (default the client's). Bodies over
        ``MAX_ANSWER_BYTES`` are refused. Raises RemoteEngineError (one line) for transport
        failures, an answer too large and statuses >= 300.
        """
        kw: dict[str, Any] = {"params": params}
        if body is not None:
            kw["json"] = body
        if timeout_s is not None:
            kw["timeout"] = timeout_s
        try:
            with self.client.stream(method, route, **kw) as r:
                raw = b""
                for part in r.iter_bytes():
                    raw += part
                    if len(raw) > MAX_ANSWER_BYTES:
                        raise RemoteEngineError(f"{method} {route}: answer larger than {MAX_ANSWER_BYTES} bytes")
                status = r.status_code
                ctype = r.headers.get("content-type", "")
        except httpx.TimeoutException:
            raise RemoteEngineError(f"{method} {route}: no answer from {self.base_url} in time") from None
        except httpx.HTTPError as exc:
            raise RemoteEngineError(
                f"{method} {route}: {self.base_url} unreachable ({type(exc).__name__}: {exc})"
            ) from None
        text = raw.decode("utf-8", errors="replace")
        try:
            ans: Any = json.loads(text) if "json" in ctype or text[:1] in "{[" else (text or None)
        except ValueError:
            ans = text
        if status >= 300:
            raise RemoteEngineError(f"{method} {route}: {status} {_message(ans)}")
        return ans

    def close(self) -> None:
        """Close the connection pool; a later :meth:`call` fails (httpx's RuntimeError)."""
        self.client.close()


def _message(ans: Any) -> str:
    if isinstance(ans, dict):
        for k in ("message", "error", "detail"):
            v = ans.get(k)
            if isinstance(v, dict):
                v = v.get("message")
            if v:
                return " ".join(str(v).split())[:300]
    return " ".join(str(ans).split())[:300] if ans else "(no body)"
