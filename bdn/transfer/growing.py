"""Cut-through: a chunk still landing from the bucket, sent to parked askers while it lands.

Why: store and forward (a chunk leaves a node only once it is whole and verified) costs one
bucket read of the whole chunk before the first byte moves on: at an owner's share of a slow
bucket (1/8 of 200 Mbit/s in bench/swarm) that is 1.35 s per 4 MiB chunk, and the downlinks of
the other nodes idle meanwhile (docs/decisions/0008-cut-through-no-relays.md). Here the owner's fresh
bytes go on as they land, at the rate the bucket gives them.

How (DESIGN.md, "Cut-through"):

- The owner reads a chunk from the bucket in parts (``bdn.daemon.fetch.policy.bucket_parts``),
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

import bisect
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
    """The owner's copy of the chunk failed: the answer in flight must end (close the stream).
    ``started``: whether any PART of the answer was sent (if not, a plain BUSY answers it)."""

    def __init__(self, msg: str, started: bool = True) -> None:
        super().__init__(msg)
        self.started = started


class Growing:
    """One chunk of ``length`` bytes landing in ``path`` at byte ``base``. Thread-safe.

    Its bytes land by an owner's bucket read (``Growing(path, base, parts)``): ``parts`` are
    ``(offset, length)`` within the chunk, covering it in order, each filled from its start by
    one ranged GET and reported by :meth:`landed` (part, bytes so far); :meth:`wait` returns
    the landed bytes as merged ``[start, end)`` ranges."""

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

    def wait(self, version: int, timeout: float) -> tuple[int, str, list[tuple[int, int]]]:
        """``(version, state, landed [start, end) ranges, merged and sorted)`` once the version
        differs from ``version`` or ``timeout`` s passed."""
        with self._cond:
            if self._version == version and self.state == GROWING:
                self._cond.wait(timeout)
            ranges: list[tuple[int, int]] = []
            for (p_off, _), n in zip(self.parts, self._landed):
                if n:
                    _merge_t(ranges, p_off, p_off + n)
            return self._version, self.state, ranges


def _merge(ranges: list[list[int]], a: int, b: int) -> None:
    """Add ``[a, b)`` to the sorted, disjoint, merged ``ranges`` (in place)."""
    i = bisect.bisect_left(ranges, [a, a])
    if i and ranges[i - 1][1] >= a:
        i -= 1
        ranges[i][1] = max(ranges[i][1], b)
    else:
        ranges.insert(i, [a, b])
    while i + 1 < len(ranges) and ranges[i + 1][0] <= ranges[i][1]:
        ranges[i][1] = max(ranges[i][1], ranges.pop(i + 1)[1])


def _merge_t(ranges: list[tuple[int, int]], a: int, b: int) -> None:
    """``[a, b)`` appended to ``ranges`` built in order (an owner's parts), merged with the last."""
    if ranges and ranges[-1][1] >= a:
        ranges[-1] = (ranges[-1][0], max(ranges[-1][1], b))
    else:
        ranges.append((a, b))


class GrowingChunks:
    """The chunks landing here from the bucket now, by swarm address (thread-safe)."""

    def __init__(self, on_start: Callable[[str], None] | None = None) -> None:
        self._by_address: dict[str, Growing] = {}
        self._lock = threading.Lock()
        #: Event hook (address): a chunk started growing (the daemon wakes parked requests).
        self.on_start = on_start

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
    sock: socket.socket,
    seal: Callable[[wire.FrameType, bytes], bytes],
    fd: int,
    g: Growing,
    offset: int,
    length: int,
    *,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Send ``length`` bytes at ``offset`` of the growing chunk ``g`` (open as ``fd``) as PART
    frames sealed by ``seal`` (the connection's session), as they land.

    A piece of fewer than ``MIN_PIECE`` new bytes waits for more unless it closes a gap (ends
    where sent bytes begin), reaches the range's end or the chunk is verified. The chunk's last
    ``HOLD_BYTES`` go only once ``g`` is verified.

    Raises:
        CutOff: the owner's copy failed (``started`` False when no frame went out yet: the
            caller may answer BUSY on the open stream instead), or the answer outlived
            ``MAX_ANSWER_S``.
        OSError, TimeoutError: the socket failed (the caller closes the connection).
    """
    end = offset + length
    hold = g.length - min(HOLD_BYTES, g.length)
    sent: list[list[int]] = []  # merged [start, end) ranges sent, in chunk offsets
    left = length
    out = sock.fileno()
    version = -1
    started = last = clock()
    framed = False  # a PART went out: the asker is inside a cut-through answer
    while left:
        version, state, landed = g.wait(version, KEEPALIVE_S)
        if state == FAILED:
            raise CutOff("the owner's copy of the chunk failed", framed)
        now = clock()
        if now - started > MAX_ANSWER_S:
            raise CutOff(f"the chunk was still landing after {MAX_ANSWER_S:g} s")
        limit = end if state == VERIFIED else min(end, hold)
        for start, stop in _unsent(landed, sent, offset, limit):
            n = stop - start
            if n < MIN_PIECE and state != VERIFIED and stop < limit and not _starts_at(sent, stop):
                continue
            framed = True
            sock.sendall(seal(wire.FrameType.PART, wire.encode_part(start - offset, n)), socket.MSG_MORE)
            sendfile_all(out, fd, g.base + start, n)
            _merge(sent, start, stop)
            left -= n
            last = now
        if left and now - last >= KEEPALIVE_S:
            framed = True
            sock.sendall(seal(wire.FrameType.PART, wire.encode_part(0, 0)))
            last = now


def _unsent(landed: list[tuple[int, int]], sent: list[list[int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """The pieces of the ``landed`` ranges inside ``[lo, hi)`` that no ``sent`` range covers."""
    out = []
    for a, b in landed:
        a, b = max(a, lo), min(b, hi)
        for s, e in sent:
            if e <= a:
                continue
            if s >= b:
                break
            if s > a:
                out.append((a, s))
            a = max(a, e)
        if a < b:
            out.append((a, b))
    return out


def _starts_at(ranges: list[list[int]], pos: int) -> bool:
    i = bisect.bisect_left(ranges, [pos, pos])
    return i < len(ranges) and ranges[i][0] == pos
