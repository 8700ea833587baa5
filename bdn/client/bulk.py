"""Bulk GETs from the local daemon straight into the caller's buffer (the HTTP pull at
memory speed).

httpx reads a body 64 KiB at a time into new ``bytes`` and the caller copies each piece again,
which capped ``read_file``/``read_tensor`` at 0.1-0.3 GB/s. Here one HTTP/1.1 request goes over
its own connection (TCP or the unix socket; ``Connection: close``), the response head is parsed
(at most ``MAX_HEAD`` bytes; RFC 9112 status line and fields), and the body is received with
``recv_into`` directly into the buffer ``alloc(length, headers)`` returns, in large reads with a
large receive buffer: one kernel copy per byte, the daemon side being ``sendfile``.

Untrusted input all the same: a head over ``MAX_HEAD``, a missing or malformed Content-Length, a
body shorter than announced are ``ProtocolError``; a status other than 200/206 gives the small
error body (at most ``MAX_ERROR``) to the caller.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

from bdn.client.errors import DaemonUnreachable
from bdn.proto.errors import ProtocolError

MAX_HEAD = 64 << 10
MAX_ERROR = 1 << 20
RCVBUF = 4 << 20
READ = 4 << 20

Alloc = Callable[[int, dict[str, str]], Any]


def _connect(host: str | None, port: int | None, uds: str | None, timeout: float) -> socket.socket:
    if uds is not None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        addr: Any = uds
    else:
        s = socket.socket(socket.AF_INET6 if host and ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        addr = (host, port)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
        s.settimeout(timeout)
        s.connect(addr)
    except BaseException:
        s.close()
        raise
    return s


def _parse_head(raw: bytes) -> tuple[int, dict[str, str]]:
    lines = raw.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit() or len(parts[1]) != 3:
        raise ProtocolError(f"daemon answered with a malformed status line {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise ProtocolError(f"daemon answered with a malformed header line {line[:80]!r}")
        headers[name.lower()] = value.strip()
    return int(parts[1]), headers


def get_into(
    host: str | None,
    port: int | None,
    uds: str | None,
    target: str,
    extra: dict[str, str],
    alloc: Alloc,
    *,
    timeout: float,
    url: str,
) -> tuple[int, dict[str, str], Any]:
    """``GET target`` from the daemon at ``host:port`` (or the unix socket ``uds``); returns
    ``(status, headers, body)`` with lowercase header names. For 200/206, ``body`` is what
    ``alloc(content_length, headers)`` returned, filled; for other statuses the error body
    (``bytes``). ``timeout`` bounds the connect and each read (seconds).

    Raises:
        DaemonUnreachable: cannot connect, or the connection broke or stalled (names ``url``).
        ProtocolError: a malformed or oversized head, no Content-Length, a short body.
    """
    hdrs = "".join(f"{k}: {v}\r\n" for k, v in extra.items())
    req = (
        f"GET {target} HTTP/1.1\r\nHost: {host or 'localhost'}\r\nConnection: close\r\n"
        f"Accept-Encoding: identity\r\n{hdrs}\r\n"
    ).encode("latin-1")
    try:
        s = _connect(host, port, uds, timeout)
    except OSError as e:
        raise DaemonUnreachable(url, f"cannot connect: {e.strerror or e}") from None
    with s:
        try:
            s.sendall(req)
            buf = bytearray()
            while True:
                end = buf.find(b"\r\n\r\n")
                if end >= 0:
                    break
                if len(buf) > MAX_HEAD:
                    raise ProtocolError(f"daemon answer head exceeds {MAX_HEAD} bytes")
                piece = s.recv(MAX_HEAD)
                if not piece:
                    raise DaemonUnreachable(url, "connection closed before an answer")
                buf += piece
            status, headers = _parse_head(bytes(buf[:end]))
            rest = memoryview(buf)[end + 4 :]
            size = headers.get("content-length", "")
            if not size.isdigit():
                raise ProtocolError(f"daemon sent no valid Content-Length ({size[:40]!r})")
            n = int(size)
            if status not in (200, 206):
                if n > MAX_ERROR:
                    raise ProtocolError(f"daemon error answer of {n} bytes exceeds {MAX_ERROR} bytes")
                body = bytearray(n)
                _fill(s, memoryview(body), rest, url)
                return status, headers, bytes(body)
            out = alloc(n, headers)
            with memoryview(out) as view:
                _fill(s, view.cast("B") if view.format != "B" else view, rest, url)
            return status, headers, out
        except TimeoutError:
            raise DaemonUnreachable(url, f"no answer within {timeout:g} s") from None
        except (ConnectionError, OSError) as e:
            raise DaemonUnreachable(url, f"connection broke: {e}") from None


def _fill(s: socket.socket, view: memoryview, first: memoryview, url: str) -> None:
    """Fill ``view``: the bytes already read (``first``), then ``recv_into`` the rest."""
    n = len(view)
    if len(first) > n:
        raise ProtocolError(f"daemon sent more than the {n} bytes it announced")
    view[: len(first)] = first
    pos = len(first)
    while pos < n:
        got = s.recv_into(view[pos:], min(n - pos, READ))
        if got == 0:
            raise ProtocolError(f"daemon body ended after {pos} of {n} bytes")
        pos += got
