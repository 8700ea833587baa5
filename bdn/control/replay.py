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
  older than all kept ones is refused;
- a boot more than ``max_boot_ahead_s`` (30 s, the signature's clock-skew bound) ahead of the
  verifier's clock is refused before any state is kept: a signer cannot have started in the
  future, and without this bound one secret holder could sign nonces whose boot is near 2^64
  for a node id and so lock that node's genuine (smaller) boots out of every verifier. The bound
  is checked against the larger scale, ``Counters``' (µs x ``STREAMS`` + stream);
  ``RequestCounter``'s plain µs boots are smaller for the same time;
- a window whose newest request is signed (``ts``) more than ``max_skew_s`` ago is dropped to
  make room for a new boot, also an older one: every request it accepted is refused by the
  signature's skew check from then on, so nothing of it can be replayed. A window dropped while
  still live (a newer boot needed the room) makes every boot up to its own refused until its
  newest ``ts`` is ``max_skew_s`` old. So a secret holder who fills a signer's ``boots_kept``
  windows with boots from the next 30 s locks that signer out only while it keeps them all
  busy: ``max_skew_s`` after it stops, the genuine boot is taken back.

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

from bdn.control import Now

NONCE_RE = re.compile(r"[0-9a-f]{32}\Z")


class ReplayError(ValueError):
    """A request refused as a possible replay (the reason is for logs, not for the peer)."""


class RequestCounter:
    """The signer's side: nonces ``boot || counter`` (32 hex), strictly increasing."""

    def __init__(self, clock: Now) -> None:
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

    def __init__(self, clock: Now) -> None:
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
    ts: float = float("-inf")  # the newest signature time (s) accepted in this window


class ReplayGuard:
    """The verifier's side. Call :meth:`check` after the signature and the clock skew passed."""

    def __init__(
        self,
        clock: Now,
        *,
        window: int = 4096,
        boots_kept: int = 2 * Counters.STREAMS,
        max_signers: int = 100_000,
        max_skew_s: float = 30.0,
    ) -> None:
        if window < 64 or boots_kept < 1 or max_signers < 1 or max_skew_s < 0:
            raise ValueError("window >= 64, boots_kept >= 1, max_signers >= 1, max_skew_s >= 0")
        self.clock = clock
        self.max_skew_s = max_skew_s  # the signature's clock-skew bound (bdn.proto.keys.MAX_SKEW_S)
        self._floors: dict[str, tuple[int, float]] = {}  # node -> (boots up to this refused, until then)
        self.window = window
        self.boots_kept = boots_kept
        self.max_signers = max_signers
        self._signers: OrderedDict[str, dict[int, _Window]] = OrderedDict()
        self._evicted_at: float | None = None

    def latest_boot(self) -> int:
        """The largest boot accepted now: ``Counters``' boot of a signer started
        ``max_skew_s`` from now, on its last stream."""
        return int((self.clock() + self.max_skew_s) * 1_000_000) * Counters.STREAMS + Counters.STREAMS - 1

    def __len__(self) -> int:
        return len(self._signers)

    def state_bytes(self) -> int:
        """An upper bound on the bytes held: the windows plus per-signer bookkeeping."""
        per_boot = self.window // 8 + 32
        return sum(64 + len(n) + per_boot * len(b) for n, b in self._signers.items())

    def check(self, node: str, nonce: str, ts: float) -> None:
        """Accept ``nonce`` from ``node`` (signed at ``ts``, seconds) once.

        Raises:
            ReplayError: a replay, a counter too far behind, a boot too old or more than
                ``max_skew_s`` ahead of the clock, or a malformed nonce.
        """
        boot, ctr = parse_nonce(nonce)
        if boot > self.latest_boot():
            raise ReplayError(f"boot more than {self.max_skew_s:g} s ahead of this verifier's clock")
        boots = self._signers.get(node)
        if boots is None:
            if self._evicted_at is not None and ts <= self._evicted_at:
                raise ReplayError("unknown signer with a timestamp before the last eviction")
            while len(self._signers) >= self.max_signers:
                gone, _ = self._signers.popitem(last=False)
                self._floors.pop(gone, None)
                self._evicted_at = self.clock()
            boots = self._signers[node] = {}
        else:
            self._signers.move_to_end(node)
        w = boots.get(boot)
        if w is None:
            w = self._new_window(node, boots, boot)
        if ctr > w.top:
            shift = ctr - w.top
            w.bits = ((w.bits << shift) | 1) & ((1 << self.window) - 1) if shift < self.window else 1
            w.top = ctr
        else:
            back = w.top - ctr
            if back >= self.window:
                raise ReplayError("counter behind the replay window")
            if w.bits >> back & 1:
                raise ReplayError("replayed counter")
            w.bits |= 1 << back
        w.ts = max(w.ts, ts)

    def _new_window(self, node: str, boots: dict[int, _Window], boot: int) -> _Window:
        """A window for a boot ``node`` has none of (see the module docstring); ReplayError if refused."""
        now = self.clock()
        floor = self._floors.get(node)
        if floor is not None and now > floor[1]:
            del self._floors[node]
            floor = None
        if floor is not None and boot <= floor[0]:
            raise ReplayError(
                "boot older than every one kept for this signer (a window up to it was dropped"
                f" less than {self.max_skew_s:g} s ago)"
            )
        if len(boots) >= self.boots_kept:  # room first from windows nothing can be replayed into
            for b in [b for b, old in boots.items() if old.ts < now - self.max_skew_s]:
                del boots[b]
        if boots and boot < min(boots) and len(boots) >= self.boots_kept:
            raise ReplayError("boot older than every one kept for this signer")
        w = boots[boot] = _Window()
        while len(boots) > self.boots_kept:
            b = min(boots)
            old = boots.pop(b)
            if old.ts >= now - self.max_skew_s:  # still live: nothing up to it may come back yet
                fb, fu = self._floors.get(node, (-1, now))
                self._floors[node] = (max(fb, b), max(fu, old.ts + self.max_skew_s))
        return w
