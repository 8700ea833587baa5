"""HAVE announcements pushed over the transfer wire (bdn.proto.wire ``HAVE`` frames), so an asker
learns within one round trip that a peer holds a chunk instead of polling its have-bitfield.

Source: BitTorrent (BEP 3): a ``bitfield`` once per connection, then one ``have`` per piece as it
arrives. Here a *subscription* is one authenticated transfer connection that carries no chunk
requests: the client (the node downloading snapshot ``identity``) sends one HAVE frame naming
the identity (no indices); the server then sends what it holds of that snapshot (HAVE frames of
layer 0, stored, and 1, rebuilt: its bitfield as index lists, ``wire.MAX_HAVE_INDICES`` per
frame) and, from then on, a HAVE frame whenever chunks were verified and indexed there (batched:
whatever arrived while the previous frame was sent goes in the next), plus an empty HAVE every
``keepalive_s`` so either side sees a dead connection. Frames are tagged like every other frame
of the session (replayed, reordered or forged frames end the connection).

- ``HaveFeed`` (server side): ``TransferServer(on_have=feed.serve)`` hands it the connection;
  ``announce(identity, layer, index)`` (any thread) queues an index for the subscribers of
  ``identity``; ``held(identity)`` (a callback of the daemon) gives ``{layer: indices}`` held now.
  At most ``max_subscribers`` subscriptions at once (more are closed at once).
- ``HaveSubscriber`` (client side): ``subscribe(peer, identity)`` opens the connection on a
  thread of its own and calls ``on_have(peer, identity, layer, indices)`` for every frame and
  ``on_end(peer, identity, error)`` once it ends; ``unsubscribe`` closes it.

Untrusted: the server validates the identity it is asked for (``bdn.proto.identity``); the
client's callback checks indices against the manifest it holds (the peer may lie or be wrong;
an announcement only makes a peer a candidate, the chunk's bytes are still verified).
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from bdn.proto import handshake, wire
from bdn.proto.errors import AuthError, BdnError, ProtocolError
from bdn.proto.identity import validate_identity
from bdn.transfer.client import TransferClient
from bdn.transfer.sockio import ConnectionClosed, read_frame, set_timeouts
from bdn.transfer.streams import Peer

log = logging.getLogger("bdn.transfer.announce")

#: Seconds between keep-alive frames on an idle subscription (the client gives up after 3 x this).
KEEPALIVE_S = 5.0

Held = Callable[[str], "dict[int, Iterable[int]] | None"]


def frames(identity: str, layer: int, indices: Iterable[int]) -> list[bytes]:
    """HAVE payloads announcing ``indices`` of ``identity``'s ``layer``, at most
    ``wire.MAX_HAVE_INDICES`` each (none for no indices)."""
    idx = [int(i) for i in indices]
    step = wire.MAX_HAVE_INDICES
    return [wire.encode_have(wire.Have(identity, layer, tuple(idx[o : o + step]))) for o in range(0, len(idx), step)]


@dataclass(eq=False)
class _Sub:
    identity: str
    pending: dict[int, list[int]] = field(default_factory=lambda: {0: [], 1: [], wire.HAVE_GROWING: []})
    closed: bool = False


class HaveFeed:
    """The server side of HAVE subscriptions (see the module docstring). Thread-safe."""

    def __init__(self, held: Held, *, max_subscribers: int = 512, keepalive_s: float = KEEPALIVE_S) -> None:
        self._held = held
        self._max = max_subscribers
        self._keepalive = keepalive_s
        self._cond = threading.Condition()
        self._subs: dict[str, set[_Sub]] = {}
        self._count = 0
        self._closing = False
        self.frames_out = 0  # HAVE frames sent (a metric)

    @property
    def subscribers(self) -> int:
        """Subscriptions being served now."""
        with self._cond:
            return self._count

    def announce(self, identity: str, layer: int, index: int) -> None:
        """Event: chunk ``index`` of ``identity``'s ``layer`` (0 stored, 1 rebuilt) is verified
        and served here, or (layer ``wire.HAVE_GROWING``) started landing here from the bucket
        (never bytes still arriving from a peer):
        tell its subscribers (O(1) when nobody subscribed)."""
        with self._cond:
            subs = self._subs.get(identity)
            if not subs:
                return
            for s in subs:
                s.pending[layer].append(index)
            self._cond.notify_all()

    def close(self) -> None:
        """End every subscription (their threads return within a moment)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()

    def serve(self, sock: socket.socket, session: handshake.Session, payload: memoryview) -> None:
        """``TransferServer``'s ``on_have``: the client's HAVE frame ``payload`` opened a
        subscription; serve it on this connection thread until it ends.

        Raises:
            ProtocolError: a malformed subscription (the server closes the connection).
        """
        have = wire.decode_have(payload)
        try:
            validate_identity(have.identity)
        except BdnError as e:
            raise ProtocolError(f"have subscription: {e}") from None
        sub = _Sub(have.identity)
        with self._cond:
            if self._closing or self._count >= self._max:
                return  # the connection closes: the client falls back to polling
            self._subs.setdefault(sub.identity, set()).add(sub)
            self._count += 1
        try:
            # registered first, read second: a chunk verified in between is announced twice at worst
            held = self._held(sub.identity) or {}
            for layer, idx in held.items():
                for p in frames(sub.identity, layer, idx):
                    self._send(sock, session, p)
            self._send(sock, session, wire.encode_have(wire.Have(sub.identity, 0, ())))  # "that was all"
            self._push(sock, session, sub)
        finally:
            with self._cond:
                subs = self._subs.get(sub.identity)
                if subs is not None:
                    subs.discard(sub)
                    if not subs:
                        del self._subs[sub.identity]
                self._count -= 1

    def _push(self, sock: socket.socket, session: handshake.Session, sub: _Sub) -> None:
        while True:
            with self._cond:
                if not (any(sub.pending.values()) or self._closing):
                    self._cond.wait(self._keepalive)
                if self._closing:
                    return
                batch = {layer: idx for layer, idx in sub.pending.items() if idx}
                sub.pending = {0: [], 1: [], wire.HAVE_GROWING: []}
            if not batch:
                if not _alive(sock):
                    return
                self._send(sock, session, wire.encode_have(wire.Have(sub.identity, 0, ())))  # keep-alive
                continue
            for layer, idx in batch.items():
                for p in frames(sub.identity, layer, idx):
                    self._send(sock, session, p)

    def _send(self, sock: socket.socket, session: handshake.Session, payload: bytes) -> None:
        sock.sendall(session.seal(wire.FrameType.HAVE, payload))
        self.frames_out += 1


OnHave = Callable[[str, str, int, tuple[int, ...]], None]
OnEnd = Callable[[str, str, str], None]


class HaveSubscriber:
    """The client side of HAVE subscriptions: one connection (and thread) per (peer, identity).

    ``on_have(node_id, identity, layer, indices)`` and ``on_end(node_id, identity, error)`` run
    on the subscription's thread (hand them to the event loop with ``call_soon_threadsafe``).
    """

    def __init__(
        self, client: TransferClient, on_have: OnHave, on_end: OnEnd, *, keepalive_s: float = KEEPALIVE_S
    ) -> None:
        self.client = client
        self.on_have, self.on_end = on_have, on_end
        self._timeout = 3 * keepalive_s
        self._lock = threading.Lock()
        self._subs: dict[tuple[Peer, str], socket.socket | None] = {}
        self.frames_in = 0  # HAVE frames received (a metric)

    def subscribed(self, peer: Peer, identity: str) -> bool:
        with self._lock:
            return (peer, identity) in self._subs

    def count(self) -> int:
        with self._lock:
            return len(self._subs)

    def subscribe(self, peer: Peer, identity: str) -> bool:
        """Open a subscription to ``peer`` for ``identity`` (False: one is open already)."""
        key = (peer, identity)
        with self._lock:
            if key in self._subs:
                return False
            self._subs[key] = None
        threading.Thread(target=self._run, args=(peer, identity), name="bdn-have-sub", daemon=True).start()
        return True

    def unsubscribe(self, peer: Peer, identity: str) -> None:
        """Close the subscription (its ``on_end`` still runs, from its thread)."""
        with self._lock:
            sock = self._subs.pop((peer, identity), None)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        with self._lock:
            keys = list(self._subs)
        for p, ident in keys:
            self.unsubscribe(p, ident)

    def _run(self, peer: Peer, identity: str) -> None:
        key = (peer, identity)
        error = ""
        sock: socket.socket | None = None
        try:
            stream = self.client.connect(peer)  # a dedicated stream: it never carries chunk requests
            sock = stream.sock
            with self._lock:
                if key not in self._subs:
                    return  # unsubscribed while connecting
                self._subs[key] = sock
            set_timeouts(sock, self._timeout)
            sock.sendall(stream.session.seal(wire.FrameType.HAVE, wire.encode_have(wire.Have(identity, 0, ()))))
            while True:
                ftype, body = read_frame(sock, stream.buf)
                if ftype != wire.FrameType.HAVE:
                    raise ProtocolError(f"unexpected {ftype.name} frame on a have subscription")
                have = wire.decode_have(stream.session.open(ftype, body))
                if have.identity != identity:
                    raise ProtocolError("have frame for another snapshot than subscribed")
                self.frames_in += 1
                self.on_have(peer.node_id, identity, have.layer, have.indices)
        except (ConnectionClosed, TimeoutError, OSError, ProtocolError, AuthError, ValueError) as e:
            error = f"{type(e).__name__}: {e}"
        finally:
            with self._lock:
                if self._subs.get(key) is sock:
                    self._subs.pop(key, None)
            if sock is not None:
                sock.close()
            self.on_end(peer.node_id, identity, error)


def _alive(sock: socket.socket) -> bool:
    """Whether the client of an idle subscription is still there (it never sends after subscribing)."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


__all__ = ["HaveFeed", "HaveSubscriber", "KEEPALIVE_S", "frames"]
