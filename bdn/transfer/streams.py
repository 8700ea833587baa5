"""Per-peer pools of persistent authenticated transfer streams, for bdn.transfer.client.

``StreamPool.acquire(peer)`` hands out an idle stream to ``peer`` or opens a new one (TCP
connect + the transfer handshake of bdn.proto.handshake, framed by bdn.proto.wire), at most
``streams_per_peer`` per peer; ``release(peer, stream, keep)`` returns it. ``connect(peer)``
opens one outside the pool (HAVE subscriptions, bdn.transfer.announce). A ``Stream`` carries
what receiving an answer needs (bdn.transfer.receive): the socket, the session's tags, a frame
buffer and a per-stream xxh3-128 hasher (a file target's 1 MiB receive buffer is lent per call by
the client's ``Rings``: bdn.transfer.receive).

Threads: every method is thread-safe (one condition variable guards the pool); ``acquire``
blocks its caller while all of a peer's streams are busy, and ``connect`` blocks for the TCP
connect and handshake (up to ``connect_timeout_s``) without holding the lock.

Failure rules: a stream that fails in any way (reset, timeout, a body cut short, a bad tag) is
closed and never reused: its user releases it with ``keep=False``. An idle stream the peer
closed (its idle timeout, a restart) is dropped on the next ``acquire`` and replaced, not
reported. ``acquire`` never raises for a peer's fault: it returns a one-line reason instead.
"""

from __future__ import annotations

import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import xxhash

from bdn.proto import handshake, wire
from bdn.proto.errors import AuthError, ProtocolError
from bdn.proto.keys import MAX_SKEW_S, NODE_ID_RE, SwarmKeys
from bdn.transfer.sockio import ConnectionClosed, frame_buffer, read_frame, set_timeouts


@dataclass(frozen=True, slots=True)
class Peer:
    """Where a peer's transfer server listens, and the node id it must prove it is."""

    node_id: str
    host: str
    port: int


class HandshakeRefused(ConnectionError):
    """The peer closed the connection during the handshake or failed to prove the secret."""


@dataclass(eq=False)
class Stream:
    """One open, authenticated transfer connection.

    ``sock`` (blocking, ``TCP_NODELAY``), ``session`` (the handshake's frame tags),
    ``recv_timeout`` (seconds of silence now set on ``sock``: whoever changes it with
    ``sockio.set_timeouts`` updates this), ``buf`` (a frame buffer, ``sockio.frame_buffer``),
    and ``hasher`` (xxh3-128, reset per chunk). Compared by identity.
    """

    sock: socket.socket
    session: handshake.Session
    recv_timeout: float
    buf: memoryview = field(default_factory=frame_buffer)
    hasher: xxhash.xxh3_128 = field(default_factory=xxhash.xxh3_128)


@dataclass(eq=False)
class _PeerStreams:
    idle: list[Stream] = field(default_factory=list)
    open: int = 0  # idle + in use + being opened
    streams: set[Stream] = field(default_factory=set)


class StreamPool:
    """Up to ``streams_per_peer`` persistent streams per peer of the daemon ``node_id``
    (thread-safe).

    Args:
        keys: the swarm's keys (bdn.proto.keys.derive_keys).
        node_id: this daemon's node id (``NODE_ID_RE``), proven in every handshake.
        streams_per_peer: at most this many connections to one peer (>= 1).
        rcvbuf: ``SO_RCVBUF`` in bytes set before connecting (None: the kernel's autotuning).
        connect_timeout_s / io_timeout_s: seconds for TCP connect + handshake, and of silence
            on a new stream (its ``recv_timeout``); ``io_timeout_s`` is also how long
            ``acquire`` waits by default for a busy peer's stream.
        clock / nonce: unix seconds and n random bytes (injectable for tests).

    Raises:
        ValueError: a malformed ``node_id`` or ``streams_per_peer`` < 1.
    """

    def __init__(
        self,
        keys: SwarmKeys,
        node_id: str,
        *,
        streams_per_peer: int = 4,
        rcvbuf: int | None = 4 << 20,
        connect_timeout_s: float = 5.0,
        io_timeout_s: float = 30.0,
        clock: Callable[[], float] = time.time,
        nonce: Callable[[int], bytes] = secrets.token_bytes,
    ) -> None:
        if not NODE_ID_RE.match(node_id):
            raise ValueError(f"node id {node_id[:80]!r} does not match {NODE_ID_RE.pattern}")
        if streams_per_peer < 1:
            raise ValueError("streams_per_peer must be >= 1")
        self.keys = keys
        self.node_id = node_id
        self._per_peer = streams_per_peer
        self._rcvbuf = rcvbuf
        self._connect_timeout = connect_timeout_s
        self._io_timeout = io_timeout_s
        self._clock = clock
        self._nonce = nonce
        self._cond = threading.Condition()
        self._peers: dict[Peer, _PeerStreams] = {}
        self._closed = False

    def acquire(self, peer: Peer, patience_s: float | None = None) -> Stream | str:
        """An idle or new pooled stream to ``peer``, waiting up to ``patience_s`` seconds
        (default ``io_timeout_s``) for one while all are busy. Blocks the calling thread.

        Returns the stream (hand it back with ``release``), or a one-line reason when none
        came: ``"transfer client closed"``, ``"peer <id>: no free transfer stream"`` or
        ``"peer <id>: connect: <ExceptionType>: <text>"`` (a stream that could not be opened).
        """
        deadline = time.monotonic() + (self._io_timeout if patience_s is None else patience_s)
        with self._cond:
            while True:
                if self._closed:
                    return "transfer client closed"
                ps = self._peers.setdefault(peer, _PeerStreams())
                while ps.idle:
                    stream = ps.idle.pop()
                    if _alive(stream.sock):
                        return stream
                    # the peer closed it while idle (its idle timeout, a restart): not a failure
                    # of this fetch; drop it and use another or open a new one
                    ps.open -= 1
                    ps.streams.discard(stream)
                    stream.sock.close()
                if ps.open < self._per_peer:
                    ps.open += 1
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    return f"peer {peer.node_id}: no free transfer stream"
                self._cond.wait(left)
        try:
            stream = self.connect(peer)
        except (OSError, TimeoutError, ProtocolError, AuthError) as e:
            with self._cond:
                ps.open -= 1
                self._cond.notify()
            # "connect:" tells a stream that could not be opened from one that stalled on an
            # answer (bdn.daemon.fetch.wire_source.stalled penalises only the latter)
            return f"peer {peer.node_id}: connect: {one_line(e)}"
        with self._cond:
            ps.streams.add(stream)
            if self._closed:
                stream.sock.close()
        return stream

    def release(self, peer: Peer, stream: Stream, keep: bool) -> None:
        """Hand back ``stream`` that ``acquire(peer)`` gave: kept idle for the next request when
        ``keep`` (and the pool is open), else closed (``keep=False`` after any failure)."""
        with self._cond:
            ps = self._peers[peer]
            if keep and not self._closed:
                ps.idle.append(stream)
            else:
                ps.open -= 1
                ps.streams.discard(stream)
                stream.sock.close()
            self._cond.notify()

    def connect(self, peer: Peer) -> Stream:
        """A new authenticated stream to ``peer``, outside the pool (the caller owns and closes
        it; HAVE subscriptions keep one of their own so they never wait behind chunk requests).
        Raises OSError (unreachable, timed out), HandshakeRefused (the server closed without
        accepting: wrong secret, skewed clock) or ProtocolError (not a bdn transfer server)."""
        family = socket.AF_INET6 if ":" in peer.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._rcvbuf:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self._rcvbuf)  # before connect: window scale
            sock.settimeout(self._connect_timeout)
            sock.connect((peer.host, peer.port))
            sock.settimeout(None)
            set_timeouts(sock, self._connect_timeout, self._io_timeout)
            buf = frame_buffer()
            # the whole handshake within two connect timeouts, however its bytes trickle in
            deadline = time.monotonic() + 2 * self._connect_timeout
            ftype, body = read_frame(sock, buf, deadline)
            if ftype != wire.FrameType.SERVER_HELLO:
                raise ProtocolError("not a bdn transfer server")
            server_nonce = handshake.parse_server_hello(body)
            hello, session = handshake.client_hello(
                self.keys, self.node_id, peer.node_id, server_nonce, self._nonce(handshake.NONCE_BYTES), self._clock()
            )
            sock.sendall(hello)
            try:
                ftype, body = read_frame(sock, buf, deadline)
            except ConnectionClosed:
                raise HandshakeRefused(
                    "refused the transfer handshake (another partition secret, a clock off by over "
                    f"{MAX_SKEW_S} s, or another daemon than {peer.node_id} at {peer.host}:{peer.port})"
                ) from None
            if ftype != wire.FrameType.ACCEPT:
                raise ProtocolError(f"answered the handshake with a {ftype.name} frame")
            handshake.check_accept(session, body)
            set_timeouts(sock, self._io_timeout)
            return Stream(sock, session, self._io_timeout, buf)
        except BaseException:
            sock.close()
            raise

    def close_peer(self, peer: Peer) -> None:
        """Close every stream to ``peer`` (a peer that left the swarm): idle ones at once, busy
        ones by shutting their sockets, so the requests in flight on them fail."""
        with self._cond:
            ps = self._peers.get(peer)
            if ps is None:
                return
            idle, ps.idle = ps.idle, []
            ps.open -= len(idle)
            for s in idle:
                ps.streams.discard(s)
            busy = list(ps.streams)
            self._cond.notify_all()
        for s in idle:
            s.sock.close()
        for s in busy:
            try:
                s.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        """Close every stream; later ``acquire`` calls return ``"transfer client closed"``."""
        with self._cond:
            self._closed = True
            peers = list(self._peers)
        for p in peers:
            self.close_peer(p)
        with self._cond:
            self._cond.notify_all()

    def streams_open(self, peer: Peer) -> int:
        """Connections to ``peer`` now (idle, busy or being opened)."""
        with self._cond:
            ps = self._peers.get(peer)
            return ps.open if ps else 0


def _alive(sock: socket.socket) -> bool:
    """Whether an idle stream is still open: nothing to read (EAGAIN) means open; EOF, a reset
    or unexpected bytes mean it cannot carry a request."""
    try:
        sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        return False  # EOF, or bytes no request asked for
    except BlockingIOError:
        return True
    except OSError:
        return False


def one_line(e: BaseException) -> str:
    """``"<ExceptionType>: <first line of its text>"`` (just the type when it has no text), for
    one-line failure reasons."""
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


__all__ = ["HandshakeRefused", "Peer", "Stream", "StreamPool", "one_line"]
