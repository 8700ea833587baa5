"""The trainer side of bdn: publish full and delta snapshots and ``STARTUP_SNAPSHOT`` to a bucket.

See :mod:`bdn.publish.publisher` and the ``bdn-publish`` command (:mod:`bdn.cli.publish`).
"""

from bdn.publish.errors import BaseNotPublished, PublishError
from bdn.publish.publisher import (
    CHECKSUM_FORMAT,
    ProgressFn,
    publish_delta,
    publish_full,
    publish_startup,
)

__all__ = [
    "CHECKSUM_FORMAT",
    "BaseNotPublished",
    "ProgressFn",
    "PublishError",
    "publish_delta",
    "publish_full",
    "publish_startup",
]
