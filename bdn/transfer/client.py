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

Each peer gets up to ``streams_per_peer`` connections, opened on demand and kept (the pool and
the handshake: bdn.transfer.streams, which also defines ``Peer`` and ``HandshakeRefused``,
re-exported here); a stream that fails in any way (reset, timeout, a body cut short, a bad tag)
is closed and never reused, and the chunk is reported ``FAILED``: never a short success.
"""

from __future__ import annotations

import contextlib
import enum
import mmap
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from bdn.proto import wire
from bdn.proto.errors import AuthError, ProtocolError
from bdn.proto.keys import SwarmKeys
from bdn.transfer.receive import (
    Rings,
    body_limit,
    receive_hashed,
    receive_parts,
    receive_to_file,
)
from bdn.transfer.sockio import ConnectionClosed, read_frame, set_timeouts
from bdn.transfer.streams import (
    HandshakeRefused,
    Peer,
    Stream,
    StreamPool,
    one_line,
)


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
ABORTED = FetchResult(Outcome.FAILED, error="aborted by the asker")


class Abort:
    """Ends one ``fetch_into`` from another thread (its asker gave up: the download was cancelled).
    :meth:`set` shuts the socket of the stream the fetch holds (the blocked ``recv_into`` returns,
    the fetch ends ``FAILED`` and the stream is closed, never reused); a fetch not yet on a stream
    ends before it sends its request. Only that fetch's stream: the peer's other streams, and the
    other fetches on them, go on (``close_peer`` ends them all). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self.is_set = False

    def set(self) -> None:
        """End the fetch now (idempotent)."""
        with self._lock:
            self.is_set = True
            if self._sock is not None:
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)

    def _bind(self, sock: socket.socket | None) -> bool:
        """The fetch holds ``sock`` now (None: it gives it back); False when already set."""
        with self._lock:
            self._sock = sock
            return not self.is_set


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
        self._streams = StreamPool(
            keys,
            node_id,
            streams_per_peer=streams_per_peer,
            rcvbuf=rcvbuf,
            connect_timeout_s=connect_timeout_s,
            io_timeout_s=io_timeout_s,
            clock=clock,
            nonce=nonce,
        )  # checks node_id and streams_per_peer (ValueError)
        self.keys = keys
        self.node_id = node_id
        self._io_timeout = io_timeout_s
        #: the buffers a whole answer for a file is received through (``rings.release()`` when idle)
        self.rings = Rings()

    # ---- public -----------------------------------------------------------------------------

    def fetch_into(
        self,
        peer: Peer,
        address: str,
        dest: memoryview | bytearray | mmap.mmap | int,
        offset: int,
        length: int,
        digest: str | None,
        *,
        wait_s: float = 0.0,
        snapshot: str | None = None,
        chunk_offset: int = 0,
        cut_through: bool = False,
        fd: int | None = None,
        on_data: Callable[[], None] | None = None,
        abort: Abort | None = None,
    ) -> FetchResult:
        """Fetch ``length`` bytes at ``chunk_offset`` of the chunk at swarm ``address`` from
        ``peer`` into ``dest`` at ``offset`` and check them against ``digest`` (32 hex chars,
        xxh3-128 of exactly those bytes). ``digest`` None: the bytes are not checked here and
        ``OK`` only means the answer arrived whole; the caller verifies them otherwise (a
        snapshot without a manifest, whose chunk ids are no digests: its objects are checked
        whole against the bucket's checksums, bdn.daemon.snapshots.foreign_source).

        ``dest`` is either a writable buffer (the target file's mmap: ``recv_into`` lands the
        bytes in it directly, one kernel copy) or an open file descriptor (the target file: the
        bytes are received into this stream's 1 MiB buffer, hashed there while cache-hot and
        ``pwrite``n at ``offset``; on tmpfs a full-page write skips the zeroing of a freshly
        reserved page that a first store through a mapping costs, see bench/transfer).

        ``fd`` (with a buffer ``dest``: the open file that ``dest`` maps from byte 0): a DATA
        answer lands as with an ``int`` ``dest`` (buffer, hash, ``pwrite`` at ``offset``), a
        cut-through answer in ``dest``. On /dev/shm this skips the page-table fill of the
        mapping (recycled pages) and the zeroing of fresh ones: bench/swarm's loopback ceiling
        (3 runs each, BENCHMARKS.md "How fast can one node receive?") measured 1797 against
        1784 MB/s on recycled pages and 1244 against 1115 MB/s on fresh ones.

        ``wait_s`` (0..60) lets the peer hold the request while it fetches the chunk.
        ``cut_through`` (a buffer ``dest`` only): the peer may answer with the chunk's bytes as
        they land from its bucket read (PART frames, bdn.transfer.growing); the whole range is
        hashed once the parts cover it. ``on_data``: called (on this thread) when a
        whole-chunk answer (DATA) begins, before its body: the asker times the peer's sending
        from there (bdn.daemon.fetch.policy.SourceBook). ``abort`` (:class:`Abort`): set from
        another thread, it ends this fetch at once as ``FAILED`` (its stream closed). Blocks the calling thread. On anything but ``OK`` the range of ``dest`` holds unspecified bytes;
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
        if digest is not None and len(digest) != 32:
            raise ValueError("digest must be 32 hex characters")
        if isinstance(dest, int):
            if offset < 0:
                raise ValueError(f"negative file offset {offset}")
            return self._fetch(peer, ask, dest, offset, length, wait_s, digest, False, on_data=on_data, abort=abort)
        with memoryview(dest) as whole:
            if whole.readonly or not (0 <= offset and offset + length <= whole.nbytes):
                raise ValueError(f"range {offset}+{length} is not inside a writable buffer of {whole.nbytes} bytes")
            with whole.cast("B")[offset : offset + length] as target:
                return self._fetch(
                    peer,
                    ask,
                    target,
                    0,
                    length,
                    wait_s,
                    digest,
                    bool(flags),
                    None if fd is None else (fd, offset),
                    on_data,
                    abort,
                )

    def _fetch(
        self,
        peer: Peer,
        ask: bytes,
        sink: memoryview | int,
        offset: int,
        length: int,
        wait_s: float,
        digest: str | None,
        cut_ok: bool,
        file_sink: tuple[int, int] | None = None,
        on_data: Callable[[], None] | None = None,
        abort: Abort | None = None,
    ) -> FetchResult:
        if abort is not None and abort.is_set:
            return ABORTED
        stream = self._streams.acquire(peer)
        if isinstance(stream, str):
            return FetchResult(Outcome.FAILED, error=stream)
        keep = False
        try:
            if abort is not None and not abort._bind(stream.sock):
                keep = True  # nothing was sent on it
                return ABORTED
            result = self._exchange(stream, ask, sink, offset, length, wait_s, digest, cut_ok, file_sink, on_data)
            if abort is not None and abort.is_set and result.outcome is Outcome.FAILED:
                result = ABORTED
            # a peer that sent wrong bytes may have sent more than it announced: never reuse it
            keep = result.outcome not in (Outcome.FAILED, Outcome.CORRUPT)
            return result
        finally:
            if abort is not None:
                abort._bind(None)  # (before the stream goes back: a later set() must not shut it)
            self._streams.release(peer, stream, keep)

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
        pooled = self._streams.acquire(peer, patience_s=0.0)
        own = isinstance(pooled, str)
        try:
            stream = self.connect(peer) if own else pooled
        except (OSError, TimeoutError, ProtocolError, AuthError):
            return False
        assert isinstance(stream, Stream)
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
                self._streams.release(peer, stream, keep)

    def connect(self, peer: Peer) -> Stream:
        """A new authenticated stream to ``peer``, outside the pool (the caller owns and closes
        it; HAVE subscriptions keep one of their own so they never wait behind chunk requests).
        Raises OSError (unreachable, timed out), HandshakeRefused (the server closed without
        accepting: wrong secret, skewed clock) or ProtocolError (not a bdn transfer server)."""
        return self._streams.connect(peer)

    def close_peer(self, peer: Peer) -> None:
        """Close every stream to ``peer`` (a peer that left the swarm): idle ones at once, busy
        ones by shutting their sockets, so the fetches in flight on them end as FAILED."""
        self._streams.close_peer(peer)

    def close(self) -> None:
        """Close every stream; later fetches fail."""
        self._streams.close()

    def streams_open(self, peer: Peer) -> int:
        """Connections to ``peer`` now (idle, busy or being opened)."""
        return self._streams.streams_open(peer)

    # ---- one request ------------------------------------------------------------------------

    def _exchange(
        self,
        s: Stream,
        ask: bytes,
        sink: memoryview | int,
        offset: int,
        length: int,
        wait_s: float,
        digest: str | None,
        cut_ok: bool = False,
        file_sink: tuple[int, int] | None = None,
        on_data: Callable[[], None] | None = None,
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
                if on_data is not None:
                    on_data()
                # ``wait_s`` was for the answer to come; the body gets ``io_timeout_s`` of silence
                # (within two of them a stopped body ends) and ``body_limit`` as a whole
                if s.recv_timeout != self._io_timeout:
                    set_timeouts(s.sock, self._io_timeout)
                    s.recv_timeout = self._io_timeout
                deadline = time.monotonic() + body_limit(length, self._io_timeout)
                if isinstance(sink, int):
                    receive_to_file(s, sink, offset, length, deadline, self.rings)
                elif file_sink is not None:
                    receive_to_file(s, file_sink[0], file_sink[1], length, deadline, self.rings)
                else:
                    receive_hashed(s, sink, deadline)
        except (ConnectionClosed, TimeoutError, OSError, ProtocolError, AuthError) as e:
            # ``cut_through``: it broke inside a cut-through answer (the sender's copy may have
            # failed its own check and been cut off: bdn.transfer.growing; not the sender's fault)
            return FetchResult(Outcome.FAILED, error=f"peer {peer}: {one_line(e)}", cut_through=cut)
        if digest is not None and s.hasher.hexdigest() != digest:
            return FetchResult(
                Outcome.CORRUPT, error=f"peer {peer}: chunk bytes do not match digest {digest}", cut_through=cut
            )
        return CUT_OK if cut else OK


def _answer(s: Stream, within_s: float) -> tuple[wire.FrameType, memoryview | bytes]:
    """The first frame after a request that is not a HAVE (announcements are not answers: skipped)
    and its opened payload. It must come within ``within_s`` of the call: HAVEs do not extend
    that (a peer sending them without end held the calling thread for ever,
    tests/test_transfer_slow_body.py), nor does a frame trickled in a byte per receive timeout.
    Raises TimeoutError, ProtocolError, ConnectionClosed."""
    deadline = time.monotonic() + within_s
    while True:
        ftype, body = read_frame(s.sock, s.buf, deadline)
        if ftype not in wire.SERVER_FRAMES:
            raise ProtocolError(f"unexpected {ftype.name} frame from a transfer server")
        payload = s.session.open(ftype, body)
        if ftype != wire.FrameType.HAVE:
            return ftype, payload
        if time.monotonic() > deadline:
            raise TimeoutError(f"no answer within {within_s:g} s (only announcements)")


__all__ = ["Abort", "FetchResult", "HandshakeRefused", "Outcome", "Peer", "TransferClient"]
