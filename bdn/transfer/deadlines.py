"""Send deadlines for the transfer server: one thread that shuts a connection down once the
answer it is sending outlives its deadline.

A blocking ``os.sendfile`` cannot be bounded by the socket's send timeout alone: the kernel
starts that timeout afresh for every page it waits on, so a receiver that reads a little now and
then (never silent for a whole timeout) held the sending thread, and the upload slot it holds,
for the whole body at its pace. Checking a deadline between calls does not help either (one call
sends the whole body), and a non-blocking ``sendfile`` with ``poll`` costs every fast answer a
system call per buffer-full. Instead the sender registers ``(deadline, socket)`` here for the
length of the send; past the deadline this thread calls ``shutdown(SHUT_RDWR)`` on the socket,
which wakes the blocked ``sendfile`` with ``EPIPE`` (the connection then closes, the asker sees
it end and reports FAILED). A send that ends in time costs a heap push and a flag.

Thread-safe; no I/O but ``shutdown``.
"""

from __future__ import annotations

import heapq
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["Deadlines", "Watch"]


class Watch:
    """One registered send: ``fired`` is True once its deadline passed and the socket was shut down."""

    __slots__ = ("done", "fired", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock: socket.socket | None = sock
        self.done = False
        self.fired = False


class Deadlines:
    """Shuts down each registered socket whose send outlives its deadline (``time.monotonic()``
    by default; ``clock`` injectable). The thread starts with the first registration and ends
    with :meth:`close`. Entries of sends that ended leave the heap once no earlier one is left
    (sends of one kind end about in deadline order, so the heap holds about the sends in flight).
    ``fired`` counts the sends it cut off."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._cv = threading.Condition()
        self._heap: list[tuple[float, int, Watch]] = []
        self._seq = 0
        self._thread: threading.Thread | None = None
        self._closed = False
        self.fired = 0

    @contextmanager
    def bound(self, sock: socket.socket, deadline: float) -> Iterator[Watch]:
        """While the block runs, ``sock`` is shut down (both directions) if ``deadline`` passes;
        yields the :class:`Watch` (its ``fired`` tells the caller why its send failed)."""
        w = Watch(sock)
        with self._cv:
            if self._closed:
                raise RuntimeError("send deadlines closed")
            self._seq += 1
            heapq.heappush(self._heap, (deadline, self._seq, w))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="bdn-transfer-deadlines", daemon=True)
                self._thread.start()
            if self._heap[0][2] is w:
                self._cv.notify()
        try:
            yield w
        finally:
            with self._cv:
                w.done = True
                w.sock = None
                while self._heap and self._heap[0][2].done:  # sends end about in deadline order
                    heapq.heappop(self._heap)

    def close(self) -> None:
        """Stop the thread (registered sends are no longer bounded)."""
        with self._cv:
            self._closed = True
            self._heap.clear()
            self._cv.notify()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(5)

    def __len__(self) -> int:
        with self._cv:
            return len(self._heap)

    def _run(self) -> None:
        with self._cv:
            while not self._closed:
                if not self._heap:
                    self._cv.wait()
                    continue
                when, _, w = self._heap[0]
                if w.done:
                    heapq.heappop(self._heap)
                    continue
                left = when - self._clock()
                if left > 0:
                    self._cv.wait(left)
                    continue
                heapq.heappop(self._heap)
                w.fired = True
                self.fired += 1
                sock, w.sock = w.sock, None
                if sock is not None:
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass  # closed meanwhile
