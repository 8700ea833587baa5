"""Rendezvous (highest random weight) hashing: who owns a chunk.

Source: Thaler & Ravishankar, "Using name-based mappings to increase hit rates" (1998). Each
(node, key) pair gets a pseudo-random 64-bit score; the node with the highest score owns the key.
When a node leaves, only the keys it owned move, each to its own next-best node, so load spreads
evenly instead of landing on one neighbour (as on a hash ring).
"""

from __future__ import annotations

from collections.abc import Iterable

import xxhash


def score(node_id: str, key: str) -> int:
    """64-bit HRW score of ``node_id`` for ``key`` (XXH3-64 of ``node_id NUL key``)."""
    return xxhash.xxh3_64_intdigest(f"{node_id}\x00{key}".encode())


def rank(node_ids: Iterable[str], key: str) -> list[str]:
    """Nodes ordered from owner to last fallback for ``key`` (ties broken by node id)."""
    return sorted(node_ids, key=lambda n: (score(n, key), n), reverse=True)


def owner(node_ids: Iterable[str], key: str) -> str | None:
    """The owner of ``key`` among ``node_ids`` (None when there are none)."""
    best: tuple[int, str] | None = None
    for n in node_ids:
        cand = (score(n, key), n)
        if best is None or cand > best:
            best = cand
    return best[1] if best else None
