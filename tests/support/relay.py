"""TCP relays for daemon tests, in front of one server on loopback.

``TcpRelay`` is the shared piece: the listener, the accept loop that opens one connection to the
server per client connection, and the two loops of each (client -> server, server -> client).
``Relay`` throttles (and can cut) what the server sends; ``GateRelay`` holds the server's answers
back after a number of bytes until the test releases them, passing each piece through a shaping
function (``support.fliprelay.FlipRelay`` uses it to corrupt bucket answers)."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable

#: bytes asked of ``recv`` at a time
PIECE = 16 << 10

Loop = Callable[[], None]
Shape = Callable[[bytearray], bytes | bytearray]


class TcpRelay:
    """A listener on ``127.0.0.1`` (``port``, ``url``) relaying every connection to ``target``.

    Subclasses set their own attributes before calling ``__init__`` (the accept loop starts in
    it) and give the two loops of one connection in :meth:`_loops`. ``socks``: every socket
    opened, both sides, for closing them."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.ls = socket.create_server(("127.0.0.1", 0))
        self.port = self.ls.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accepting(self) -> bool:
        return True

    def _accept(self) -> None:
        while self._accepting():
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
            for loop in self._loops(c, s):
                threading.Thread(target=loop, daemon=True).start()

    def _loops(self, client: socket.socket, server: socket.socket) -> tuple[Loop, Loop]:
        """The client -> server and the server -> client loop of one relayed connection."""
        raise NotImplementedError


def shut(*socks: socket.socket) -> None:
    """``shutdown(SHUT_RDWR)`` each socket (ends a ``recv`` blocked in another thread), errors ignored."""
    for x in socks:
        try:
            x.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _unchanged(data: bytearray) -> bytearray:
    return data


class Relay(TcpRelay):
    """A TCP relay in front of one daemon's transfer server that passes the server's bytes on at
    ``rate`` bytes/s per connection; ``cut()`` breaks every connection at once (a reset both ways), as when the
    sender's host dies: nothing more of the body it was sending arrives."""

    def __init__(self, target: tuple[str, int], rate: float) -> None:
        self.rate = rate
        self.forwarded = 0  # server -> client bytes passed on
        self.dead = threading.Event()
        super().__init__(target)

    def _accepting(self) -> bool:
        return not self.dead.is_set()

    def _loops(self, client: socket.socket, server: socket.socket) -> tuple[Loop, Loop]:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        return (lambda: self._pipe(client, server, False)), (lambda: self._pipe(server, client, True))

    def _pipe(self, src: socket.socket, dst: socket.socket, throttle: bool) -> None:
        try:
            while not self.dead.is_set():
                data = src.recv(PIECE)
                if not data or self.dead.is_set():
                    break
                dst.sendall(data)
                if throttle:
                    self.forwarded += len(data)
                    time.sleep(len(data) / self.rate)
        except OSError:
            pass

    def cut(self) -> None:
        """Reset every connection (SO_LINGER 0) and stop listening."""
        self.dead.set()
        for s in self.socks:
            try:
                # shutdown first: close() alone does not end a recv blocked in another thread
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass
        self.ls.close()


class GateRelay(TcpRelay):
    """A TCP relay in front of ``target`` (e.g. the S3 server) that passes the first ``after``
    bytes the server sends on each connection, then holds the rest until ``release()``: the
    reads behind it are stuck half way through their bodies, a deterministic slow bucket.
    ``after`` None holds nothing.

    Every piece read passes through the connection's shaping functions before it is sent on
    (:meth:`_shapes`; by default unchanged); a shaping function that raises ValueError or
    IndexError ends that connection."""

    def __init__(self, target: tuple[str, int], after: int | None) -> None:
        self.after = after
        self.open = threading.Event()
        if after is None:
            self.open.set()
        self.held = threading.Event()  # some connection reached ``after`` bytes and waits
        super().__init__(target)

    def _shapes(self) -> tuple[Shape, Shape]:
        """The client -> server and the server -> client shaping functions of a new connection."""
        return _unchanged, _unchanged

    def _loops(self, client: socket.socket, server: socket.socket) -> tuple[Loop, Loop]:
        up, down = self._shapes()
        return (lambda: self._pipe(client, server, up, False)), (lambda: self._pipe(server, client, down, True))

    def _pipe(self, src: socket.socket, dst: socket.socket, shape: Shape, gated: bool) -> None:
        passed = 0
        try:
            while True:
                want = PIECE
                if gated and not self.open.is_set():
                    if passed >= self.after:
                        self.held.set()
                        self.open.wait()
                    else:
                        want = min(want, self.after - passed)
                data = src.recv(want)
                if not data:
                    break
                passed += len(data)
                out = shape(bytearray(data))
                if out:
                    dst.sendall(out)
        except (OSError, ValueError, IndexError):
            pass
        finally:
            shut(src, dst)

    def hold(self) -> None:
        """From now on hold every byte the server sends, on every connection (a piece already
        received may still pass), until :meth:`release`."""
        self.after = 0
        self.open.clear()

    def release(self) -> None:
        """Let every held and later byte through."""
        self.open.set()

    def close(self) -> None:
        """Release what is held, stop listening and close every connection."""
        self.open.set()
        self.ls.close()
        for s in self.socks:
            try:
                s.close()
            except OSError:
                pass
