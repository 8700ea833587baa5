"""Domain error -> HTTP status: the one table the HTTP adapters use (first matching class wins)."""

from __future__ import annotations

from bdn.daemon.errors import Conflict, Invalid, NotFound, Unsupported, Upstream
from bdn.proto.errors import BdnError, IdentityError, PathError

STATUS: tuple[tuple[type[BaseException], int], ...] = (
    (Invalid, 400),
    (IdentityError, 400),
    (PathError, 400),
    (NotFound, 404),
    (Conflict, 409),
    (Unsupported, 415),
    (Upstream, 502),
    (BdnError, 500),
)


def status_of(e: BaseException) -> int:
    """The status answering ``e`` (500 for an error with no entry)."""
    for cls, status in STATUS:
        if isinstance(e, cls):
            return status
    return 500
