"""The one HTTP client of ``bdn.client`` and ``bdnctl``: requests to a bdnd, on httpx.

Base URLs (README.md, "Local API"): ``http://host:port[/prefix]`` (the local API, or a daemon's
peer port for the network hot-load API) or ``unix:///path/to.sock`` (the local API's unix socket,
through ``httpx.HTTPTransport(uds=...)``). Connections are kept alive and pooled by httpx, shared
by all threads (the client is thread-safe).

Every failure to reach or hear the daemon is one :class:`DaemonUnreachable` line; an answer with
a status the caller did not expect is a :class:`DaemonError` carrying the daemon's ``{"error":
...}`` line; an answer that breaks the API (too large, not JSON) is a ProtocolError. A request
that may be repeated (GET, HEAD, DELETE, or ``idempotent=True``) is sent again once, through
:mod:`bdn.retry`, when the connection was dropped before an answer came (a kept-alive
connection the daemon closed, a reset).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import threading
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx

from bdn import retry
from bdn.client import bulk
from bdn.client.errors import DaemonError, DaemonUnreachable, one_line
from bdn.proto.errors import ProtocolError

DEFAULT_URL = "http://127.0.0.1:7081"
MAX_JSON_BYTES = 64 << 20
_UINT_RE = re.compile(r"[0-9]{1,19}")
_IDEMPOTENT = frozenset({"GET", "HEAD", "DELETE"})


def is_uint(text: str | None) -> bool:
    """True for a decimal of at most 19 ASCII digits (``str.isdigit`` also accepts superscripts)."""
    return text is not None and _UINT_RE.fullmatch(text) is not None


class Response:
    """Status, headers and body (bytes) of one finished request."""

    def __init__(self, status: int, headers: httpx.Headers, body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    def json(self) -> Any:
        """The body parsed as JSON; ``None`` for an empty body. ProtocolError if it is not JSON."""
        if not self.body.strip():
            return None
        try:
            return json.loads(self.body)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ProtocolError(f"daemon answered HTTP {self.status} with invalid JSON ({exc})") from None


def error_message(status: int, body: bytes) -> tuple[str, Any]:
    """The daemon's ``{"error": ...}`` line (or the body's first line) and the parsed JSON."""
    try:
        obj = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        text = body[:1000].decode("utf-8", "replace")
        return (one_line(text) or f"HTTP {status}"), None
    if isinstance(obj, dict) and isinstance(obj.get("error"), str):
        return obj["error"], obj
    return f"HTTP {status}", obj


def _reason(exc: BaseException) -> str:
    """The innermost OS reason of a transport error ("Connection refused"), else its text."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.strerror:
            return seen.strerror
        seen = seen.__cause__ or seen.__context__
    return one_line(str(exc)) or type(exc).__name__


class _Stale(Exception):
    """The daemon dropped a kept-alive connection before answering (internal: retried once)."""


class Transport:
    """HTTP requests to one daemon, on a pooled httpx client.

    Args:
        url: ``http://host:port[/prefix]`` or ``unix:///path/to.sock``; ValueError otherwise.
        timeout: seconds for connecting and for each read or write (positive, finite).
    """

    def __init__(self, url: str, timeout: float = 30.0) -> None:
        parts = urlsplit(url)
        if parts.scheme == "http":
            if not parts.hostname:
                raise ValueError(f"daemon URL {url!r} has no host")
            try:
                _ = parts.port  # raises ValueError on a bad port
            except ValueError:
                raise ValueError(f"daemon URL {url!r} has a bad port") from None
            self._base = f"http://{parts.netloc}{parts.path.rstrip('/')}"
            self._uds: str | None = None
        elif parts.scheme == "unix":
            if parts.netloc or not parts.path:
                raise ValueError(f"daemon URL {url!r} must look like unix:///path/to.sock")
            self._base, self._uds = "http://localhost", parts.path
        else:
            raise ValueError(f"daemon URL {url!r} must start with http:// or unix://")
        if not (isinstance(timeout, int | float) and timeout > 0 and math.isfinite(timeout)):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.url = url
        self.timeout = float(timeout)
        self._lock = threading.Lock()
        self._client: httpx.Client | None = None

    def _http(self) -> httpx.Client:
        with self._lock:
            if self._client is None:
                self._client = httpx.Client(
                    transport=httpx.HTTPTransport(uds=self._uds),
                    timeout=self.timeout,
                    # identity: the daemon serves files as they are (aiohttp would otherwise pick
                    # a "<file>.gz" beside a snapshot file for a client that accepts gzip).
                    headers={"Accept": "application/json", "Accept-Encoding": "identity"},
                    trust_env=False,  # a proxy from the environment must not see local traffic
                )
            return self._client

    def close(self) -> None:
        """Close every pooled connection (the transport reconnects if used again)."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    def get_into(
        self,
        path: str,
        headers: dict[str, str],
        alloc: Any,
        timeout: float | None = None,
    ) -> tuple[int, dict[str, str], Any]:
        """A bulk GET whose body is received straight into ``alloc(length, headers)``
        (``bdn.client.bulk``: its own connection, no pooling, no copy through Python);
        ``(status, lowercase headers, body)``; ``timeout`` in seconds (default the transport's).
        Raises DaemonUnreachable, ProtocolError."""
        parts = urlsplit(self._base)
        host = None if self._uds else parts.hostname
        return bulk.get_into(
            host,
            parts.port or 80,
            self._uds,
            parts.path + path,
            headers,
            alloc,
            timeout=self.timeout if timeout is None else timeout,
            url=self.url,
        )

    @contextlib.contextmanager
    def stream(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
        idempotent: bool = False,
    ) -> Iterator[httpx.Response]:
        """Send a request; yield the response with its body unread (read it with ``iter_raw``).

        ``body`` is sent as JSON unless None; ``timeout`` in seconds (default the transport's).
        Errors while sending or reading become
        DaemonUnreachable; others raised inside the block pass through. The response is closed
        on exit (its connection goes back to the pool only if the body was read to the end).
        """
        t = self.timeout if timeout is None else timeout
        kwargs: dict[str, Any] = {"headers": headers, "timeout": t}
        if body is not None:
            kwargs["json"] = body
        tries = 2 if idempotent or method in _IDEMPOTENT else 1
        stack = contextlib.ExitStack()
        try:
            for attempt in retry.attempts(tries, first_s=0.0, on=(_Stale,)):
                with attempt:
                    try:
                        resp = stack.enter_context(self._http().stream(method, self._base + path, **kwargs))
                    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
                        # Dropped before an answer came (a closed keep-alive connection, a reset).
                        raise _Stale(_reason(exc)) from None
            with stack:
                yield resp
        except _Stale as exc:
            raise DaemonUnreachable(self.url, str(exc)) from None
        except httpx.TimeoutException:
            raise DaemonUnreachable(self.url, f"no answer within {t:g} s") from None
        except httpx.TransportError as exc:
            raise DaemonUnreachable(self.url, _reason(exc)) from None

    def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        ok: tuple[int, ...] = (200,),
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
        idempotent: bool = False,
        limit: int = MAX_JSON_BYTES,
    ) -> Response:
        """One request whose answer is small (at most ``limit`` bytes, else ProtocolError).

        Raises DaemonError(status, the daemon's message) for a status not in ``ok``.
        """
        with self.stream(method, path, body=body, headers=headers, timeout=timeout, idempotent=idempotent) as resp:
            data = read_body(resp, limit)
        if resp.status_code not in ok:
            raise DaemonError(resp.status_code, error_message(resp.status_code, data)[0])
        return Response(resp.status_code, resp.headers, data)


def read_body(resp: httpx.Response, limit: int) -> bytes:
    """The whole body of a streamed response, refusing (ProtocolError) more than ``limit`` bytes."""
    length = resp.headers.get("Content-Length")
    if is_uint(length) and int(length) > limit:
        raise ProtocolError(f"daemon answer of {length} bytes exceeds {limit} bytes")
    parts, got = [], 0
    for piece in resp.iter_raw():
        got += len(piece)
        if got > limit:
            raise ProtocolError(f"daemon answer exceeds {limit} bytes")
        parts.append(piece)
    return b"".join(parts)
