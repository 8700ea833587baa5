"""TCP relays for daemon tests: one that throttles (and can cut) what a server sends, one that
holds a server's answers back after a number of bytes until the test releases them."""

from __future__ import annotations

import socket
import struct
import threading
import time


class Relay:
    """A TCP relay in front of one daemon's transfer server that passes the server's bytes on at
    ``rate`` bytes/s per connection; ``cut()`` breaks every connection at once (a reset both ways), as when the
    sender's host dies: nothing more of the body it was sending arrives."""

    def __init__(self, target: tuple[str, int], rate: float) -> None:
        self.target, self.rate = target, rate
        self.ls = socket.create_server(("127.0.0.1", 0))
        self.port = self.ls.getsockname()[1]
        self.forwarded = 0  # server -> client bytes passed on
        self.socks: list[socket.socket] = []
        self.dead = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.dead.is_set():
            try:
                c, _ = self.ls.accept()
            except OSError:
                return
            try:
                s = socket.create_connection(self.target)
            except OSError:
                c.close()
                continue
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
            self.socks += [c, s]
            threading.Thread(target=self._pipe, args=(c, s, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(s, c, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, throttle: bool) -> None:
        try:
            while not self.dead.is_set():
                data = src.recv(16 << 10)
                if not data or self.dead.is_set():
                    break
                dst.sendall(data)
                if throttle:
                    self.forwarded += len(data)
                    time.sleep(len(data) / self.rate)
        except OSError:
            pass

    def cut(self) -> None:
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


class GateRelay:
    """A TCP relay in front of ``target`` (e.g. the S3 server) that passes the first ``after``
    bytes the server sends on each connection, then holds the rest until ``release()``: the
    reads behind it are stuck half way through their bodies, a deterministic slow bucket."""

    def __init__(self, target: tuple[str, int], after: int) -> None:
        self.target, self.after = target, after
        self.open = threading.Event()
        self.held = threading.Event()  # some connection reached ``after`` bytes and waits
        self.ls = socket.create_server(("127.0.0.1", 0))
        self.port = self.ls.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
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
            threading.Thread(target=self._pipe, args=(c, s, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(s, c, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, gated: bool) -> None:
        passed = 0
        try:
            while True:
                want = 16 << 10
                if gated and not self.open.is_set():
                    if passed >= self.after:
                        self.held.set()
                        self.open.wait()
                    else:
                        want = min(want, self.after - passed)
                data = src.recv(want)
                if not data:
                    break
                dst.sendall(data)
                passed += len(data)
        except OSError:
            pass
        finally:
            for x in (src, dst):
                try:
                    x.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

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
