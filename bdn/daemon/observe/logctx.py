"""Which snapshot and which peer a log line is about, without threading them through every call.

Context variables follow asyncio tasks: the task that builds a snapshot sets ``SNAPSHOT`` once,
and every line logged by it (and by the tasks it starts) carries the identity; a peer request
sets ``PEER`` the same way. ``ContextFilter`` copies both onto each log record, where the JSON
formatter emits them as fields.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

SNAPSHOT: ContextVar[str | None] = ContextVar("bdn_snapshot", default=None)
PEER: ContextVar[str | None] = ContextVar("bdn_peer", default=None)


@contextmanager
def snapshot(identity: str) -> Iterator[None]:
    """``SNAPSHOT`` set to ``identity`` inside the block, reset after it: for work run on a
    worker thread, which does not carry the loop's context."""
    token = SNAPSHOT.set(identity)
    try:
        yield
    finally:
        SNAPSHOT.reset(token)


class ContextFilter(logging.Filter):
    """Adds ``record.snapshot`` and ``record.peer`` (None when unknown)."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Set ``record.snapshot`` / ``record.peer`` from the context unless the call gave them
        (``extra=``); always True (no record is dropped)."""
        if not hasattr(record, "snapshot"):
            record.snapshot = SNAPSHOT.get()
        if not hasattr(record, "peer"):
            record.peer = PEER.get()
        return True
