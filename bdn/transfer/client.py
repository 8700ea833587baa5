"""The transfer client: fetches chunks from peers straight into the target file's mapping.

``TransferClient.fetch_into`` asks a peer for a chunk over a persistent authenticated stream
(bdn.proto.wire), ``recv_into``s the body directly into ``dest[offset:offset+length]`` (the
target file's ``mmap``, or any writable buffer) in large reads, hashes each piece in place while
it is still in cache (xxh3-128, a per-stream hasher reset per chunk) and reports ``OK`` only
when the digest matched. No buffer is allocated per chunk: the bytes go from the socket to the
mapping in one kernel copy.

Threads: ``fetch_into`` blocks its caller; call it from several threads at once (it is
thread-safe) or through ``FetchPool`` (bdn.transfer.pool). Measured on this build (CPython 3.11,
python-xxhash 3.4 / xxHash 0.8): ``xxh3_128`` and ``xxh3_128().update`` release the GIL (a
thread sleeping 1 ms wakes on time while another hashes 256 MiB in one 30-50 ms call), and so do
``recv_into`` and ``os.sendfile`` (plain blocking system calls). So threads scale over cores
here and worker processes (with their own mappings and IPC) would buy nothing.

Each peer gets up to ``streams_per_peer`` connections, opened on demand and kept; a stream that
fails in any way (reset, timeout, a body cut short, a bad tag) is closed and never reused, and
the chunk is reported ``FAILED``: never a short success.
"""

from __future__ import annotations

import enum
import mmap
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
from bdn.transfer.receive import (
    body_limit,
    receive_hashed,
    receive_parts,
    receive_to_file,
)
from bdn.transfer.sockio import ConnectionClosed, frame_buffer, read_frame, set_timeouts


@dataclass(frozen=True, slots=True)
class Peer:
    """Where a peer's transfer server listens, and the node id it must prove it is."""

    node_id: str
    host: str
    port: int


class Outcome(enum.Enum):
    """How a fetch ended: only ``OK`` means the bytes in ``dest`` are the chunk."""

    OK = "ok"
    BUSY = "busy"  # the peer's upload policy said ask again later (retry_after_s)
    NOT_HERE = "not_here"  # the peer does not hold the chunk
    CORRUPT = "corrupt"  # the bytes arrived but do not match the digest: penalise the peer
    FAILED = "failed"  # connection, handshake or protocol failure (error says which)


@dataclass(frozen=True, slots=True)
class FetchResult:
    """``outcome``; ``retry_after_s`` for BUSY; a one-line ``error`` for CORRUPT and FAILED."""

    outcome: Outcome
    retry_after_s: float = 0.0
    error: str = ""
    cut_through: bool = False  # the answer came as PARTs while the sender's bucket read landed

    @property
    def ok(self) -> bool:
        """True when the outcome is ``Outcome.OK``: the chunk arrived whole and matched its digest."""
        return self.outcome is Outcome.OK


OK = FetchResult(Outcome.OK)
CUT_OK = FetchResult(Outcome.OK, cut_through=True)
NOT_HERE = FetchResult(Outcome.NOT_HERE)


class HandshakeRefused(ConnectionError):
    """The peer closed the connection during the handshake or failed to prove the secret."""


@dataclass(eq=False)
class _Stream:
    sock: socket.socket
    session: handshake.Session
    recv_timeout: float
    buf: memoryview = field(default_factory=frame_buffer)
    hasher: xxhash.xxh3_128 = field(default_factory=xxhash.xxh3_128)
    ring: memoryview | None = None  # receive buffer for file-descriptor targets


@dataclass(eq=False)
class _PeerStreams:
    idle: list[_Stream] = field(default_factory=list)
    open: int = 0  # idle + in use + being opened
    streams: set[_Stream] = field(default_factory=set)


class TransferClient:
    """Per-peer persistent transfer streams of the daemon ``node_id`` (thread-safe).

    Args:
        keys: the swarm's keys (bdn.proto.keys.derive_keys).
        node_id: this daemon's node id (``NODE_ID_RE``), proven in every handshake.
        streams_per_peer: at most this many connections to one peer; a caller finding them all
            busy waits for one (up to ``io_timeout_s``).
        rcvbuf: ``SO_RCVBUF`` in bytes set before connecting (None: the kernel's autotuning).
        connect_timeout_s / io_timeout_s: seconds for TCP connect + handshake, and of silence
            on a stream (a request held with ``wait_s`` adds that until its answer begins). A
            body that stops ends within two ``io_timeout_s`` of its last byte (one
            ``MSG_WAITALL`` call, bdn.transfer.receive); a DATA body as a whole has
            ``receive.body_limit`` (four timeouts, one more per 16 MiB past the first 16), a cut-through answer
            ``wait_s`` + 4 timeouts.
        clock / nonce: unix seconds and n random bytes (injectable for tests).
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

    # ---- public -----------------------------------------------------------------------------

    def fetch_into(
        self,
        peer: Peer,
        address: str,
        dest: memoryview | bytearray | mmap.mmap | int,
        offset: int,
        length: int,
        digest: str,
        *,
        wait_s: float = 0.0,
        snapshot: str | None = None,
        chunk_offset: int = 0,
        cut_through: bool = False,
    ) -> FetchResult:
        """Fetch ``length`` bytes at ``chunk_offset`` of the chunk at swarm ``address`` from
        ``peer`` into ``dest`` at ``offset`` and check them against ``digest`` (32 hex chars,
        xxh3-128 of exactly those bytes).

        ``dest`` is either a writable buffer (the target file's mmap: ``recv_into`` lands the
        bytes in it directly, one kernel copy) or an open file descriptor (the target file: the
        bytes are received into this stream's 1 MiB buffer, hashed there while cache-hot and
        ``pwrite``n at ``offset``; on tmpfs a full-page write skips the zeroing of a freshly
        reserved page that a first store through a mapping costs, see bench/transfer).

        ``wait_s`` (0..60) lets the peer hold the request while it fetches the chunk.
        ``cut_through`` (a buffer ``dest`` only): the peer may answer with the chunk's bytes as
        they land from its bucket read (PART frames, bdn.transfer.growing); the whole range is
        hashed once the parts cover it. Blocks the calling thread. On anything but ``OK`` the range of ``dest`` holds unspecified bytes;
        the caller must not index or serve them.

        Raises:
            ValueError: bad arguments (range outside ``dest``, a malformed address or digest):
                a bug in the caller, not a peer failure.
        """
        flags = wire.ASK_CUT_THROUGH if cut_through and not isinstance(dest, int) else 0
        try:
            ask = wire.encode_ask(wire.Ask(address, chunk_offset, length, int(wait_s * 1000), snapshot, flags))
        except ProtocolError as e:
            raise ValueError(str(e)) from None
        if len(digest) != 32:
            raise ValueError("digest must be 32 hex characters")
        if isinstance(dest, int):
            if offset < 0:
                raise ValueError(f"negative file offset {offset}")
            return self._fetch(peer, ask, dest, offset, length, wait_s, digest, False)
        with memoryview(dest) as whole:
            if whole.readonly or not (0 <= offset and offset + length <= whole.nbytes):
                raise ValueError(f"range {offset}+{length} is not inside a writable buffer of {whole.nbytes} bytes")
            with whole.cast("B")[offset : offset + length] as target:
                return self._fetch(peer, ask, target, 0, length, wait_s, digest, bool(flags))

    def _fetch(
        self, peer: Peer, ask: bytes, sink: memoryview | int, offset: int, length: int, wait_s: float, digest: str,
        cut_ok: bool,
    ) -> FetchResult:
        stream = self._acquire(peer)
        if isinstance(stream, FetchResult):
            return stream
        keep = False
        try:
            result = self._exchange(stream, ask, sink, offset, length, wait_s, digest, cut_ok)
            # a peer that sent wrong bytes may have sent more than it announced: never reuse it
            keep = result.outcome not in (Outcome.FAILED, Outcome.CORRUPT)
            return result
        finally:
            self._release(peer, stream, keep)

    def take(self, peer: Peer, identity: str, index: int) -> bool:
        """Ask ``peer``, the owner of stored chunk ``index`` of ``identity``, to give its bucket
        read of the chunk up to this node (a ``TAKE`` frame, bdn.proto.wire). True only when the
        owner answered ``GIVE`` granted; False when it refused, and on any failure (no stream,
        a broken connection, an owner of an older version that does not know the frame). Blocks
        the calling thread up to ``io_timeout_s``.

        Raises:
            ValueError: a malformed identity or index (a bug in the caller).
        """
        try:
            payload = wire.encode_take(wire.Take(identity, index))
        except ProtocolError as e:
            raise ValueError(str(e)) from None
        # not behind the chunk requests parked on this peer's pooled streams: a stream of its
        # own when none is idle (a take is rare: a few per download, at its very end)
        pooled = self._acquire(peer, patience_s=0.0)
        own = isinstance(pooled, FetchResult)
        try:
            stream = self.connect(peer) if own else pooled
        except (OSError, TimeoutError, ProtocolError, AuthError):
            return False
        assert isinstance(stream, _Stream)
        keep = False
        try:
            if stream.recv_timeout != self._io_timeout:
                set_timeouts(stream.sock, self._io_timeout)
                stream.recv_timeout = self._io_timeout
            stream.sock.sendall(stream.session.seal(wire.FrameType.TAKE, payload))
            ftype, answer = _answer(stream, self._io_timeout)
            if ftype != wire.FrameType.GIVE:
                raise ProtocolError(f"unexpected {ftype.name} frame as an answer to TAKE")
            granted = wire.decode_give(answer)
            keep = True
            return granted
        except (ConnectionClosed, TimeoutError, OSError, ProtocolError, AuthError):
            return False
        finally:
            if own:
                stream.sock.close()
            else:
                self._release(peer, stream, keep)

    def close_peer(self, peer: Peer) -> None:
        """Close every stream to ``peer`` (a peer that left the swarm): idle ones at once, busy
        ones by shutting their sockets, so the fetches in flight on them end as FAILED."""
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
        """Close every stream; later fetches fail."""
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

    # ---- streams ----------------------------------------------------------------------------

    def _acquire(self, peer: Peer, patience_s: float | None = None) -> _Stream | FetchResult:
        """An idle or new pooled stream to ``peer``, waiting up to ``patience_s`` (default
        ``io_timeout_s``) for one while all are busy; a FAILED result when none came."""
        deadline = time.monotonic() + (self._io_timeout if patience_s is None else patience_s)
        with self._cond:
            while True:
                if self._closed:
                    return FetchResult(Outcome.FAILED, error="transfer client closed")
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
                    return FetchResult(Outcome.FAILED, error=f"peer {peer.node_id}: no free transfer stream")
                self._cond.wait(left)
        try:
            stream = self.connect(peer)
        except (OSError, TimeoutError, ProtocolError, AuthError) as e:
            with self._cond:
                ps.open -= 1
                self._cond.notify()
            # "connect:" tells a stream that could not be opened from one that stalled on an
            # answer (bdn.daemon.fetch.wire_source.stalled penalises only the latter)
            return FetchResult(Outcome.FAILED, error=f"peer {peer.node_id}: connect: {_one_line(e)}")
        with self._cond:
            ps.streams.add(stream)
            if self._closed:
                stream.sock.close()
        return stream

    def _release(self, peer: Peer, stream: _Stream, keep: bool) -> None:
        with self._cond:
            ps = self._peers[peer]
            if keep and not self._closed:
                ps.idle.append(stream)
            else:
                ps.open -= 1
                ps.streams.discard(stream)
                stream.sock.close()
            self._cond.notify()

    def connect(self, peer: Peer) -> _Stream:
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
            ftype, body = read_frame(sock, buf)
            if ftype != wire.FrameType.SERVER_HELLO:
                raise ProtocolError("not a bdn transfer server")
            server_nonce = handshake.parse_server_hello(body)
            hello, session = handshake.client_hello(
                self.keys, self.node_id, peer.node_id, server_nonce, self._nonce(handshake.NONCE_BYTES), self._clock()
            )
            sock.sendall(hello)
            try:
                ftype, body = read_frame(sock, buf)
            except ConnectionClosed:
                raise HandshakeRefused(
                    "refused the transfer handshake (another partition secret, a clock off by over "
                    f"{MAX_SKEW_S} s, or another daemon than {peer.node_id} at {peer.host}:{peer.port})"
                ) from None
            if ftype != wire.FrameType.ACCEPT:
                raise ProtocolError(f"answered the handshake with a {ftype.name} frame")
            handshake.check_accept(session, body)
            set_timeouts(sock, self._io_timeout)
            return _Stream(sock, session, self._io_timeout, buf)
        except BaseException:
            sock.close()
            raise

    # ---- one request ------------------------------------------------------------------------

    def _exchange(
        self, s: _Stream, ask: bytes, sink: memoryview | int, offset: int, length: int, wait_s: float, digest: str,
        cut_ok: bool = False,
    ) -> FetchResult:
        peer = s.session.peer_node_id
        cut = False
        try:
            want_timeout = self._io_timeout + wait_s
            if want_timeout != s.recv_timeout:
                set_timeouts(s.sock, want_timeout)
                s.recv_timeout = want_timeout
            s.sock.sendall(s.session.seal(wire.FrameType.ASK, ask))
            ftype, payload = _answer(s, want_timeout)
            if ftype == wire.FrameType.NOT_HERE:
                return NOT_HERE
            if ftype == wire.FrameType.BUSY:
                return FetchResult(Outcome.BUSY, retry_after_s=wire.decode_busy(payload))
            cut = ftype == wire.FrameType.PART
            if cut:
                if not cut_ok or isinstance(sink, int):
                    raise ProtocolError("a cut-through answer to a request that did not accept one")
                receive_parts(s, sink, payload, wait_s, self._io_timeout)
                s.hasher.reset()
                s.hasher.update(sink)
            elif ftype != wire.FrameType.DATA:
                raise ProtocolError(f"unexpected {ftype.name} frame as an answer")
            elif (n := wire.decode_data(payload)) != length:
                raise ProtocolError(f"announced {n} bytes for a {length}-byte request")
            else:
                # ``wait_s`` was for the answer to come; the body gets ``io_timeout_s`` of silence
                # (within two of them a stopped body ends) and ``body_limit`` as a whole
                if s.recv_timeout != self._io_timeout:
                    set_timeouts(s.sock, self._io_timeout)
                    s.recv_timeout = self._io_timeout
                deadline = time.monotonic() + body_limit(length, self._io_timeout)
                if isinstance(sink, int):
                    receive_to_file(s, sink, offset, length, deadline)
                else:
                    receive_hashed(s, sink, deadline)
        except (ConnectionClosed, TimeoutError, OSError, ProtocolError, AuthError) as e:
            # ``cut_through``: it broke inside a cut-through answer (the sender's copy may have
            # failed its own check and been cut off: bdn.transfer.growing; not the sender's fault)
            return FetchResult(Outcome.FAILED, error=f"peer {peer}: {_one_line(e)}", cut_through=cut)
        if s.hasher.hexdigest() != digest:
            return FetchResult(Outcome.CORRUPT, error=f"peer {peer}: chunk bytes do not match digest {digest}",
                               cut_through=cut)
        return CUT_OK if cut else OK

def _answer(s: _Stream, within_s: float) -> tuple[wire.FrameType, memoryview | bytes]:
    """The first frame after a request that is not a HAVE (announcements are not answers: skipped)
    and its opened payload. It must come within ``within_s`` of the call: HAVEs do not extend
    that (a peer sending them without end held the calling thread for ever,
    tests/test_transfer_slow_body.py). Raises TimeoutError, ProtocolError, ConnectionClosed."""
    deadline = time.monotonic() + within_s
    while True:
        ftype, body = read_frame(s.sock, s.buf)
        if ftype not in wire.SERVER_FRAMES:
            raise ProtocolError(f"unexpected {ftype.name} frame from a transfer server")
        payload = s.session.open(ftype, body)
        if ftype != wire.FrameType.HAVE:
            return ftype, payload
        if time.monotonic() > deadline:
            raise TimeoutError(f"no answer within {within_s:g} s (only announcements)")


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


def _one_line(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


__all__ = ["FetchResult", "HandshakeRefused", "Outcome", "Peer", "TransferClient"]
