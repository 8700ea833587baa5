"""A real S3 API for tests: a moto server process, and a recording, fault-injecting proxy.

- :func:`start_moto_server` / :func:`stop_moto_server`: ``python -m moto.server`` on a free
  loopback port, waited on until it answers.
- :class:`S3Proxy`: an aiohttp reverse proxy (its own thread and event loop) in front of any S3
  endpoint. It records every request (method, bucket, key, query, Range, status, bytes served,
  access key id) and can fail the next N requests with an S3 XML error (503 ``SlowDown``, 500,
  429, ...), cut the next N response bodies short (a broken connection), or answer the next N
  ranged GETs with a well-formed 206 that is shorter than the range asked. Bodies stream both ways (large GETs,
  multipart uploads) without being buffered, and Range requests pass through untouched.
- :func:`create_bucket`: make a bucket on an endpoint with boto3.

Use them as pytest fixtures; every moto request needs some AWS-looking credentials in the
environment (moto accepts any).
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import unquote

import aiohttp
from aiohttp import web
from yarl import URL

__all__ = [
    "ProxiedRequest",
    "S3Proxy",
    "create_bucket",
    "free_port",
    "start_moto_server",
    "stop_moto_server",
]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto_server(timeout: float = 240.0) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``python -m moto.server`` on a free loopback port; return (process, endpoint URL).

    Waits until the server answers HTTP. Raises ``RuntimeError`` (with the server's log tail) if
    it exits or does not answer within ``timeout`` seconds.
    """
    last_error: str = ""
    for _ in range(3):  # the free port can be taken between probing and binding
        port = free_port()
        log = tempfile.TemporaryFile()
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        proc._bdn_log = log  # type: ignore[attr-defined]
        endpoint = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1) as resp:
                    if resp.status == 200:
                        return proc, endpoint
            except (urllib.error.URLError, OSError):
                time.sleep(0.05)
        log.seek(0)
        last_error = log.read()[-2000:].decode("utf-8", "replace")
        stop_moto_server(proc)
    raise RuntimeError(f"moto server did not start: {last_error}")


def stop_moto_server(proc: subprocess.Popen[bytes]) -> None:
    """Stop a server from :func:`start_moto_server` (terminate, then kill after 5 s)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    log = getattr(proc, "_bdn_log", None)
    if log is not None:
        log.close()


def create_bucket(endpoint_url: str, name: str | None = None, region: str = "us-east-1") -> str:
    """Create a bucket (a fresh unique name by default) on ``endpoint_url``; return its name."""
    import boto3

    name = name or f"bdn-test-{uuid.uuid4().hex[:16]}"
    client = boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        region_name=region,
        aws_access_key_id=os.environ.get("AWS_ACCESS_KEY_ID", "testing"),
        aws_secret_access_key=os.environ.get("AWS_SECRET_ACCESS_KEY", "testing"),
    )
    try:
        client.create_bucket(Bucket=name)
    finally:
        client.close()
    return name


@dataclass
class ProxiedRequest:
    """One request the proxy saw.

    ``bucket``/``key``: from the path (path-style addressing; ``key`` is ``""`` for bucket-level
    calls). ``query``: the raw query string. ``range``: the ``Range`` header or ``None``.
    ``status``: what the client got. ``response_bytes``: body bytes sent to the client.
    ``injected``: the proxy answered with a fault instead of forwarding. ``truncated``: the
    proxy cut the body short (``truncate_next``) or shortened a 206 (``shorten_next``). ``access_key``: the key id from the SigV4 ``Authorization``.
    ``headers``: the request headers, names lower-cased.
    """

    method: str
    path: str
    bucket: str
    key: str
    query: str
    range: str | None
    access_key: str | None
    headers: dict[str, str] = field(default_factory=dict)
    status: int = 0
    response_bytes: int = 0
    injected: bool = False
    truncated: bool = False


@dataclass
class _Fault:
    remaining: int
    methods: frozenset[str] | None
    status: int = 503
    code: str = "SlowDown"
    message: str = "Please reduce your request rate."
    truncate_after: int | None = None  # set: forward, but cut the body after this many bytes
    shorten_to: int | None = None  # set: forward a 206 as a consistent, shorter 206 of this many bytes

    def matches(self, method: str) -> bool:
        return self.remaining > 0 and (self.methods is None or method in self.methods)


_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "expect",  # aiohttp's server already answered "100 Continue" to the client
}


class S3Proxy:
    """A recording, fault-injecting reverse proxy for an S3 endpoint, on 127.0.0.1.

    ``start()`` runs it in a daemon thread with its own event loop; ``url`` is its endpoint.
    ``requests()`` returns what it saw, ``clear()`` forgets it. ``fail_next(n, status, code)``
    answers the next ``n`` matching requests with an S3 XML error; ``truncate_next(n, after)``
    forwards the next ``n`` matching requests but cuts the response body after ``after`` bytes
    and closes the connection. ``stop()`` shuts it down. Thread-safe.
    """

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self._lock = threading.Lock()
        self._records: list[ProxiedRequest] = []
        self._faults: list[_Fault] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._port: int | None = None
        self._in_flight = 0
        self._max_in_flight = 0

    # -- control API ---------------------------------------------------------------------------

    @property
    def url(self) -> str:
        if self._port is None:
            raise RuntimeError("S3Proxy is not started")
        return f"http://127.0.0.1:{self._port}"

    def start(self) -> S3Proxy:
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._startup())
            except BaseException as exc:  # report to start(), don't die silently
                failure.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._shutdown())
            loop.close()

        self._thread = threading.Thread(target=run, name="s3proxy", daemon=True)
        self._thread.start()
        if not ready.wait(120):  # a thread start-up; generous for a loaded machine
            raise RuntimeError("S3Proxy did not start")
        if failure:
            raise RuntimeError(f"S3Proxy did not start: {failure[0]!r}")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop = None
            self._thread = None

    def requests(
        self, method: str | None = None, key: str | None = None, *, forwarded: bool | None = None
    ) -> list[ProxiedRequest]:
        """A copy of the records, optionally only one method / key / forwarded-or-injected."""
        with self._lock:
            records = list(self._records)
        return [
            r
            for r in records
            if (method is None or r.method == method)
            and (key is None or r.key == key)
            and (forwarded is None or forwarded != r.injected)
        ]

    def max_in_flight(self) -> int:
        """The most requests the proxy was handling at once since start or ``clear()``."""
        with self._lock:
            return self._max_in_flight

    def clear(self) -> None:
        """Forget recorded requests, pending faults and the in-flight high-water mark."""
        with self._lock:
            self._records.clear()
            self._faults.clear()
            self._max_in_flight = self._in_flight

    def fail_next(
        self,
        n: int,
        status: int = 503,
        code: str = "SlowDown",
        message: str | None = None,
        methods: tuple[str, ...] | None = None,
    ) -> None:
        """Answer the next ``n`` requests (of ``methods``, default any) with an S3 XML error.

        ``n == 0`` cancels pending faults.
        """
        with self._lock:
            if n == 0:
                self._faults.clear()
                return
            self._faults.append(
                _Fault(
                    remaining=n,
                    methods=frozenset(methods) if methods else None,
                    status=status,
                    code=code,
                    message=message or _DEFAULT_MESSAGES.get(code, "Injected by S3Proxy."),
                )
            )

    def shorten_next(self, n: int, to_bytes: int) -> None:
        """Answer the next ``n`` ranged GETs that get a 206 with only their first ``to_bytes``
        bytes, with ``Content-Length`` and ``Content-Range`` rewritten to match (the object's
        total size kept), and the connection left clean: a short answer, not a broken one."""
        with self._lock:
            self._faults.append(_Fault(remaining=n, methods=frozenset(("GET",)), shorten_to=to_bytes))

    def truncate_next(self, n: int, after_bytes: int, methods: tuple[str, ...] = ("GET",)) -> None:
        """Forward the next ``n`` matching requests but cut each body after ``after_bytes``."""
        with self._lock:
            self._faults.append(_Fault(remaining=n, methods=frozenset(methods), truncate_after=after_bytes))

    # -- server --------------------------------------------------------------------------------

    async def _startup(self) -> None:
        self._session = aiohttp.ClientSession(
            auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
            connector=aiohttp.TCPConnector(limit=256),
            skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
        )
        app = web.Application(client_max_size=1 << 40)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self._port = self._runner.addresses[0][1]

    async def _shutdown(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    def _take_fault(self, method: str) -> _Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.matches(method):
                    fault.remaining -= 1
                    if fault.remaining == 0:
                        self._faults.remove(fault)
                    return fault
        return None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        raw_path = request.raw_path
        path, _, query = raw_path.partition("?")
        bucket, _, key = unquote(path).lstrip("/").partition("/")
        record = ProxiedRequest(
            method=request.method,
            path=path,
            bucket=bucket,
            key=key,
            query=query,
            range=request.headers.get("Range"),
            access_key=_access_key(request.headers.get("Authorization", "")),
            headers={k.lower(): v for k, v in request.headers.items()},
        )
        with self._lock:
            self._records.append(record)
            self._in_flight += 1
            self._max_in_flight = max(self._max_in_flight, self._in_flight)
        done = False

        def finished() -> None:
            # Called before the client can have the whole answer, so a client that waits for
            # its answer before sending the next request is never counted twice.
            nonlocal done
            if not done:
                done = True
                with self._lock:
                    self._in_flight -= 1

        try:
            return await self._answer(request, record, finished)
        finally:
            finished()

    async def _answer(
        self, request: web.Request, record: ProxiedRequest, finished: Callable[[], None]
    ) -> web.StreamResponse:
        path = record.path
        fault = self._take_fault(request.method)
        if fault is not None and fault.shorten_to is not None:
            return await self._forward(request, record, None, finished, shorten_to=fault.shorten_to)
        if fault is not None and fault.truncate_after is None:
            if request.body_exists:
                async for _ in request.content.iter_chunked(1 << 16):
                    pass  # the client is mid-upload; take the body so it sees our answer
            body = _error_xml(fault.code, fault.message, path).encode()
            record.status = fault.status
            record.injected = True
            record.response_bytes = len(body) if request.method != "HEAD" else 0
            return web.Response(
                status=fault.status,
                body=body,
                content_type="application/xml",
                headers={"x-amz-request-id": uuid.uuid4().hex[:16].upper()},
            )
        return await self._forward(request, record, fault.truncate_after if fault else None, finished)

    async def _forward(
        self,
        request: web.Request,
        record: ProxiedRequest,
        cut_after: int | None,
        finished: Callable[[], None],
        shorten_to: int | None = None,
    ) -> web.StreamResponse:
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        data = request.content if request.body_exists else None
        target = URL(self.upstream + request.raw_path, encoded=True)
        try:
            upstream = await self._session.request(
                request.method, target, headers=headers, data=data, allow_redirects=False
            )
        except aiohttp.ClientError as exc:
            record.status = 502
            return web.Response(status=502, text=f"S3Proxy: upstream failed: {exc}")
        async with upstream:
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for name, value in upstream.headers.items():
                if name.lower() not in _HOP_BY_HOP and name.lower() != "content-length":
                    response.headers.add(name, value)
            length = upstream.headers.get("Content-Length")
            if shorten_to is not None and upstream.status == 206 and length is not None:
                first, _, total = upstream.headers.get("Content-Range", "").removeprefix("bytes ").partition("/")
                begin = int(first.partition("-")[0])
                keep = min(shorten_to, int(length))
                response.headers["Content-Range"] = f"bytes {begin}-{begin + keep - 1}/{total}"
                response.content_length = keep
                record.status = 206
                await response.prepare(request)
                sent = 0
                async for chunk in upstream.content.iter_chunked(1 << 16):
                    part = chunk[: keep - sent]
                    if part:
                        sent += len(part)
                        record.response_bytes += len(part)
                        await response.write(part)
                    if sent >= keep:
                        break
                record.truncated = True
                finished()
                await response.write_eof()
                return response
            if length is not None:
                response.content_length = int(length)
            record.status = upstream.status
            if request.method == "HEAD" or length == "0" or upstream.status in (204, 304):
                finished()  # the headers are the whole answer
            await response.prepare(request)
            if request.method == "HEAD":
                await response.write_eof()
                return response
            async for chunk in upstream.content.iter_chunked(1 << 16):
                if cut_after is not None and record.response_bytes + len(chunk) >= cut_after:
                    part = chunk[: cut_after - record.response_bytes]
                    if part:
                        record.response_bytes += len(part)
                        await response.write(part)
                    record.truncated = True
                    finished()
                    # Drop the connection mid-body, as a reset or a dying server would.
                    if request.transport is not None:
                        request.transport.close()
                    return response
                if length is not None and record.response_bytes + len(chunk) >= int(length):
                    finished()
                # Count before writing: the client may have the bytes (and the test may look at
                # the records) before write() returns.
                record.response_bytes += len(chunk)
                await response.write(chunk)
            finished()
            await response.write_eof()
            return response


_DEFAULT_MESSAGES = {
    "SlowDown": "Please reduce your request rate.",
    "InternalError": "We encountered an internal error. Please try again.",
    "ServiceUnavailable": "Service is unable to handle request.",
    "TooManyRequests": "Too many requests.",
}


def _error_xml(code: str, message: str, resource: str) -> str:
    """An S3 error body (as documented in the S3 API reference, "Error responses")."""
    from xml.sax.saxutils import escape

    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{escape(code)}</Code><Message>{escape(message)}</Message>"
        f"<Resource>{escape(resource)}</Resource>"
        f"<RequestId>{uuid.uuid4().hex[:16].upper()}</RequestId></Error>"
    )


def _access_key(authorization: str) -> str | None:
    """The access key id of a SigV4 ``Authorization`` header (``Credential=<id>/<date>/...``)."""
    marker = "Credential="
    at = authorization.find(marker)
    if at < 0:
        return None
    return authorization[at + len(marker) :].split("/", 1)[0] or None
