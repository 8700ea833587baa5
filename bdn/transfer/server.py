"""The transfer server: serves verified chunk bytes with ``os.sendfile`` over authenticated
persistent connections (the wire of bdn.proto.wire).

Threads, not the event loop: one accept thread and one thread per connection (at most
``max_connections`` authenticated ones, peers keeping a few persistent streams each, plus at most
``max_handshakes`` still in their handshake, the oldest dropped for a newcomer). ``os.sendfile`` and ``recv_into``
release the GIL for the whole system call, so connection threads run in parallel on every core
while the daemon's asyncio loop keeps the control plane; the bytes never enter Python.

What one ASK gets (the upload policy's verdict, DATA by ``sendfile``, PARTs while the chunk
grows, BUSY, NOT_HERE) is bdn.transfer.answer, with the daemon's ``resolve`` and ``admit``
callbacks. Beside them, thread-safe and called on connection threads:

- ``on_take(peer_node_id, take) -> bool``: whether the owner gives the bucket read of a chunk up
  to the asking peer (a ``TAKE`` frame, answered ``GIVE``); it may block briefly (the decision is
  made on the daemon's loop). Without it every TAKE is refused.
- ``on_have(sock, session, payload)``: serves a HAVE subscription on its connection.

Any handshake failure closes the connection without a word (bdn.proto.wire); any protocol error
after it (garbage, an oversized frame, a bad tag) closes that connection only.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Self

from bdn.proto import handshake, wire
from bdn.proto.errors import AuthError, ProtocolError
from bdn.proto.keys import NODE_ID_RE, SwarmKeys
from bdn.transfer.answer import (  # re-exported: the admission and location types
    CUT_OFF_RETRY_S,
    GRANTED,
    NOT_HERE,
    Admit,
    Answers,
    Busy,
    Granted,
    Location,
    Resolve,
    Verdict,
    admit_all,
)
from bdn.transfer.deadlines import Deadlines
from bdn.transfer.files import FileCache
from bdn.transfer.growing import CutOff
from bdn.transfer.sockio import ConnectionClosed, frame_buffer, read_frame, set_timeouts
from bdn.transfer.stats import ServerStats

log = logging.getLogger("bdn.transfer.server")

#: Serves a HAVE subscription on its connection: (socket, session, the client's HAVE payload).
OnHave = Callable[[socket.socket, handshake.Session, memoryview], None]
#: Decides a TAKE: (the asking peer's node id, the request) -> granted.
OnTake = Callable[[str, wire.Take], bool]

__all__ = [
    "CUT_OFF_RETRY_S",
    "GRANTED",
    "NOT_HERE",
    "Admit",
    "Busy",
    "Granted",
    "Location",
    "OnHave",
    "OnTake",
    "Resolve",
    "ServerStats",
    "TransferServer",
    "Verdict",
    "admit_all",
]


@dataclass(eq=False)  # hashed by identity: kept in a set
class _Conn:
    sock: socket.socket
    thread: threading.Thread | None = None
    peer: str = ""
    authed: bool = False
    buf: memoryview = field(default_factory=frame_buffer)


class TransferServer:
    """Serves chunks to authenticated peers of the swarm on ``(host, port)`` (port 0: any).

    ``start()`` binds and returns ``(host, port)``; ``close()`` stops accepting, closes every
    connection and joins the threads. Timeouts are seconds; ``clock`` gives unix seconds and
    ``nonce(n)`` n random bytes (both injectable for tests).
    """

    def __init__(
        self,
        keys: SwarmKeys,
        node_id: str,
        resolve: Resolve,
        *,
        admit: Admit = admit_all,
        host: str = "127.0.0.1",
        port: int = 0,
        max_connections: int = 256,
        max_handshakes: int = 64,
        handshake_timeout_s: float = 10.0,
        idle_timeout_s: float = 300.0,
        send_timeout_s: float = 60.0,
        max_open_files: int = 256,
        sndbuf: int | None = None,
        clock: Callable[[], float] = time.time,
        nonce: Callable[[int], bytes] = secrets.token_bytes,
        on_have: OnHave | None = None,
        on_take: OnTake | None = None,
    ) -> None:
        if not NODE_ID_RE.match(node_id):
            raise ValueError(f"node id {node_id[:80]!r} does not match {NODE_ID_RE.pattern}")
        self.keys = keys
        self.node_id = node_id
        self._on_have = on_have
        self._on_take = on_take
        self._host, self._port = host, port
        self._max_conns = max_connections
        self._max_pending = max(1, max_handshakes)
        self._hs_timeout = handshake_timeout_s
        self._idle_timeout = idle_timeout_s
        self._send_timeout = send_timeout_s
        self._sndbuf = sndbuf
        self._clock = clock
        self._nonce = nonce
        self._files = FileCache(max_open_files)
        self._lock = threading.Lock()
        self._conns: set[_Conn] = set()
        # Connections still in their handshake, oldest first. Bounded on their own, so strangers
        # without the secret cannot fill ``max_connections``: when full, the oldest is dropped to
        # admit the newcomer (an honest peer's hello comes within a round trip; holding the
        # slots needs more new connections per handshake time than there are slots).
        self._pending: dict[_Conn, None] = {}
        self._authed = 0  # connections past their handshake (what max_connections bounds)
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self._closing = threading.Event()
        self.stats = ServerStats()
        self._deadlines = Deadlines()
        self._answers = Answers(resolve, admit, self._files, self.stats, self._lock, send_timeout_s, self._deadlines)
        self.address: tuple[str, int] | None = None

    # ---- life -------------------------------------------------------------------------------

    def start(self) -> tuple[str, int]:
        """Bind, listen and start the accept thread; the bound ``(host, port)``."""
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        ls = socket.socket(family, socket.SOCK_STREAM)
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind((self._host, self._port))
        ls.listen(128)
        self._listener = ls
        self.address = ls.getsockname()[:2]
        self._acceptor = threading.Thread(target=self._accept_loop, name="bdn-transfer-accept", daemon=True)
        self._acceptor.start()
        return self.address

    def close(self) -> None:
        """Stop serving: no new connections, every open one closed, threads joined."""
        self._closing.set()
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        if self._acceptor is not None:
            self._acceptor.join(10)
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for c in conns:
            if c.thread is not None:
                c.thread.join(10)
        self._deadlines.close()
        self._files.close()

    def forget(self, path: str | os.PathLike[str]) -> None:
        """Close the cached descriptor of ``path`` (call it when a snapshot is collected, so its
        shm pages are freed; in-flight answers finish first)."""
        self._files.forget(os.fspath(path))

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open_connections(self) -> int:
        """Connections being served now (handshaking ones included)."""
        with self._lock:
            return len(self._conns)

    # ---- connections ------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._closing.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError:
                if self._closing.is_set():
                    return
                time.sleep(0.05)  # EMFILE and friends: back off instead of spinning
                continue
            evicted: _Conn | None = None
            with self._lock:
                # not len(_conns) - len(_pending): a dropped handshake stays in _conns until its
                # thread has closed it, and would count as authenticated meanwhile
                full = self._authed >= self._max_conns
                if not full:
                    if len(self._pending) >= self._max_pending:
                        evicted = next(iter(self._pending))
                        del self._pending[evicted]
                        self.stats.handshakes_evicted += 1
                    conn = _Conn(sock)
                    self._conns.add(conn)
                    self._pending[conn] = None
                    self.stats.connections += 1
            if evicted is not None:
                try:  # its thread's read ends at once; that thread closes the socket
                    evicted.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            if full:
                sock.close()
                continue
            conn.thread = threading.Thread(target=self._serve, args=(conn,), name="bdn-transfer-conn", daemon=True)
            conn.thread.start()

    def _serve(self, conn: _Conn) -> None:
        sock = conn.sock
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._sndbuf:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._sndbuf)
            set_timeouts(sock, self._hs_timeout, self._send_timeout)
            session = self._handshake(conn)
            with self._lock:
                if session is not None and conn not in self._pending:
                    session = None  # evicted while it finished: the newer connection has the slot
                self._pending.pop(conn, None)
                if session is not None:
                    conn.authed = True
                    self._authed += 1
            if session is None:
                return
            set_timeouts(sock, self._idle_timeout)
            while not self._closing.is_set():
                try:
                    ftype, body = read_frame(sock, conn.buf)
                except ConnectionClosed:
                    return  # the peer hung up between requests: normal
                if ftype not in wire.CLIENT_FRAMES:
                    raise ProtocolError(f"unexpected {ftype.name} frame from a client")
                payload = session.open(ftype, body)
                if ftype == wire.FrameType.ASK:
                    self._answers.answer(sock, session, wire.decode_ask(payload))
                elif ftype == wire.FrameType.TAKE:
                    take = wire.decode_take(payload)
                    granted = self._on_take is not None and self._on_take(session.peer_node_id, take)
                    with self._lock:
                        self.stats.takes += 1
                        self.stats.given += int(granted)
                    sock.sendall(session.seal(wire.FrameType.GIVE, wire.encode_give(granted)))
                elif self._on_have is not None:
                    # a HAVE subscription (bdn.transfer.announce): the connection carries HAVE
                    # frames to the client from now on, on this thread, until it ends
                    self._on_have(sock, session, payload)
                    return
                # HAVE without a feed: checking the tag keeps the sequence numbers in step.
        except CutOff as e:
            log.debug("transfer connection from %s cut off: %s", conn.peer or "?", e)
        except (ProtocolError, AuthError) as e:
            with self._lock:
                self.stats.protocol_errors += 1
            log.debug("transfer connection from %s closed: %s", conn.peer or "?", e)
        except (OSError, TimeoutError) as e:
            log.debug("transfer connection from %s ended: %s", conn.peer or "?", e)
        except Exception:  # a bug in resolve/admit: this connection ends, the server serves on
            log.exception("transfer connection from %s: resolve or admit failed", conn.peer or "?")
        finally:
            sock.close()  # first: a connection no longer counted is one its peer sees closed
            with self._lock:
                self._conns.discard(conn)
                self._pending.pop(conn, None)
                if conn.authed:
                    self._authed -= 1

    def _handshake(self, conn: _Conn) -> handshake.Session | None:
        sock = conn.sock
        nonce = self._nonce(handshake.NONCE_BYTES)
        sock.sendall(handshake.server_hello(nonce))
        try:
            ftype, body = read_frame(sock, conn.buf)
        except ProtocolError:
            ftype, body = None, None
        try:
            if ftype != wire.FrameType.CLIENT_HELLO or body is None:
                raise AuthError("transfer handshake refused")
            accept, session = handshake.check_client_hello(self.keys, self.node_id, nonce, body, self._clock())
        except AuthError:
            # one answer for every failure: the connection closed, nothing sent
            with self._lock:
                self.stats.handshakes_refused += 1
            return None
        conn.peer = session.peer_node_id
        sock.sendall(accept)
        return session
