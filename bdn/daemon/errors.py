"""The daemon's domain errors. They say what went wrong in one line and carry no HTTP status:
the HTTP adapters map each class onto a status (``bdn/daemon/http/errors.py``)."""

from __future__ import annotations

from bdn.proto.errors import BdnError


class Invalid(BdnError):
    """A request is malformed (bad JSON, an unknown field, a bad identity)."""


class NotFound(BdnError):
    """The thing asked for is not known here (a snapshot, an engine, a lease, a bucket object)."""


class Conflict(BdnError):
    """The request contradicts the current state (not ready, not the base, not offered)."""


class Unsupported(BdnError):
    """A format this daemon does not implement (a compression or checksum format)."""


class Upstream(BdnError):
    """The bucket could not be read or holds something invalid."""


class NotAvailable(BdnError):
    """No source could supply a chunk (message says which and why)."""


class Superseded(Exception):
    """A bucket read given up at the moment it took its bucket slot, because another node
    announced the same chunk (it reads it, or holds it) meanwhile: the chunk is taken from that
    node instead (bdn.daemon.fetch: reads taken over at the end of an owner's list). Not a
    failure; never reaches a client."""
