"""Replay protection for signed peer requests that does not overflow under load.

Today's verifier remembers every nonce for 60 s in a table of 1 M: above ~17,000 signed
requests per second it is full and refuses everything. Here each signer numbers its requests
instead, and each verifier keeps, per signer, a sliding window over those numbers, as IPsec's
anti-replay window (RFC 4303 §3.4.3, RFC 6479): O(window) bits per signer, whatever the rate.

The nonce keeps the header's shape (32 hex characters): ``boot`` (16 hex: the signer's start
time in microseconds since the epoch, so a restart numbers from a larger boot) then ``counter``
(16 hex, from 1, incremented per request). The signature covers it, so it cannot be altered.
A verifier accepts a (node, boot, counter) once:

- a counter above the highest seen for that boot slides the window forward;
- one within ``window`` below the highest is accepted once (requests signed in order can arrive
  out of order over parallel connections);
- one further below is refused (the client re-signs and retries);
- a boot newer than the signer's newest starts a new window; up to ``boots_kept`` older boots
  keep theirs (the requests of a daemon that just restarted may still be in flight); a boot
  older than all kept ones is refused.

Memory: at most ``max_signers`` signers (authenticated swarm members only: the signature is
checked first), each ``boots_kept`` windows of ``window`` bits. A signer forgotten to make room
could have requests replayed, so after evicting one the verifier refuses every request from a
signer it does not know whose timestamp is not later than the eviction (signed before it).

Pure: ``clock`` gives seconds (wall clock, as the signature's ``ts``).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass

from bdn.control import Clock

NONCE_RE = re.compile(r"[0-9a-f]{32}\Z")


class ReplayError(ValueError):
    """A request refused as a possible replay (the reason is for logs, not for the peer)."""


class RequestCounter:
    """The signer's side: nonces ``boot || counter`` (32 hex), strictly increasing."""

    def __init__(self, clock: Clock) -> None:
        self.boot = int(clock() * 1_000_000) & (2**64 - 1)
        self.counter = 0

    def next(self) -> str:
        """The next nonce: 32 lowercase hex, the boot time then a counter, strictly increasing."""
        self.counter += 1
        return f"{self.boot:016x}{self.counter:016x}"


class Counters:
    """A signer's nonces numbered per ``(target node id, stream)``: each verifier then sees one
    dense sequence per stream (its replay window is not used up by requests to other daemons),
    and a stream of slow requests (control messages queued behind chunk requests) does not fall
    behind the window of a fast one. ``stream`` is a small integer (0 control, 1 chunks); it
    becomes part of the boot, so the streams are separate windows at the verifier. Bounded by
    the number of targets (the member list)."""

    STREAMS = 4

    def __init__(self, clock: Clock) -> None:
        self.boot = (int(clock() * 1_000_000) * self.STREAMS) & (2**64 - 1)
        self._next: dict[tuple[str, int], int] = {}

    def next(self, target: str, stream: int = 0) -> str:
        """The next nonce for requests to ``target`` on ``stream`` (0 control, 1 chunks); ValueError for another stream."""
        if not 0 <= stream < self.STREAMS:
            raise ValueError(f"stream must be in [0, {self.STREAMS})")
        key = (target, stream)
        c = self._next.get(key, 0) + 1
        self._next[key] = c
        return f"{self.boot + stream:016x}{c:016x}"


def parse_nonce(nonce: str) -> tuple[int, int]:
    """``(boot, counter)`` from a nonce. Raises ReplayError if it is not 32 lowercase hex."""
    if not isinstance(nonce, str) or not NONCE_RE.match(nonce):
        raise ReplayError("nonce is not 32 lowercase hex characters")
    boot, ctr = int(nonce[:16], 16), int(nonce[16:], 16)
    if ctr == 0:
        raise ReplayError("counter 0 is never signed")
    return boot, ctr


@dataclass
class _Window:
    top: int = 0  # highest counter accepted
    bits: int = 0  # bit i set: counter top - i seen (bit 0 = top)


class ReplayGuard:
    """The verifier's side. Call :meth:`check` after the signature and the clock skew passed."""

    def __init__(self, clock: Clock, *, window: int = 4096, boots_kept: int = 2 * Counters.STREAMS,
                 max_signers: int = 100_000) -> None:
        if window < 64 or boots_kept < 1 or max_signers < 1:
            raise ValueError("window >= 64, boots_kept >= 1, max_signers >= 1")
        self.clock = clock
        self.window = window
        self.boots_kept = boots_kept
        self.max_signers = max_signers
        self._signers: OrderedDict[str, dict[int, _Window]] = OrderedDict()
        self._evicted_at: float | None = None

    def __len__(self) -> int:
        return len(self._signers)

    def state_bytes(self) -> int:
        """An upper bound on the bytes held: the windows plus per-signer bookkeeping."""
        per_boot = self.window // 8 + 32
        return sum(64 + len(n) + per_boot * len(b) for n, b in self._signers.items())

    def check(self, node: str, nonce: str, ts: float) -> None:
        """Accept ``nonce`` from ``node`` (signed at ``ts``, seconds) once.

        Raises:
            ReplayError: a replay, a counter too far behind, a boot too old, or a malformed nonce.
        """
        boot, ctr = parse_nonce(nonce)
        boots = self._signers.get(node)
        if boots is None:
            if self._evicted_at is not None and ts <= self._evicted_at:
                raise ReplayError("unknown signer with a timestamp before the last eviction")
            while len(self._signers) >= self.max_signers:
                self._signers.popitem(last=False)
                self._evicted_at = self.clock()
            boots = self._signers[node] = {}
        else:
            self._signers.move_to_end(node)
        w = boots.get(boot)
        if w is None:
            if boots and boot < min(boots) and len(boots) >= self.boots_kept:
                raise ReplayError("boot older than every one kept for this signer")
            w = boots[boot] = _Window()
            while len(boots) > self.boots_kept:
                del boots[min(boots)]
        if ctr > w.top:
            shift = ctr - w.top
            w.bits = ((w.bits << shift) | 1) & ((1 << self.window) - 1) if shift < self.window else 1
            w.top = ctr
            return
        back = w.top - ctr
        if back >= self.window:
            raise ReplayError("counter behind the replay window")
        if w.bits >> back & 1:
            raise ReplayError("replayed counter")
        w.bits |= 1 << back
