"""A TCP relay in front of an S3 server that corrupts bucket answers: it flips one byte of the
body of the next ``flips`` ranged answers (206) at body offset ``at``, and, being a
``support.relay.GateRelay``, can hold every answer after ``after`` bytes until ``release()`` (a
deterministic slow bucket, so that askers are parked on the owner while the bad bytes land).

It follows HTTP/1.1 keep-alive connections (requests without pipelining, as botocore sends
them): the client -> server side records each request's method, the server -> client side
parses each answer's status line and ``Content-Length`` to find where its body starts and ends.
An answer it cannot frame (no ``Content-Length``) ends the parsing of that connection: the rest
passes unchanged."""

from __future__ import annotations

import collections
import threading

from support.relay import GateRelay, Shape


class FlipRelay(GateRelay):
    """``flipped``: how many answers had their byte flipped so far."""

    def __init__(self, target: tuple[str, int], *, flips: int, at: int, after: int | None = None) -> None:
        self.at = at
        self.flips_left = flips
        self.flipped = 0  # answers whose byte was flipped
        self._lock = threading.Lock()
        super().__init__(target, after)

    def _shapes(self) -> tuple[Shape, Shape]:
        methods: collections.deque[str] = collections.deque()
        return _Requests(methods), _Answers(self, methods)

    def take_flip(self) -> bool:
        """Whether the answer starting now gets a flipped byte (one of the ``flips`` left)."""
        with self._lock:
            if self.flips_left <= 0:
                return False
            self.flips_left -= 1
            return True

    def count_flip(self) -> None:
        with self._lock:
            self.flipped += 1


class _Requests:
    """The client -> server side: records each request's method (GET/HEAD: no body) for the
    answers' side; a request with a body ends the parsing. The bytes pass unchanged."""

    def __init__(self, methods: collections.deque[str]) -> None:
        self.methods = methods
        self.buf = b""

    def __call__(self, data: bytearray) -> bytearray:
        self.buf += data
        while (end := self.buf.find(b"\r\n\r\n")) >= 0:  # header blocks (GET/HEAD: no body)
            head, self.buf = self.buf[:end], self.buf[end + 4 :]
            self.methods.append(head.split(b" ", 1)[0].decode("latin-1"))
            if _content_length(head):  # a request body: skip what already arrived, and stop parsing requests
                self.buf = b""
                break
        return data


class _Answers:
    """The server -> client side: frames each answer by its status line and ``Content-Length``
    and flips the byte at ``relay.at`` of a 206 body the relay grants a flip to."""

    def __init__(self, relay: FlipRelay, methods: collections.deque[str]) -> None:
        self.relay, self.methods = relay, methods
        self.buf = bytearray()
        self.body_left = 0  # bytes of the current answer's body still to come
        self.body_pos = 0  # bytes of it passed
        self.flip = False
        self.framing = True

    def __call__(self, data: bytearray) -> bytearray:
        at = self.relay.at
        out = bytearray()
        while data and self.framing:
            if self.body_left:
                take = min(self.body_left, len(data))
                piece = data[:take]
                if self.flip and self.body_pos <= at < self.body_pos + take:
                    piece[at - self.body_pos] ^= 0xFF
                    self.flip = False
                    self.relay.count_flip()
                out += piece
                del data[:take]
                self.body_left -= take
                self.body_pos += take
                continue
            self.buf += data
            data = bytearray()
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                break
            head = bytes(self.buf[:end])
            out += self.buf[: end + 4]
            data = self.buf[end + 4 :]
            self.buf = bytearray()
            status = int(head.split(b" ", 2)[1])
            method = self.methods.popleft() if self.methods else "GET"
            n = _content_length(head)
            if method == "HEAD" or status in (204, 304) or n == 0:
                continue
            if n is None:
                self.framing = False  # cannot frame it: pass the rest unchanged
                break
            self.body_left, self.body_pos = n, 0
            self.flip = status == 206 and n > at and self.relay.take_flip()
        out += data
        return out


def _content_length(head: bytes) -> int | None:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value.strip())
    return None
