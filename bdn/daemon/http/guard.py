"""Connection guards for bdnd's HTTP listeners (the peer port and the local API): a deadline on
unfinished requests, a bound on open connections, and a one-line answer to a malformed request.

Why a wrapper around aiohttp's protocol rather than its knobs alone: aiohttp bounds header line
and field sizes (``max_line_size``, ``max_field_size``, ``max_headers``, passed through here) and
arms ``keepalive_timeout`` at connect, but it has no deadline for a request whose headers keep
trickling in on a connection the daemon keeps for a long keep-alive, no limit on connections, and
it answers a header it refuses with 400 plus a traceback in the ``aiohttp.server`` log. So:

- :class:`GuardedHandler` (a ``RequestHandler``): while the connection waits for a request and
  bytes of one have arrived (or right after connect), ``header_timeout_s`` runs; a request whose
  headers are not complete by then is closed (``bdn_http_header_timeouts_total``; refused connections and bad requests are counted too). The clock
  starts over for each request of a keep-alive connection; the body is not under it (the
  handlers bound their bodies).
- :class:`GuardedServer` (aiohttp's ``Server``, the protocol factory): more than
  ``max_connections`` open connections on one listener and the new one is answered ``503 too
  many connections`` and closed before anything is parsed.
- **Keep-alive at most the deadline.** aiohttp parses a request that arrives right behind a
  complete one in the same segment (pipelining) without telling the protocol, so those bytes
  are under no deadline but aiohttp's keep-alive timer, armed once the response is sent (the
  adversarial session measured 15 s on the peer port, 75 s on the local API, with a 10 s
  header deadline). :class:`GuardedRunner` therefore caps ``keepalive_timeout`` at
  ``header_timeout_s + KEEPALIVE_MARGIN_S``: an unfinished request, pipelined or not, holds its
  connection at most that long once the connection is idle, and an idle keep-alive connection
  is closed then too. The margin lets the header deadline, which counts what it closes, fire
  first on a slowloris. bdnd's peer client keeps idle connections at most half the header
  deadline, so it never reuses one the server is closing (a POST is not retried);
  ``bdn.client``'s httpx pool keeps them 5 s.
- ``handle_error``: a header over the limits is ``431 request header too large``, any other
  unparsable request ``400 malformed request: <what>``; one rate-limited log line (at most one
  per ``LOG_REPEAT_S`` per kind), never a traceback.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_server import Server

from bdn.daemon.observe.lograte import RepeatLog
from bdn.daemon.observe.stats import Stats

log = logging.getLogger("bdn.http")
LOG_REPEAT_S = 60.0
KEEPALIVE_MARGIN_S = 1.0  # keep-alive cap = header deadline + this (see the module docstring)
_repeat = RepeatLog(log, LOG_REPEAT_S)

TOO_MANY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: 21\r\n"
    b"Retry-After: 1\r\nConnection: close\r\n\r\ntoo many connections\n"
)


class GuardedHandler(RequestHandler):
    """aiohttp's request handler with the request deadline and the one-line error answers."""

    def __init__(self, manager: GuardedServer, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = manager
        self._deadline: asyncio.TimerHandle | None = None
        self._refused = False
        self._seen = 0  # requests parsed so far

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Refuse the connection with a 503 (``TOO_MANY``) when ``max_connections`` are open,
        else count it and arm the header deadline."""
        g = self._guard
        if g.open >= g.max_connections:
            self._refused = True
            g.stats.add("http_connections_refused")
            _repeat.log(
                logging.WARNING,
                "too-many",
                "%s: more than %d connections open: refusing new ones",
                g.name,
                g.max_connections,
            )
            transport.write(TOO_MANY)  # type: ignore[attr-defined]  # a stream transport (TCP or unix): it writes
            transport.close()
            return
        g.open += 1
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: BaseException | None) -> None:
        """Uncount the connection and disarm its deadline (nothing for a refused one)."""
        if self._refused:
            return
        self._guard.open -= 1
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        """Feed aiohttp's parser; disarm the deadline once a request's headers are complete, arm
        it again at the first bytes of the next request on a keep-alive connection."""
        if self._refused:
            return
        super().data_received(data)
        if self._request_count > self._seen:  # a request's headers are complete
            self._seen = self._request_count
            self._disarm()
        elif data and self._deadline is None and self._waiter is not None and not self._waiter.done():
            self._arm()  # the first bytes of the next request on a keep-alive connection

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self._loop.call_later(self._guard.header_timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if self._request_count > self._seen:
            return
        if self._waiter is None or self._waiter.done():
            return  # a request is being handled: not ours to cut
        self._guard.stats.add("http_header_timeouts")
        _repeat.log(
            logging.INFO,
            "header-timeout",
            "%s: closed a connection whose request was not complete after %.0f s",
            self._guard.name,
            self._guard.header_timeout_s,
        )
        self.force_close()

    def handle_error(
        self, request: Any, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        """A request aiohttp could not parse: 431 (a header line too long) or 400, one line of
        text, the connection closed after it; any other error is aiohttp's own answer."""
        if not isinstance(exc, HttpProcessingError):
            return super().handle_error(request, status, exc, message)
        self._guard.stats.add("http_bad_requests")
        if isinstance(exc, LineTooLong) or "too long" in str(exc.message).lower():
            status, text = 431, "request header too large"
        else:
            status, text = 400, "malformed request: " + " ".join(str(exc.message).split())[:200]
        _repeat.log(logging.INFO, ("bad-request", status), "%s: %d %s", self._guard.name, status, text)
        resp = web.Response(status=status, text=text + "\n")
        resp.force_close()
        return resp


class GuardedServer(Server):
    """aiohttp's ``Server`` whose connections are :class:`GuardedHandler`s.

    ``name`` names the listener in log lines ("peer API", "local API")."""

    def __init__(
        self, *args: Any, name: str, header_timeout_s: float, max_connections: int, stats: Stats, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.name = name
        self.header_timeout_s = header_timeout_s
        self.max_connections = max_connections
        self.stats = stats
        self.open = 0

    def __call__(self) -> RequestHandler:
        return GuardedHandler(self, loop=self._loop, **self._kwargs)


class GuardedRunner(web.AppRunner):
    """``web.AppRunner`` whose server is a :class:`GuardedServer` (same keyword arguments as
    ``AppRunner``, e.g. ``keepalive_timeout`` (s, capped at ``header_timeout_s + KEEPALIVE_MARGIN_S``),
    ``max_line_size``, plus the guard's)."""

    def __init__(
        self,
        app: web.Application,
        *,
        name: str,
        header_timeout_s: float,
        max_connections: int,
        stats: Stats,
        **kwargs: Any,
    ) -> None:
        cap = header_timeout_s + KEEPALIVE_MARGIN_S
        kwargs["keepalive_timeout"] = min(float(kwargs.get("keepalive_timeout", 75.0)), cap)
        super().__init__(app, **kwargs)
        self._guard_args: dict[str, Any] = dict(
            name=name, header_timeout_s=header_timeout_s, max_connections=max_connections, stats=stats
        )

    async def _make_server(self) -> Server:
        plain = await super()._make_server()  # aiohttp's own startup of the app, then its Server
        return GuardedServer(
            plain.request_handler,
            request_factory=plain.request_factory,
            handler_cancellation=plain.handler_cancellation,
            loop=plain._loop,
            **self._guard_args,
            **plain._kwargs,
        )
