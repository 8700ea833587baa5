"""The small catalog interface the replica depends on (``bdn.daemon.catalog.Catalog`` is one)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol


class SnapshotRecord(Protocol):
    identity: str
    state: str
    reason: str
    kind: str | None
    base_identity: str | None
    policy_version: int | None
    bytes_done: int
    bytes_total: int


class Snapshots(Protocol):
    def get(self, identity: str) -> SnapshotRecord | None: ...
    def prefetch(self, identity: str, requested_by: str = "local") -> SnapshotRecord: ...
    def ready_dir(self, identity: str) -> Path: ...
    def stored_dir(self, identity: str) -> Path: ...
    async def cancel(self, identity: str, reason: str = "cancelled") -> SnapshotRecord: ...
