"""Blocking-socket helpers shared by the transfer server and client (exact reads, frames, timeouts).

Sockets stay in blocking mode with kernel timeouts (``SO_RCVTIMEO``/``SO_SNDTIMEO``) rather than
Python's ``settimeout``: with a Python timeout every ``recv_into`` is preceded by a ``poll`` and
``os.sendfile`` on the then non-blocking socket would return ``EAGAIN`` mid-chunk.
"""

from __future__ import annotations

import mmap
import os
import socket
import struct
import time

from bdn.proto import wire
from bdn.proto.errors import ProtocolError


class ConnectionClosed(ConnectionError):
    """The other side closed the connection (or it broke) before a frame or body was complete."""


def set_timeouts(sock: socket.socket, recv_s: float | None = None, send_s: float | None = None) -> None:
    """Set the kernel receive and/or send timeout (seconds; 0 waits forever) of a blocking socket;
    a timeout given as None is left as it is."""
    for opt, val in ((socket.SO_RCVTIMEO, recv_s), (socket.SO_SNDTIMEO, send_s)):
        if val is not None:
            v = max(float(val), 0.0)
            sock.setsockopt(socket.SOL_SOCKET, opt, struct.pack("ll", int(v), int((v % 1) * 1e6)))


def recv_exact(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill ``view`` from ``sock``; with ``deadline`` (``time.monotonic()``) checked after each
    partial receive, so a peer trickling a byte per receive timeout cannot hold the caller much
    past ``deadline`` (a frame that arrives whole is never cut, however late its first byte).

    Raises:
        ConnectionClosed: EOF or reset before ``view`` was full.
        TimeoutError: nothing arrived within the socket's receive timeout, or ``deadline`` passed.
    """
    pos, n = 0, len(view)
    while pos < n:
        if deadline is not None and pos and time.monotonic() > deadline:
            raise TimeoutError(f"transfer frame still incomplete at its deadline, {pos} of {n} bytes")
        try:
            got = sock.recv_into(view[pos:], n - pos)
        except BlockingIOError:
            raise TimeoutError("transfer connection timed out") from None
        except (ConnectionResetError, BrokenPipeError) as e:
            raise ConnectionClosed(f"transfer connection broke: {e}") from None
        if got == 0:
            raise ConnectionClosed(f"transfer connection closed after {pos} of {n} bytes")
        pos += got


def read_frame(
    sock: socket.socket, buf: memoryview, deadline: float | None = None
) -> tuple[wire.FrameType, memoryview]:
    """Read one frame into ``buf`` (at least ``wire.HEADER.size + wire.MAX_FRAME`` bytes, reused
    per connection); ``(type, body)`` where ``body`` is a view into ``buf`` (payload and tag).
    With ``deadline`` (``time.monotonic()``) the frame must be complete by then (``recv_exact``).

    Raises:
        ProtocolError: the header claims more than ``wire.MAX_FRAME`` or an unknown type (nothing
            of it is allocated or read).
        ConnectionClosed, TimeoutError: as ``recv_exact``.
    """
    hdr = buf[: wire.HEADER.size]
    recv_exact(sock, hdr, deadline)
    ftype, n = wire.parse_header(hdr)
    body = buf[wire.HEADER.size : wire.HEADER.size + n]
    recv_exact(sock, body, deadline)
    return ftype, body


def sendfile_all(out: int, fd: int, pos: int, n: int) -> None:
    """Send ``n`` bytes of file ``fd`` from offset ``pos`` to socket ``out`` with ``os.sendfile``
    (the bytes never enter Python).

    Raises:
        TimeoutError: the socket's send timeout passed.
        ConnectionClosed: the file ended early (truncated while serving).
        OSError: the socket failed.
    """
    while n:
        try:
            sent = os.sendfile(out, fd, pos, n)
        except BlockingIOError:
            raise TimeoutError("transfer send timed out") from None
        if sent == 0:
            raise ConnectionClosed("chunk file ended early (truncated while serving)")
        pos += sent
        n -= sent


def frame_buffer() -> memoryview:
    """A writable buffer that holds any one frame (``HEADER.size + MAX_FRAME`` bytes, allocated
    once per connection). An anonymous private mapping, not a ``bytearray``: a 64 KiB block lives
    as long as its connection, and in glibc's heap (a thread arena: the acceptor's, for the
    server's connections) such blocks, coming and going with connection churn, pin the arenas'
    tops, so that the thread arenas grew by 2-3 MB over an hour of hot-loads
    (docs/decisions/0025-flat-rss.md). A mapping goes back to the system whole when the view is dropped."""
    return memoryview(mmap.mmap(-1, wire.HEADER.size + wire.MAX_FRAME, flags=mmap.MAP_PRIVATE))


__all__ = [
    "ConnectionClosed",
    "ProtocolError",
    "frame_buffer",
    "read_frame",
    "recv_exact",
    "sendfile_all",
    "set_timeouts",
]
