"""Rate-limited log lines for events that can repeat per chunk (a million-chunk
snapshot from a lying peer or a failing bucket must not write a line per chunk).

:class:`RepeatLog` writes the first line of a *kind* (a key the caller picks, e.g. the message
template and the peer), then counts the lines of that kind for ``interval_s`` seconds; the
first line after the interval carries the summary ``(and N more like it in the last S s)``.
Time comes from an injected clock.
"""

from __future__ import annotations

import logging
from typing import Any

from bdn.daemon.process.clock import SYSTEM, Clock

MAX_KINDS = 1024


class RepeatLog:
    """``log(level, kind, msg, *args, **kwargs)``: as ``logger.log``, at most once per
    ``interval_s`` per ``kind`` (any hashable); the suppressed count goes in the next line."""

    def __init__(self, logger: logging.Logger, interval_s: float, clock: Clock = SYSTEM) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self.clock = clock
        self._kinds: dict[Any, tuple[float, int]] = {}  # kind -> (window start, suppressed)

    def log(self, level: int, kind: Any, msg: str, *args: Any, **kwargs: Any) -> bool:
        """Write or count one line; True if it was written."""
        if not self.logger.isEnabledFor(level):
            return False
        now = self.clock.monotonic()
        seen = self._kinds.get(kind)
        if seen is not None and now - seen[0] < self.interval_s:
            self._kinds[kind] = (seen[0], seen[1] + 1)
            return False
        if seen is None and len(self._kinds) >= MAX_KINDS:
            self._kinds.clear()  # bounded: forgetting the windows only costs a few extra lines
        self._kinds[kind] = (now, 0)
        if seen is not None and seen[1]:
            msg = f"{msg} (and %d more like it in the last %.0f s)"
            args = (*args, seen[1], now - seen[0])
        self.logger.log(level, msg, *args, **kwargs)
        return True
