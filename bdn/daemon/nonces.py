"""The replay cache of peer-request nonces (the mutable half of ``bdn.proto.keys``' signatures).

``bdn.proto.keys.verify_request`` takes any object with ``add(nonce, now) -> bool``; this is the
daemon's: nonces seen within the skew window (2 x ``MAX_SKEW_S`` = 60 s), bounded in size.
"""

from __future__ import annotations

import threading

from bdn.proto.keys import MAX_SKEW_S


class NonceCache:
    """Nonces seen within the skew window (2 x 30 s), so a captured request cannot be replayed.

    Bounded: at most ``max_entries``; when full, new requests are refused (401) rather than
    forgetting nonces that could then be replayed.
    """

    def __init__(self, max_entries: int = 1_000_000) -> None:
        self._seen: dict[str, float] = {}
        self._lock = threading.Lock()
        self._max = max_entries
        self._next_prune = 0.0

    def add(self, nonce: str, now: float) -> bool:
        """Record ``nonce`` seen at ``now`` (s); False if it was already seen (a replay) or the cache is full."""
        with self._lock:
            if now >= self._next_prune or len(self._seen) >= self._max:
                cutoff = now - 2 * MAX_SKEW_S
                self._seen = {n: t for n, t in self._seen.items() if t > cutoff}
                self._next_prune = now + 5
            if nonce in self._seen or len(self._seen) >= self._max:
                return False
            self._seen[nonce] = now
            return True
