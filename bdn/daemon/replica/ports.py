"""The small catalog interface the replica depends on (``bdn.daemon.snapshots.catalog.Catalog`` is one)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol


class SnapshotRecord(Protocol):
    """What the replica reads of a snapshot job (``bdn.daemon.snapshots.snapshot.SnapshotJob`` is one)."""

    identity: str
    state: str
    reason: str
    kind: str | None
    base_identity: str | None
    policy_version: int | None
    bytes_done: int
    bytes_total: int
    ready_count: int  # times it became ready (a repair takes it out of ready and back)


class Snapshots(Protocol):
    """What the replica needs of the catalog: look up, start and cancel snapshots, and their directories."""

    def get(self, identity: str) -> SnapshotRecord | None:
        """The record of ``identity``, or None if this daemon does not know it."""

    def prefetch(self, identity: str, requested_by: str = "local", wait_publish: bool = True) -> SnapshotRecord:
        """The record of ``identity``, its download started if new (``wait_publish``: with nothing
        under the identity in the bucket, wait for it to be published, else fail at once)."""

    def ready_dir(self, identity: str) -> Path:
        """The directory of ``identity``'s files once it is ready."""

    def stored_dir(self, identity: str) -> Path:
        """The directory of a delta's stored diff files."""

    async def cancel(self, identity: str, reason: str = "cancelled") -> SnapshotRecord:
        """Stop ``identity``'s download and fail it with ``reason``; returns its record."""
