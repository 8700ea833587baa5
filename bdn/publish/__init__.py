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
from bdn.publish.sharded import PartError, PartRecord, commit_step, publish_part

__all__ = [
    "CHECKSUM_FORMAT",
    "BaseNotPublished",
    "PartError",
    "PartRecord",
    "ProgressFn",
    "PublishError",
    "commit_step",
    "publish_delta",
    "publish_full",
    "publish_part",
    "publish_startup",
]
