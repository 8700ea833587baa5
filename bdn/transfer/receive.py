"""Landing one answer's bytes (bdn.proto.wire DATA bodies and PART frames) from an open,
authenticated transfer stream: into a mapped target with xxh3-128 hashed piece by piece, into
a file by ``pwrite``, or cut-through parts until they cover the chunk. ``s`` is the client's
stream (bdn.transfer.streams.Stream: ``sock``, ``buf``, ``session``, ``hasher``). Every
function raises TimeoutError (silence), ConnectionClosed, ProtocolError (a bad part) or OSError;
split out of bdn.transfer.client, which keeps the ask/answer exchange (connections and the
handshake: bdn.transfer.streams).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import threading
import time
from typing import Any

from bdn.proto import wire
from bdn.proto.errors import ProtocolError
from bdn.transfer.coverage import Coverage
from bdn.transfer.sockio import ConnectionClosed, read_frame

#: Bytes per ``recv_into`` of a DATA body (and the ring buffer of ``receive_to_file``).
READ_BYTES = 1 << 20
#: Body bytes are received with ``MSG_WAITALL``: one call returns once the piece asked for is
#: whole (or at EOF, an error, a signal or the receive timeout, with what came), and the kernel
#: wakes per segment inside it. Without it, on a slow stream (a shaped link, 8 askers sharing one
#: uplink) each call returns one ~9 KiB segment, and the Python around every call was most of
#: a receiver's user CPU. (``SO_RCVLOWAT`` does not do: Linux wakes a sleeping receiver only
#: once the whole mark is queued again after a partial copy, so the last piece of a body would
#: sleep to the receive timeout.)
WAITALL = socket.MSG_WAITALL
#: Bytes a DATA body gets one more ``io_timeout`` for, past the four every body has.
BODY_SPAN = 16 << 20
#: The receive timeout bounds one ``MSG_WAITALL`` call as a whole (Linux counts it down across
#: the waits inside the call; a byte now and then does not restart it), and the call returns what
#: came when it runs out: so a body that stops ends within two timeouts of its last byte (the
#: call it stopped in, one more that gets nothing). A body that trickles on (a byte every so
#: often, never silent for a whole timeout) goes on call after call: each function here also
#: takes a ``deadline`` (``time.monotonic()``) for the body as a whole, checked after each call.


def body_limit(length: int, io_timeout: float) -> float:
    """Seconds a DATA body of ``length`` bytes may take as a whole: four ``io_timeout``, as a
    cut-through answer has (``receive_parts``), plus one per ``BODY_SPAN`` bytes past the first
    ``BODY_SPAN`` (a 16 MiB chunk at the daemon's 60 s: 4 min, at least 70 kB/s). A trickle of a byte every few seconds held a fetch thread, and
    the chunk's acquisition, for the body's length times that before
    (tests/test_transfer_slow_body.py)."""
    return io_timeout * (4 + max(0, length - 1) // BODY_SPAN)


def _late(deadline: float, what: str, pos: int, n: int) -> None:
    if time.monotonic() > deadline:
        raise TimeoutError(f"{what} still incomplete at its deadline, {pos} of {n} bytes")


def receive_parts(
    s: Any,
    target: memoryview,
    first: bytes | memoryview,
    wait_s: float,
    io_timeout: float,
) -> None:
    """Receive a cut-through answer (PART frames, the first one's payload ``first``) into
    ``target`` until the parts cover it. Raises
    ProtocolError (overlapping or outside parts, a frame that is no PART), TimeoutError (no new
    byte for ``io_timeout_s``, or the answer outlived ``wait_s`` + 4 x ``io_timeout_s``, also
    inside a part), ConnectionClosed."""
    n = len(target)
    covered = Coverage(n)
    start = last_byte = time.monotonic()
    limit = wait_s + 4 * io_timeout
    payload = first
    while True:
        off, ln = wire.decode_part(payload, n)
        now = time.monotonic()
        if ln:
            covered.add(off, ln)  # raises on overlap
            receive_range(s, target[off : off + ln], start + limit)
            last_byte = now
            if covered.full:
                return
        elif now - last_byte > io_timeout:
            raise TimeoutError(f"cut-through answer: no new byte for {io_timeout:g} s")
        if now - start > limit:
            raise TimeoutError(f"cut-through answer still incomplete after {limit:g} s")
        # the next PART frame by the answer's deadline too: trickled a byte per receive
        # timeout, a ~40-byte frame held the fetch thread ~40 timeouts past it
        ftype, body = read_frame(s.sock, s.buf, start + limit)
        if ftype != wire.FrameType.PART:
            raise ProtocolError(f"{ftype.name} frame inside a cut-through answer")
        payload = s.session.open(ftype, body)


def receive_range(s: Any, target: memoryview, deadline: float) -> None:
    """Receive exactly ``len(target)`` raw bytes of one PART into ``target`` by ``deadline``."""
    recv_into = s.sock.recv_into
    pos, n = 0, len(target)
    while pos < n:
        try:
            got = recv_into(target[pos:], n - pos, WAITALL)
        except BlockingIOError:
            raise TimeoutError(f"part stalled after {pos} of {n} bytes") from None
        if got == 0:
            raise ConnectionClosed(f"connection closed after {pos} of {n} part bytes")
        pos += got
        if pos < n:
            _late(deadline, "part", pos, n)


def receive_hashed(s: Any, target: memoryview, deadline: float) -> None:
    """Receive ``len(target)`` body bytes into ``target`` by ``deadline``, hashing each piece as
    it lands."""
    h = s.hasher
    h.reset()
    recv_into, update = s.sock.recv_into, h.update
    pos, n = 0, len(target)
    while pos < n:
        want = min(n - pos, READ_BYTES)
        try:
            got = recv_into(target[pos : pos + want], want, WAITALL)
        except BlockingIOError:
            raise TimeoutError(f"body stalled after {pos} of {n} bytes") from None
        if got == 0:
            raise ConnectionClosed(f"connection closed after {pos} of {n} body bytes")
        update(target[pos : pos + got])
        pos += got
        if pos < n:
            _late(deadline, "body", pos, n)


class Rings:
    """The receive buffers of :func:`receive_to_file` (``size`` bytes each): lent to one call at a
    time, kept between calls, unmapped all at once by :meth:`release`.

    Shared by every thread, not one per thread: a buffer per thread stayed mapped (and resident:
    each call writes it whole) for the thread's life, and the daemon's ``FetchPool`` threads
    (``max_inflight``) live as long as the daemon, so its anonymous memory rose by 1 MiB each time
    one more of them first received into a file, up to 16 MiB over its first 20 minutes of
    hot-loads (found with bench/soak/mmaptrace.py; issue 31). Here at most as many buffers are
    mapped as calls ran at once, and none once :meth:`release` ran with no call running (a
    ``TransferClient`` has one ``Rings``; the daemon's fetcher releases it when no download runs).
    Per call, not per stream: a daemon keeps up to ``streams_per_peer`` idle streams to each of
    dozens of peers (128 MiB of buffers at 32 peers x 4). Anonymous mappings, not ``bytearray``,
    for the reason ``sockio.frame_buffer`` gives (glibc arenas pinned by long-lived blocks); a
    mapping goes back to the system whole when its last view is dropped. Thread-safe."""

    def __init__(self, size: int = READ_BYTES) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._free: list[memoryview] = []
        self._lent = 0

    def get(self) -> memoryview:
        """A free buffer, or a new anonymous private mapping of ``size`` bytes; give it back with :meth:`put`."""
        with self._lock:
            if self._free:
                self._lent += 1
                return self._free.pop()
        ring = memoryview(mmap.mmap(-1, self.size, flags=mmap.MAP_PRIVATE))
        with self._lock:
            self._lent += 1
        return ring

    def put(self, ring: memoryview) -> None:
        """Give back a buffer :meth:`get` lent."""
        with self._lock:
            self._lent -= 1
            self._free.append(ring)

    def release(self) -> int:
        """Unmap every free buffer (the lent ones stay with their calls); returns how many."""
        with self._lock:
            free, self._free = self._free, []
        for ring in free:
            m = ring.obj
            ring.release()
            with contextlib.suppress(BufferError):  # a view still exported: unmapped when it goes
                m.close()  # type: ignore[attr-defined]
        return len(free)

    def mapped(self) -> int:
        """Buffers mapped now: lent plus free."""
        with self._lock:
            return self._lent + len(self._free)


def receive_to_file(s: Any, fd: int, offset: int, n: int, deadline: float, rings: Rings) -> None:
    """Receive ``n`` body bytes through a buffer lent by ``rings`` (1 MiB by default) into file
    ``fd`` at ``offset`` by ``deadline``, hashing each piece there."""
    ring = rings.get()
    try:
        _receive_to_file(ring, s, fd, offset, n, deadline)
    finally:
        rings.put(ring)


def _receive_to_file(ring: memoryview, s: Any, fd: int, offset: int, n: int, deadline: float) -> None:
    h, step = s.hasher, len(ring)
    h.reset()
    recv_into, update = s.sock.recv_into, h.update
    pos = 0
    while pos < n:
        want = min(n - pos, step)
        try:
            got = recv_into(ring, want, WAITALL)
        except BlockingIOError:
            raise TimeoutError(f"body stalled after {pos} of {n} bytes") from None
        if got == 0:
            raise ConnectionClosed(f"connection closed after {pos} of {n} body bytes")
        with ring[:got] as piece:
            update(piece)
            done = 0
            while done < got:  # pwrite may be short (signals, a full tmpfs raises ENOSPC)
                with piece[done:] as rest:
                    done += os.pwrite(fd, rest, offset + pos + done)
        pos += got
        if pos < n:
            _late(deadline, "body", pos, n)
