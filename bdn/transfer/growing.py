"""Cut-through: a chunk still landing from the bucket, sent to parked askers while it lands.

Why: store and forward (a chunk leaves a node only once it is whole and verified) costs one
bucket read of the whole chunk before the first byte moves on: at an owner's share of a slow
bucket (1/8 of 200 Mbit/s in bench/swarm) that is 1.35 s per 4 MiB chunk, and the downlinks of
the other nodes idle meanwhile (bench/NOTES.md, the N = 8 timeline). Here the owner's fresh
bytes go on as they land, at the rate the bucket gives them.

How (DESIGN.md, "Cut-through"):

- The owner reads a chunk from the bucket in parts (``bdn.daemon.fetch.plan.bucket_parts``),
  in parallel, straight into the target file's mapping. Each part reports the bytes it has
  landed so far (:meth:`Growing.landed`, from the bucket threads). :class:`GrowingChunks` holds
  the chunks in that state by swarm address.
- A transfer-server thread answering an ASK that accepts cut-through (``wire.ASK_CUT_THROUGH``)
  for such a chunk calls :func:`send_growing`: every part's new bytes as PART frames
  (bdn.proto.wire) by ``sendfile`` from the same file, in the order they land; a keep-alive
  PART while nothing lands.
- The chunk's last ``HOLD_BYTES`` are sent only once the owner verified the whole chunk against
  its digest (:meth:`Growing.verified`): a receiver never completes a chunk its sender has not
  checked, so a ``CORRUPT`` answer stays the sender's fault (the blame rule of store and
  forward is kept). If the owner's copy fails (bad bytes, a bucket error, a cancelled fetch:
  :meth:`Growing.failed`), :func:`send_growing` raises :class:`CutOff` and the server closes the
  connection: the receiver sees ``FAILED`` and asks again, nobody is blamed for bad bytes.

Memory order: the bucket thread writes a part's bytes into the mapping and only then reports
them under the lock; the server thread reads the counts under the lock and only then
``sendfile``s those bytes from the page cache (the same tmpfs pages).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

from bdn.proto import wire
from bdn.transfer.sockio import sendfile_all

#: Bytes at the end of a chunk held back until the owner verified the whole chunk.
HOLD_BYTES = 64 << 10
#: A part's new bytes are sent once at least this many landed (or the part is complete).
MIN_PIECE = 64 << 10
#: Seconds between keep-alive PARTs while nothing lands (the receiver's silence timer is 30 s).
KEEPALIVE_S = 5.0
#: Seconds a cut-through answer may last at most (the owner's fetch fails long before).
MAX_ANSWER_S = 600.0

GROWING, VERIFIED, FAILED = "growing", "verified", "failed"


class CutOff(Exception):
    """The owner's copy of the chunk failed: the answer in flight must end (close the stream)."""


class Growing:
    """One chunk landing in ``path`` at byte ``base`` in ``parts`` (``(offset, length)`` within
    the chunk, covering it in order). Thread-safe."""

    def __init__(self, path: str, base: int, parts: list[tuple[int, int]]) -> None:
        if not parts:
            raise ValueError("a growing chunk needs at least one part")
        self.path = path
        self.base = base
        self.parts = list(parts)
        self.length = sum(n for _, n in parts)
        self._landed = [0] * len(parts)
        self.state = GROWING
        self._version = 0
        self._cond = threading.Condition()
        #: Set by the owner once the chunk is registered and announced (its first bucket part
        #: holds a slot); a read that ends before that was never visible to anyone.
        self.announced = False

    def landed(self, part: int, n: int) -> None:
        """Event (a bucket thread): the first ``n`` bytes of part ``part`` are in the file."""
        with self._cond:
            if self.state != GROWING or n <= self._landed[part]:
                return
            self._landed[part] = min(n, self.parts[part][1])
            self._version += 1
            self._cond.notify_all()

    def verified(self) -> None:
        """Event: the whole chunk matched its digest; the held-back bytes may go."""
        self._end(VERIFIED)

    def failed(self) -> None:
        """Event: this copy will never be whole and verified (the answers in flight are cut off)."""
        self._end(FAILED)

    def _end(self, state: str) -> None:
        with self._cond:
            if self.state == GROWING:
                self.state = state
                self._version += 1
                self._cond.notify_all()

    def wait(self, version: int, timeout: float) -> tuple[int, str, list[int]]:
        """``(version, state, landed bytes per part)`` once the version differs from ``version``
        or ``timeout`` s passed."""
        with self._cond:
            if self._version == version and self.state == GROWING:
                self._cond.wait(timeout)
            return self._version, self.state, list(self._landed)


class GrowingChunks:
    """The chunks landing here from the bucket now, by swarm address (thread-safe)."""

    def __init__(self) -> None:
        self._by_address: dict[str, Growing] = {}
        self._lock = threading.Lock()
        #: Event hook (address): a chunk started growing (the daemon wakes parked requests).
        self.on_start: Callable[[str], None] | None = None

    def start(self, address: str, g: Growing) -> None:
        """``g`` is landing now as the chunk at ``address``."""
        with self._lock:
            self._by_address[address] = g
        if self.on_start is not None:
            self.on_start(address)

    def end(self, address: str, g: Growing) -> None:
        """``g`` is no longer landing (verified or failed: call that on ``g`` first)."""
        with self._lock:
            if self._by_address.get(address) is g:
                del self._by_address[address]

    def get(self, address: str) -> Growing | None:
        """The chunk at ``address`` while it lands here, or None."""
        with self._lock:
            return self._by_address.get(address)

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_address)


def send_growing(
    sock: socket.socket, seal: Callable[[wire.FrameType, bytes], bytes], fd: int, g: Growing,
    offset: int, length: int, *, clock: Callable[[], float] = time.monotonic,
) -> None:
    """Send ``length`` bytes at ``offset`` of the growing chunk ``g`` (open as ``fd``) as PART
    frames sealed by ``seal`` (the connection's session), as they land.

    Raises:
        CutOff: the owner's copy failed, or the answer outlived ``MAX_ANSWER_S``.
        OSError, TimeoutError: the socket failed (the caller closes the connection).
    """
    end = offset + length
    hold = g.length - min(HOLD_BYTES, g.length)
    sent = [0] * len(g.parts)  # bytes of each part sent or outside the asked range, from its start
    for i, (p_off, p_len) in enumerate(g.parts):
        sent[i] = min(max(offset - p_off, 0), p_len)
    left = sum(max(0, min(p_off + p_len, end) - max(p_off, offset)) for p_off, p_len in g.parts)
    out = sock.fileno()
    version = -1
    started = last = clock()
    while left:
        version, state, landed = g.wait(version, KEEPALIVE_S)
        if state == FAILED:
            raise CutOff("the owner's copy of the chunk failed")
        now = clock()
        if now - started > MAX_ANSWER_S:
            raise CutOff(f"the chunk was still landing after {MAX_ANSWER_S:g} s")
        limit = end if state == VERIFIED else min(end, hold)
        for i, (p_off, p_len) in enumerate(g.parts):
            upto = min(p_off + landed[i], limit) - p_off  # sendable bytes of part i, from its start
            new = upto - sent[i]
            if new <= 0 or (new < MIN_PIECE and upto < p_len and state != VERIFIED and upto + p_off < limit):
                continue
            start = p_off + sent[i]
            sock.sendall(seal(wire.FrameType.PART, wire.encode_part(start - offset, new)), socket.MSG_MORE)
            sendfile_all(out, fd, g.base + start, new)
            sent[i] = upto
            left -= new
            last = now
        if left and now - last >= KEEPALIVE_S:
            sock.sendall(seal(wire.FrameType.PART, wire.encode_part(0, 0)))
            last = now

