"""The membership updates a SWIM daemon still piggybacks on its messages (pure, no I/O).

Source: SWIM (Das, Gupta, Motivala, DSN 2002), section 4.1: each update is disseminated by
piggybacking it on protocol messages, about ``lambda * log(N)`` times, after which every member
has it with high probability. The shape follows HashiCorp memberlist's ``TransmitLimitedQueue``:
at most one pending update per member (a newer one replaces the older), the least transmitted
go first, and an update leaves the queue once sent ``retransmit_mult * ceil(log2(N + 2))`` times.
Used by bdn.control.swim; split out of it so the protocol's state machine and its dissemination
budget are read and tested apart.
"""

from __future__ import annotations

import heapq
import math
from typing import Any


class Broadcasts:
    """Pending updates, keyed by the member they are about. ``retransmit_mult`` is SWIM's lambda;
    ``max_per_message`` bounds the updates one message carries."""

    def __init__(self, retransmit_mult: int, max_per_message: int) -> None:
        if retransmit_mult < 1 or max_per_message < 1:
            raise ValueError("retransmit_mult and max_per_message must be >= 1")
        self.retransmit_mult = retransmit_mult
        self.max_per_message = max_per_message
        self._queue: dict[str, list[Any]] = {}  # node -> [update, transmits]

    def __len__(self) -> int:
        return len(self._queue)

    def limit(self, members: int) -> int:
        """Transmissions of one update in a table of ``members`` members."""
        return self.retransmit_mult * max(1, math.ceil(math.log2(members + 2)))

    def add(self, node: str, update: Any) -> None:
        """Queue ``update`` about ``node``, replacing a pending one about the same node."""
        self._queue[node] = [update, 0]

    def take(self, members: int) -> tuple[Any, ...]:
        """The updates for the next message (the least transmitted first, at most
        ``max_per_message``); each counts one transmission, and those at the limit for a table of
        ``members`` members leave the queue."""
        if not self._queue:
            return ()
        # = sorted(...)[:max_per_message] (heapq documents the equivalence), O(queue) not O(q log q)
        picked = heapq.nsmallest(self.max_per_message, self._queue.items(), key=lambda kv: kv[1][1])
        limit = self.limit(members)
        for node, e in picked:
            e[1] += 1
            if e[1] >= limit:
                del self._queue[node]
        return tuple(e[0] for _, e in picked)


__all__ = ["Broadcasts"]
