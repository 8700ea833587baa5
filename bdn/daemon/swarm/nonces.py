"""The replay check of peer requests (the mutable half of ``bdn.proto.keys``' signatures).

``bdn.proto.keys.verify_request`` takes any object with ``add(nonce, now, node, ts) -> bool``;
this is the daemon's: a sliding window per signer over its numbered nonces
(``bdn.control.replay.ReplayGuard``, as IPsec's anti-replay window), so its memory grows with
the number of signers (authenticated members), not with the request rate: it never fills up
under load as a table of every nonce of the last 60 s did (full at ~17,000 requests/s, then
every request refused). A captured request is refused by this daemon (its counter was seen, or
is behind the window) and by every other one (the signature names its target, ``to``).
"""

from __future__ import annotations

import threading
import time

from bdn.control.replay import ReplayError, ReplayGuard


class ReplayWindows:
    """Thread-safe :class:`~bdn.control.replay.ReplayGuard` for ``verify_request``.

    ``window``: counters accepted out of order behind the highest one (bits per signer and
    boot); ``max_signers``: signers kept (then the least recently heard one is evicted and
    unknown signers with older timestamps are refused). ``refused`` counts refusals (a metric).
    """

    def __init__(self, window: int = 4096, max_signers: int = 100_000) -> None:
        self._guard = ReplayGuard(time.time, window=window, max_signers=max_signers)
        self._lock = threading.Lock()
        self.refused = 0

    def add(self, nonce: str, now: float, node: str = "", ts: float | None = None) -> bool:
        """Accept ``nonce`` of ``node`` signed at ``ts`` (unix s; ``now`` when not given) once.
        False: a replay, a counter behind the window, a boot older than the kept ones, or a
        nonce that is not ``boot || counter``."""
        with self._lock:
            try:
                self._guard.check(node, nonce, now if ts is None else ts)
            except ReplayError:
                self.refused += 1
                return False
            return True

    def state_bytes(self) -> int:
        """An upper bound of the bytes the windows hold."""
        with self._lock:
            return self._guard.state_bytes()

    def __len__(self) -> int:
        return len(self._guard)


NonceCache = ReplayWindows  # the former name (tests, tools)
