"""The transformers engine's prompt cache: prompt token prefix -> (KV cache, policy version).

Each entry remembers the policy version that computed it, so an answer that reuses a prefix can
say which policy computed it (a stale, off-policy reuse after a ``PRESERVE`` hot-load is visible).
LRU-bounded (``MAX_CACHE_ENTRIES``); thread-safe.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from typing import Any

__all__ = ["MAX_CACHE_ENTRIES", "PromptCache"]

MAX_CACHE_ENTRIES = 64


class PromptCache:
    """Prompt token prefix -> (KV cache, policy version that computed it), LRU-bounded."""

    def __init__(self, entries: int = MAX_CACHE_ENTRIES) -> None:
        self._lock = threading.Lock()
        self._map: OrderedDict[tuple[int, ...], tuple[Any, int | None]] = OrderedDict()
        self._entries = entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._map)

    def clear(self) -> int:
        """Drop every cached prefix; returns how many were dropped."""
        with self._lock:
            n = len(self._map)
            self._map.clear()
            return n

    def put(self, key: tuple[int, ...], cache: Any, version: int | None) -> None:
        """Cache ``cache`` (the model's KV state) for the prompt tokens ``key`` under policy ``version``; the least recently used entry goes past the limit."""
        with self._lock:
            self._map[key] = (cache, version)
            self._map.move_to_end(key)
            while len(self._map) > self._entries:
                self._map.popitem(last=False)

    def lookup(self, prompt: list[int]) -> tuple[Any, int, int | None] | None:
        """The longest cached prefix of ``prompt`` that leaves at least one token to run:
        ``(a copy of its KV cache cropped to n tokens, n, its policy version)``."""
        best = None
        with self._lock:
            for key, (cache, version) in self._map.items():
                n = min(len(key), len(prompt) - 1)
                if n > 0 and tuple(prompt[: len(key)]) == key[: len(prompt)] and (best is None or n > best[1]):
                    best = (cache, n, version, key)
            if best is None:
                return None
            self._map.move_to_end(best[3])
        kv = copy.deepcopy(best[0])
        extra = kv.get_seq_length() - best[1]
        if extra > 0:
            kv.crop(-extra)  # a negative argument removes that many tokens (every transformers version)
        return kv, best[1], best[2]
