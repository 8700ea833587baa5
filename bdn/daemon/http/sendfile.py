"""File bytes on the local API without copies through Python: ``os.sendfile`` from the snapshot's
shm file straight into the request's socket, on a worker thread, after aiohttp has sent the
headers (uvloop has no ``loop.sendfile``, and aiohttp's fallback reads the file into
Python chunk by chunk and writes each one, 0.25-0.34 GB/s in bench/handoff).

How: the response is prepared (status and headers go out through the transport as usual); when
the transport has nothing left buffered, a thread runs ``os.sendfile`` on the connection's
socket descriptor (non-blocking: it waits with ``poll`` when the socket is full) until the body
is out, while the event loop serves other requests. Only then does the handler return, so
nothing else writes to that connection meanwhile. A transport with bytes still buffered (or
TLS) gets the same bytes by ``pread`` + write instead. A body that cannot be finished (the
client went away, the file shrank) aborts the connection: the client sees a short body, never
a wrong one.

``byte_range`` parses ``Range`` (RFC 9110 §14: one ``bytes=`` range; ``a-b``, ``a-``, ``-n``).
"""

from __future__ import annotations

import asyncio
import functools
import os
import re
import select
import socket
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from aiohttp import web

#: Seconds a send may wait for the client to make room in the socket before the connection is dropped.
SEND_STALL_S = 60.0
#: Threads pushing file bytes (each holds one response while its client reads).
SEND_THREADS = 8
COPY_PIECE = 8 << 20

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(SEND_THREADS, thread_name_prefix="bdn-local-send")
        return _pool


#: One ``bytes=`` range (RFC 9110 §14.1.2); positions of up to 19 digits (below 2^63).
_RANGE = re.compile(r"bytes=([0-9]{0,19})-([0-9]{0,19})")


class RangeNotSatisfiable(ValueError):
    """The ``Range`` asks for bytes the file does not have (HTTP 416)."""


def byte_range(request: web.Request, size: int) -> tuple[int, int] | None:
    """``(start, length)`` of the ``Range`` of ``request`` over a ``size``-byte file, or None
    when there is none (the whole file).

    Parsed here, not by aiohttp's ``http_range``, which reads ``bytes=-0`` as the whole file
    (RFC 9110 §14.1.1: a suffix of zero bytes is unsatisfiable) and lets an integer conversion
    error of a very long number through as the message.

    Raises:
        RangeNotSatisfiable: not one ``bytes=`` range, a range that ends before it starts, a
        zero-byte suffix, or one that starts at or beyond ``size``.
    """
    value = request.headers.get("Range")
    if value is None:
        return None
    m = _RANGE.fullmatch(value.strip())
    if m is None or not (m.group(1) or m.group(2)):
        shown = value if len(value) <= 80 else value[:77] + "..."
        raise RangeNotSatisfiable(f"Range {shown!r} is not one range 'bytes=a-b', 'bytes=a-' or 'bytes=-n'")
    first, last = m.group(1), m.group(2)
    if first:
        start = int(first)
        stop = size if not last else min(int(last) + 1, size)
        if last and int(last) < start:
            raise RangeNotSatisfiable(f"range {start}-{last} ends before it starts")
    else:
        n = int(last)
        if n == 0:
            raise RangeNotSatisfiable("a suffix range of 0 bytes asks for nothing")
        start, stop = max(size - n, 0), size
    if start >= size:
        raise RangeNotSatisfiable(f"range starts at {start}, the file has {size} bytes")
    return start, stop - start


def _sendfile_all(out_fd: int, in_fd: int, offset: int, count: int) -> None:
    """Send ``count`` bytes of ``in_fd`` from ``offset`` to the non-blocking socket ``out_fd``.

    Raises:
        ConnectionError: the client went away, or the file ended early.
        TimeoutError: the client took no byte for ``SEND_STALL_S``.
    """
    poller: select.poll | None = None
    while count:
        try:
            sent = os.sendfile(out_fd, in_fd, offset, count)
        except BlockingIOError:
            if poller is None:
                poller = select.poll()
                poller.register(out_fd, select.POLLOUT)
            if not poller.poll(SEND_STALL_S * 1000):
                raise TimeoutError(f"the client took nothing for {SEND_STALL_S:g} s") from None
            continue
        except (BrokenPipeError, ConnectionResetError) as e:
            raise ConnectionResetError(f"client went away: {e}") from None
        if sent == 0:
            raise ConnectionResetError("the file ended before its size (truncated while sending)")
        offset += sent
        count -= sent


#: SO_SNDBUF for a unix-socket connection that sends a file: the default (~208 KiB) makes a
#: ``sendfile`` + ``poll`` round per ~200 KiB; 4 MiB measured 0.227 against 0.251 CPU-s per GB
#: (a socketpair, 512 MiB, medians of 3). TCP autotunes its own.
UNIX_SNDBUF = 4 << 20


def _grow_sndbuf(s: socket.socket) -> None:
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, UNIX_SNDBUF)
    except OSError:
        pass  # capped by net.core.wmem_max: the default still works


def _pread(fd: int, n: int, offset: int) -> bytes:
    return os.pread(fd, n, offset)


class FileChanged(OSError):
    """A ready file is not what its snapshot says any more (changed behind the daemon's back:
    truncated, grown, replaced by a symlink or another kind of file); nothing was sent."""


def open_exact(path: str | os.PathLike[str] | Path, size: int) -> int:
    """A read-only fd of ``path``, which must be a regular file of ``size`` bytes; a symlink is
    not followed (a ready file replaced by a symlink to ``/etc/passwd`` must not serve its bytes).

    Raises:
        FileNotFoundError: no such file.
        FileChanged: a symlink, not a regular file, or not ``size`` bytes (one line, naming it).
    """
    name = Path(path).name
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise
    except OSError as e:  # ELOOP: a symlink
        raise FileChanged(f"{name} is no longer a regular file on this node ({e.strerror})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size != size:
        os.close(fd)
        what = f"{st.st_size} bytes" if stat.S_ISREG(st.st_mode) else "not a regular file"
        raise FileChanged(f"{name} is {what} on this node, the snapshot's file has {size} bytes")
    return fd


async def send_file(
    request: web.Request,
    path: str | os.PathLike[str] | Path,
    offset: int,
    length: int,
    *,
    status: int = 200,
    headers: dict[str, str] | None = None,
    file_size: int,
) -> web.StreamResponse:
    """Answer ``request`` with ``length`` bytes of ``path`` from ``offset`` (``status``, plus
    ``headers``; Content-Length is set here). HEAD gets the headers only. ``file_size``: the
    size the snapshot says the file has (checked by :func:`open_exact`, never taken from disk).

    Raises:
        OSError: ``path`` cannot be opened, or FileChanged (both before anything is sent).
    """
    fd = open_exact(path, file_size)
    owned: list[int | socket.socket] = [fd]  # closed when this returns, unless a send thread still uses them
    try:
        resp = web.StreamResponse(status=status, headers=headers)
        resp.content_length = length
        await resp.prepare(request)
        if request.method == "HEAD" or length == 0:
            await resp.write_eof()
            return resp
        transport = request.transport
        sock = transport.get_extra_info("socket") if transport is not None else None
        loop = asyncio.get_running_loop()
        try:
            if (
                sock is not None
                and transport is not None
                and not transport.is_closing()
                and transport.get_extra_info("sslcontext") is None
                and transport.get_write_buffer_size() == 0
            ):
                # our own reference to the connection: if the loop closes its descriptor (the
                # client left, this task is cancelled) the number cannot be reused under the thread
                out = socket.socket(fileno=os.dup(sock.fileno()))
                owned.append(out)
                if out.family == socket.AF_UNIX:
                    _grow_sndbuf(out)
                fut = loop.run_in_executor(_executor(), _sendfile_all, out.fileno(), fd, offset, length)
                try:
                    await asyncio.shield(fut)
                except asyncio.CancelledError:
                    _shutdown(out)  # the thread's next sendfile fails at once
                    fut.add_done_callback(functools.partial(_close_when_done, list(owned)))
                    owned.clear()
                    transport.abort()
                    raise
            else:
                pos, left = offset, length
                while left:
                    piece = await loop.run_in_executor(_executor(), _pread, fd, min(left, COPY_PIECE), pos)
                    if not piece:
                        raise ConnectionResetError("the file ended before its size (truncated while sending)")
                    await resp.write(piece)
                    pos += len(piece)
                    left -= len(piece)
        except (ConnectionError, TimeoutError, OSError):
            if transport is not None:
                transport.abort()  # a short body must look short to the client, never complete
            return resp
        await resp.write_eof()
        return resp
    finally:
        _close_all(owned)


def _shutdown(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _close_when_done(owned: list, _done: object) -> None:
    """Done callback of a cancelled send's thread: close what it used."""
    _close_all(owned)


def _close_all(owned: list) -> None:
    for x in owned:
        try:
            x.close() if isinstance(x, socket.socket) else os.close(x)
        except OSError:
            pass
