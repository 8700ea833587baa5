"""Errors of the publisher. Subclasses of the shared :class:`bdn.proto.errors.BdnError`."""

from __future__ import annotations

from bdn.proto.errors import BdnError


class PublishError(BdnError):
    """The publisher refused a request or could not finish it (one line saying why)."""


class BaseNotPublished(PublishError):
    """The base snapshot named for a delta has no ``bdn.manifest.json`` in the bucket."""
