"""A TCP relay in front of an S3 server that corrupts bucket answers: it flips one byte of the
body of the next ``flips`` ranged answers (206) at body offset ``at``, and, like
``support.relay.GateRelay``, can hold every answer after ``after`` bytes until ``release()`` (a
deterministic slow bucket, so that askers are parked on the owner while the bad bytes land).

It follows HTTP/1.1 keep-alive connections (requests without pipelining, as botocore sends
them): the client -> server side records each request's method, the server -> client side
parses each answer's status line and ``Content-Length`` to find where its body starts and ends.
An answer it cannot frame (no ``Content-Length``) ends the parsing of that connection: the rest
passes unchanged."""

from __future__ import annotations

import collections
import socket
import threading


class FlipRelay:
    def __init__(self, target: tuple[str, int], *, flips: int, at: int, after: int | None = None) -> None:
        self.target, self.at, self.after = target, at, after
        self.flips_left = flips
        self.flipped = 0  # answers whose byte was flipped
        self.open = threading.Event()
        if after is None:
            self.open.set()
        self.held = threading.Event()  # some connection reached ``after`` bytes and waits
        self._lock = threading.Lock()
        self.ls = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.ls.getsockname()[1]}"
        self.socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.ls.accept()
            except OSError:
                return
            try:
                s = socket.create_connection(self.target)
            except OSError:
                c.close()
                continue
            self.socks += [c, s]
            methods: collections.deque[str] = collections.deque()
            threading.Thread(target=self._requests, args=(c, s, methods), daemon=True).start()
            threading.Thread(target=self._answers, args=(s, c, methods), daemon=True).start()

    def _take_flip(self) -> bool:
        with self._lock:
            if self.flips_left <= 0:
                return False
            self.flips_left -= 1
            return True

    def _requests(self, src: socket.socket, dst: socket.socket, methods: collections.deque[str]) -> None:
        buf = b""
        try:
            while True:
                data = src.recv(16 << 10)
                if not data:
                    break
                buf += data
                while (end := buf.find(b"\r\n\r\n")) >= 0:  # header blocks (GET/HEAD: no body)
                    head, buf = buf[:end], buf[end + 4 :]
                    methods.append(head.split(b" ", 1)[0].decode("latin-1"))
                    n = _content_length(head)
                    if n:  # a request body: skip what already arrived, and stop parsing requests
                        buf = b""
                        break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            _shut(src, dst)

    def _answers(self, src: socket.socket, dst: socket.socket, methods: collections.deque[str]) -> None:
        passed = 0
        buf = bytearray()
        body_left = 0  # bytes of the current answer's body still to come
        body_pos = 0  # bytes of it passed
        flip = False
        framing = True
        try:
            while True:
                want = 16 << 10
                if self.after is not None and not self.open.is_set():
                    if passed >= self.after:
                        self.held.set()
                        self.open.wait()
                    else:
                        want = min(want, self.after - passed)
                data = bytearray(src.recv(want))
                if not data:
                    break
                passed += len(data)
                out = bytearray()
                while data and framing:
                    if body_left:
                        take = min(body_left, len(data))
                        piece = data[:take]
                        if flip and body_pos <= self.at < body_pos + take:
                            piece[self.at - body_pos] ^= 0xFF
                            flip = False
                            with self._lock:
                                self.flipped += 1
                        out += piece
                        del data[:take]
                        body_left -= take
                        body_pos += take
                        continue
                    buf += data
                    data = bytearray()
                    end = buf.find(b"\r\n\r\n")
                    if end < 0:
                        break
                    head = bytes(buf[:end])
                    out += buf[: end + 4]
                    data = buf[end + 4 :]
                    buf = bytearray()
                    status = int(head.split(b" ", 2)[1])
                    method = methods.popleft() if methods else "GET"
                    n = _content_length(head)
                    if method == "HEAD" or status in (204, 304) or n == 0:
                        continue
                    if n is None:
                        framing = False  # cannot frame it: pass the rest unchanged
                        break
                    body_left, body_pos = n, 0
                    flip = status == 206 and n > self.at and self._take_flip()
                out += data
                if out:
                    dst.sendall(out)
        except (OSError, ValueError, IndexError):
            pass
        finally:
            _shut(src, dst)

    def release(self) -> None:
        """Let every held and later byte through."""
        self.open.set()

    def close(self) -> None:
        self.open.set()
        self.ls.close()
        for s in self.socks:
            try:
                s.close()
            except OSError:
                pass


def _content_length(head: bytes) -> int | None:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value.strip())
    return None


def _shut(*socks: socket.socket) -> None:
    for x in socks:
        try:
            x.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
