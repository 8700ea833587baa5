"""Answering one chunk request (``ASK``, bdn.proto.wire) on an authenticated transfer
connection: the upload policy's verdict, then the chunk's bytes by ``os.sendfile`` from its file
(``DATA``), its landed bytes while it still grows here (``PART`` frames, bdn.transfer.growing),
``BUSY`` or ``NOT_HERE``. The connections, the handshake and the other frames are
bdn.transfer.server's; this module is what one answer is.

The daemon's two callbacks (thread-safe, called on connection threads):

- ``resolve(address) -> (fd | path, offset, length) | Growing | None`` (``Resolve``): where the
  verified chunk at swarm ``address`` lies (an open file descriptor the caller keeps open, or a
  path whose descriptor is opened once and cached), the chunk while it still lands here
  (``Growing``: answered by cut-through to an ASK that accepts it, NOT_HERE to one that does not),
  or None when it is not held here;
- ``admit(peer_node_id, ask) -> Granted | Busy | NOT_HERE`` (``Admit``): the upload policy. It may
  block up to ``ask.wait_ms`` (an owner holding a request while it fetches the chunk);
  ``Granted.release(sent)`` is called once the answer is sent or failed.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Union

from bdn.proto import handshake, wire
from bdn.transfer.deadlines import Deadlines
from bdn.transfer.files import FileCache
from bdn.transfer.growing import MAX_ANSWER_S, CutOff, Growing, send_growing
from bdn.transfer.receive import body_limit
from bdn.transfer.sockio import sendfile_all
from bdn.transfer.stats import ServerStats

log = logging.getLogger("bdn.transfer.answer")

Source = Union[int, str, "os.PathLike[str]"]
#: Where a chunk's bytes lie: (open fd or path, byte offset in the file, chunk length in bytes).
Location = tuple[Source, int, int]


@dataclass(frozen=True, slots=True)
class Granted:
    """The upload policy lets this request through; ``release(sent)`` (if any) runs after the
    answer: ``sent`` True when the chunk's bytes went out whole, False when the answer was
    NOT_HERE or BUSY after all, or was cut short."""

    release: Callable[[bool], None] | None = None


@dataclass(frozen=True, slots=True)
class Busy:
    """Answer BUSY: ask again after ``retry_after_s`` seconds."""

    retry_after_s: float


class _NotHere:
    __slots__ = ()

    def __repr__(self) -> str:
        return "NOT_HERE"


NOT_HERE = _NotHere()
GRANTED = Granted()
#: Seconds a BUSY asks an asker to wait when the growing copy it asked for failed before the
#: answer began (the chunk is read again soon; its HAVE wakes the asker earlier).
CUT_OFF_RETRY_S = 0.2
Verdict = Granted | Busy | _NotHere
Resolve = Callable[[str], "Location | Growing | None"]
Admit = Callable[[str, wire.Ask], Verdict]


def admit_all(peer: str, ask: wire.Ask) -> Verdict:
    """The admission that lets every request through (benchmarks, or a daemon without limits)."""
    return GRANTED


def _send(sock: socket.socket, session: handshake.Session, ftype: wire.FrameType, payload: bytes) -> None:
    sock.sendall(session.seal(ftype, payload))


class Answers:
    """Answers ASKs with ``resolve`` and ``admit`` (see the module docstring), sending from the
    descriptors of ``files``; counts in ``stats`` under ``lock`` (the server's). A DATA body goes
    out by the deadline its asker gives it (``receive.body_limit`` on ``send_timeout_s``), a
    cut-through answer within ``MAX_ANSWER_S`` + ``send_timeout_s``: past it ``deadlines``
    (:mod:`bdn.transfer.deadlines`) shuts the connection down."""

    def __init__(
        self,
        resolve: Resolve,
        admit: Admit,
        files: FileCache,
        stats: ServerStats,
        lock: threading.Lock,
        send_timeout_s: float = 60.0,
        deadlines: Deadlines | None = None,
    ) -> None:
        self._send_timeout = send_timeout_s
        self._deadlines = deadlines if deadlines is not None else Deadlines()  # (an empty one is falsy: __len__)
        self._resolve = resolve
        self._admit = admit
        self._files = files
        self.stats = stats
        self._lock = lock

    def answer(self, sock: socket.socket, session: handshake.Session, ask: wire.Ask) -> None:
        """Answer one ``ask`` from the peer of ``session`` on ``sock`` (a connection thread):
        admission, then DATA by ``sendfile``, PARTs while the chunk grows, BUSY or NOT_HERE.
        Raises OSError, TimeoutError or CutOff when an answer is cut short (the caller closes
        the connection: the asker sees it end and reports FAILED)."""
        verdict = self._admit(session.peer_node_id, ask)
        if isinstance(verdict, Busy):
            with self._lock:
                self.stats.busy += 1
            _send(sock, session, wire.FrameType.BUSY, wire.encode_busy(verdict.retry_after_s))
            return
        if not isinstance(verdict, Granted):
            self._not_here(sock, session)
            return
        sent = False
        try:
            sent = self._send_chunk(sock, session, ask)
        finally:
            if verdict.release is not None:
                verdict.release(sent)

    def _not_here(self, sock: socket.socket, session: handshake.Session) -> None:
        with self._lock:
            self.stats.not_here += 1
        _send(sock, session, wire.FrameType.NOT_HERE, b"")

    def _send_growing(self, sock: socket.socket, session: handshake.Session, ask: wire.Ask, g: Growing) -> bool:
        """A cut-through answer (bdn.transfer.growing) for a chunk still landing here; True when
        it went out whole."""
        if not ask.cut_through or ask.offset + ask.length > g.length:
            self._not_here(sock, session)
            return False
        got = self._files.acquire(g.path)
        if got is None:
            self._not_here(sock, session)
            return False
        fd, ent = got
        try:
            # bounded between pieces by MAX_ANSWER_S (send_growing), inside a piece by this
            with self._deadlines.bound(sock, time.monotonic() + MAX_ANSWER_S + self._send_timeout) as w:
                try:
                    send_growing(sock, session.seal, fd, g, ask.offset, ask.length)
                except OSError:
                    if w.fired:
                        raise TimeoutError(f"cut-through answer still incomplete after {MAX_ANSWER_S:g} s") from None
                    raise
        except CutOff as e:
            if e.started:
                with self._lock:
                    self.stats.aborted += 1
                raise  # the answer is cut short: the connection closes, the client reports FAILED
            # the copy failed before the answer began: a busy answer (ask again), not a closed
            # stream, which the asker would count against this node
            with self._lock:
                self.stats.busy += 1
            _send(sock, session, wire.FrameType.BUSY, wire.encode_busy(CUT_OFF_RETRY_S))
            return False
        except (OSError, TimeoutError):
            with self._lock:
                self.stats.aborted += 1
            raise  # the answer is cut short: the connection closes, the client reports FAILED
        finally:
            self._files.release(ent)
        with self._lock:
            self.stats.chunks_out += 1
            self.stats.bytes_out += ask.length
            self.stats.cut_through += 1
        return True

    def _send_chunk(self, sock: socket.socket, session: handshake.Session, ask: wire.Ask) -> bool:
        """Answer a granted ASK; True when the chunk's bytes went out whole."""
        loc = self._resolve(ask.address)
        if isinstance(loc, Growing):
            return self._send_growing(sock, session, ask, loc)
        if loc is None:
            self._not_here(sock, session)
            return False
        src, base, chunk_len = loc
        if ask.offset + ask.length > chunk_len:
            self._not_here(sock, session)  # asks for bytes outside the chunk: we hold no such range
            return False
        ent = None
        if isinstance(src, int):
            fd = src
        else:
            got = self._files.acquire(os.fspath(src))
            if got is None:
                self._not_here(sock, session)
                return False
            fd, ent = got
        try:
            start = base + ask.offset
            if os.fstat(fd).st_size < start + ask.length:
                log.error("chunk %s: its file is shorter than its location says; answered not here", ask.address)
                self._not_here(sock, session)
                return False
            # MSG_MORE: the small header leaves in the same segment as the body's first bytes
            sock.sendall(session.seal(wire.FrameType.DATA, wire.encode_data(ask.length)), socket.MSG_MORE)
            try:
                # the body by the deadline its receiver gives it (receive.body_limit, on the
                # send timeout): a peer reading a little now and then held the upload slot for ever
                # (bdn.transfer.deadlines: a blocking sendfile restarts the send timeout per page)
                deadline = time.monotonic() + body_limit(ask.length, self._send_timeout)
                with self._deadlines.bound(sock, deadline) as w:
                    try:
                        sendfile_all(sock.fileno(), fd, start, ask.length)
                    except OSError:
                        if w.fired:
                            raise TimeoutError(
                                f"transfer send still incomplete at its deadline ({ask.length} bytes)"
                            ) from None
                        raise
            except BaseException:
                with self._lock:
                    self.stats.aborted += 1
                raise  # the body is cut short: the connection must close, the client sees it
            with self._lock:
                self.stats.chunks_out += 1
                self.stats.bytes_out += ask.length
            return True
        finally:
            if ent is not None:
                self._files.release(ent)
