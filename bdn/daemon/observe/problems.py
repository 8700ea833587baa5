"""Misconfigurations this daemon has noticed: one place that readiness
(``/v1/ready``, ``/v1/status``, systemd's ``STATUS=``), the log and the metrics read.

Kinds (:data:`KINDS`), each keyed by what it is about (a peer URL, the bucket URL):

- ``partition_secret``: a peer answered 401 to this daemon's signed request: the partition
  secrets differ (or the clocks are more than 30 s apart). Cleared when that peer answers.
- ``duplicate_node_id``: a peer at another URL answers with this daemon's node id: the two
  ignore each other and HRW gives both the same chunks. Cleared when that peer answers as
  another node.
- ``bucket_empty``: the bucket URL holds no object at all (a mistyped or empty prefix).
  Cleared by the next probe that finds one.

A problem not reported again for ``ttl_s`` seconds ends on its own (the peer went away).
Raising logs one warning (once per appearance), ending logs one info line. Time comes from an
injected clock; no I/O but the log.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from bdn.daemon.process.clock import Clock

log = logging.getLogger("bdn.problems")

KINDS: tuple[str, ...] = ("partition_secret", "duplicate_node_id", "bucket_empty")
TTL_S = 60.0


@dataclass
class Problem:
    """One misconfiguration: its kind, what it is about, the one-line message, when last seen."""

    kind: str
    key: str
    message: str
    seen_at: float


class Problems:
    """The misconfigurations noticed and not yet over, by ``(kind, key)``."""

    def __init__(self, clock: Clock, ttl_s: float = TTL_S) -> None:
        self.clock = clock
        self.ttl_s = ttl_s
        self._active: dict[tuple[str, str], Problem] = {}

    def report(self, kind: str, key: str, message: str) -> None:
        """``kind`` about ``key`` is true now (``message``: one line saying what to fix); logged
        as a warning when it was not active. Raises ValueError for an unknown kind."""
        if kind not in KINDS:
            raise ValueError(f"unknown problem kind {kind!r}")
        self._expire()
        p = self._active.get((kind, key))
        if p is None:
            log.warning("misconfigured: %s", message)
        self._active[(kind, key)] = Problem(kind, key, message, self.clock.monotonic())

    def clear(self, kind: str, key: str) -> None:
        """``kind`` about ``key`` is over (logged when it was active)."""
        p = self._active.pop((kind, key), None)
        if p is not None:
            log.info("no longer misconfigured: %s", p.message)

    def active(self, kind: str | None = None) -> list[Problem]:
        """The problems still true (of ``kind``, or all), oldest key first."""
        self._expire()
        return [p for (k, _), p in sorted(self._active.items()) if kind is None or k == kind]

    def counts(self) -> dict[str, int]:
        """``{kind: active problems}`` for every kind (0 included): the metric."""
        out = dict.fromkeys(KINDS, 0)
        for p in self.active():
            out[p.kind] += 1
        return out

    def _expire(self) -> None:
        now = self.clock.monotonic()
        for key, p in list(self._active.items()):
            if now - p.seen_at > self.ttl_s:
                del self._active[key]
                log.info("no longer reported (%g s): %s", self.ttl_s, p.message)
