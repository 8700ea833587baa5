"""bdn.transfer.receive.Rings: the 1 MiB buffers a whole answer for a file is received through are
lent per call and shared by every thread, so that at most as many are mapped as calls ran at once
and none once released (issue 31: one per thread, they stayed mapped for the life of the fetch
pools' threads and the daemon's anonymous memory rose by 1 MiB with each one more thread)."""

from __future__ import annotations

import ctypes
import os
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from bdn.transfer.receive import Rings, receive_to_file
from support.api import wait_for

SIZE = 3 * (1 << 20) + 12345  # more than one buffer's worth: the buffer is reused within a call


@dataclass
class _Stream:  # what receive_to_file needs of bdn.transfer.streams.Stream
    sock: socket.socket
    hasher: xxhash.xxh3_128 = field(default_factory=xxhash.xxh3_128)


class _Receive:
    """One receive into a new file on its own thread, from a socket pair whose sender waits for ``go``."""

    def __init__(self, rings: Rings, path: Path, go: threading.Event) -> None:
        self.body, self.path, self.digest = os.urandom(SIZE), path, ""
        a, self._b = socket.socketpair()
        self._s = _Stream(a)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self._go = go
        self.threads = [threading.Thread(target=self._recv, args=(rings,)), threading.Thread(target=self._send)]
        for t in self.threads:
            t.start()

    def _recv(self, rings: Rings) -> None:
        try:
            receive_to_file(self._s, self._fd, 0, SIZE, float("inf"), rings)
            self.digest = self._s.hasher.hexdigest()
        finally:
            os.close(self._fd)
            self._s.sock.close()

    def _send(self) -> None:
        self._go.wait(60)
        self._b.sendall(self.body)
        self._b.close()

    def check(self) -> None:
        for t in self.threads:
            t.join(60)
            assert not t.is_alive()
        assert self.path.read_bytes() == self.body
        assert self.digest == xxhash.xxh3_128(self.body).hexdigest()


def _run(rings: Rings, tmp: Path, k: int, go: threading.Event) -> list[_Receive]:
    n = len(list(tmp.iterdir()))
    return [_Receive(rings, tmp / f"t{n + i}", go) for i in range(k)]


def _starts(rings: Rings) -> set[int]:
    """The free buffers' addresses (a ctypes view of each, dropped at once: no export left)."""
    out = set()
    for r in rings._free:
        c = ctypes.c_char.from_buffer(r)
        out.add(ctypes.addressof(c))
        del c
    return out


def _mapped_at(starts: set[int]) -> set[int]:
    """Which of ``starts`` lie in a mapping of this process (/proc/self/maps; the kernel merges
    adjacent anonymous mappings, so a buffer need not begin one)."""
    with open("/proc/self/maps") as f:
        spans = [tuple(int(x, 16) for x in line.split(None, 1)[0].split("-")) for line in f]
    return {a for a in starts if any(lo <= a < hi for lo, hi in spans)}


def test_buffers_are_lent_per_call_shared_bounded_and_released(tmp_path: Path) -> None:
    rings = Rings()
    go = threading.Event()
    now = _run(rings, tmp_path, 4, go)
    wait_for(rings.mapped, 30, "four buffers lent at once", until=lambda n: n == 4)
    go.set()
    for r in now:
        r.check()
    assert rings.mapped() == 4  # kept, free, between calls
    # eight more calls on eight new threads, one after the other: no new buffer (with a buffer per
    # thread, each thread that ever received mapped one more, held for the thread's life)
    for _ in range(8):
        for r in _run(rings, tmp_path, 1, go):
            r.check()
    assert rings.mapped() == 4
    starts = _starts(rings)
    assert len(starts) == 4 and _mapped_at(starts) == starts
    assert rings.release() == 4
    assert rings.mapped() == 0
    assert not _mapped_at(starts)  # unmapped, not only forgotten


def test_a_buffer_lent_while_released_stays_with_its_call(tmp_path: Path) -> None:
    rings = Rings()
    go = threading.Event()
    (r,) = _run(rings, tmp_path, 1, go)
    wait_for(rings.mapped, 30, "one buffer lent", until=lambda n: n == 1)
    assert rings.release() == 0 and rings.mapped() == 1
    go.set()
    r.check()
    assert rings.mapped() == 1 and rings.release() == 1 and rings.mapped() == 0
