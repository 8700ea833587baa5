"""What a snapshot without a manifest is loaded against: its table and the bucket's checksums,
one immutable value per listing (docs/TRUST.md "How the daemon loads a foreign snapshot").

The foreign loader (``bdn.daemon.snapshots.foreign_source``) derives a :class:`ForeignState` and
attaches it to the job with ``ForeignAttached``; a fresh listing (an object replaced mid-download)
attaches a new one. What changes while the snapshot loads (who sent which chunk, which chunks were
taken back from disk, whether every object verified) is the job's, changed by its events
(``SnapshotJob.foreign_senders``, ``foreign_restored``, ``foreign_verified``). Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from bdn.bucket import ObjectChecksum
from bdn.proto.foreign import ForeignTable
from bdn.proto.manifest import ChunkRef


@dataclass(frozen=True)
class Hint:
    """What a hot-load request says about a snapshot the bucket cannot: the base of a delta
    (``previous_snapshot_identity``) and the codec (``compression_format``), both optional."""

    base_identity: str | None = None
    compression_format: str | None = None


@dataclass(frozen=True, eq=False)
class ForeignState:
    """A foreign job's table, the bucket's checksum of each of its objects (by path), whether
    objects without one are accepted from peers (``allow_unverifiable``) and the hint the table
    was derived with. ``unverifiable``: the indices (manifest order) of the objects the bucket
    vouches nothing for (derived)."""

    table: ForeignTable
    checksums: Mapping[str, ObjectChecksum]
    allow_unverifiable: bool
    hint: Hint = Hint()
    unverifiable: frozenset[int] = field(init=False)

    def __post_init__(self) -> None:
        bad = frozenset(i for i, o in enumerate(self.table.objects) if not self.checksums[o.path].verifiable)
        object.__setattr__(self, "unverifiable", bad)

    def etag(self, ref: ChunkRef) -> str:
        """The version token every bucket read of ``ref``'s object must match."""
        return self.table.objects[ref.file_index].etag

    def bucket_only(self, ref: ChunkRef) -> bool:
        """Whether this node must read ``ref`` from the bucket itself (its object has no checksum
        and unverifiable objects are not accepted from peers)."""
        return ref.file_index in self.unverifiable and not self.allow_unverifiable

    def persisted(self) -> dict[str, Any]:
        """What a restarted daemon needs to resume this snapshot (saved with its progress): the
        table id, the hint (base, codec) and every object's ETag (to say which one changed)."""
        return {
            "table": self.table.table_id,
            "base": self.hint.base_identity,
            "codec": self.hint.compression_format,
            "etags": {o.path: o.etag for o in self.table.objects},
        }
