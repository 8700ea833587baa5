"""The changes one snapshot's record (``SnapshotJob``) goes through, one small frozen value each.

Whatever learns something about a snapshot (the runner, the fetcher and its sources, the manifest
reader, the foreign loader, a fold, the catalog) builds one of these and hands it to
``SnapshotJob.apply``, the one code that changes the record's fields; everything else only reads
them. This is the shape of Kraken's scheduler (``uber/kraken``, ``lib/torrent/scheduler/events.go``:
each event is a small value whose ``Apply`` is run one at a time by one loop): here every caller
runs on the daemon's event loop and ``apply`` never awaits, so events are applied one at a time.

Pure data, no I/O. The one costly value, a manifest's chunk lists, is built by
``ManifestAttached.of`` (O(files)), which a caller runs on a worker thread before the event is
applied on the loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bdn.daemon.snapshots.foreign_state import ForeignState
from bdn.daemon.store.chunklist import ChunkList
from bdn.proto.manifest import ChunkRef, Manifest

#: Where a chunk's bytes came from (``BytesCounted.source``): the bucket, a peer, a local copy.
FROM_BUCKET, FROM_PEERS, FROM_LOCAL = "bucket", "peers", "local"
SOURCES = (FROM_BUCKET, FROM_PEERS, FROM_LOCAL)


@dataclass(frozen=True, slots=True)
class StateChanged:
    """The snapshot moves to ``state`` (``bdn.proto.states``) with a one-line ``reason`` (empty
    unless failed or waiting). Only the moves in ``snapshot.TRANSITIONS`` are applied; a ready
    snapshot goes back to ``downloading`` only by ``Quarantined``."""

    state: str
    reason: str = ""


@dataclass(frozen=True, slots=True)
class ReasonChanged:
    """Why a snapshot that is not in a terminal state waits, in one line (waiting for its
    manifest, for its base, for the bucket; folding); ``""`` once it no longer waits."""

    reason: str


@dataclass(frozen=True, slots=True)
class ManifestAttached:
    """The verified manifest (or a foreign table's manifest) is taken: its kind, policy version
    and base, both layers' chunk lists with empty bitfields, the byte totals. ``digest``: XXH3-128
    of the manifest's bytes, or a foreign table's id (saved progress is tied to it); ``derived``:
    the table was derived on this node (restored from a record without claims to check)."""

    manifest: Manifest
    digest: str
    stored_refs: ChunkList
    result_refs: ChunkList
    derived: bool = False

    @classmethod
    def of(cls, m: Manifest, digest: str, derived: bool = False) -> ManifestAttached:
        """The event for ``m``, its chunk lists built (O(files): run it off the event loop)."""
        return cls(m, digest, ChunkList(m, result=False), ChunkList(m, result=True), derived)


@dataclass(frozen=True, slots=True)
class ForeignAttached:
    """A snapshot without a manifest is loaded against ``state`` (its table and the bucket's
    checksums, ``bdn.daemon.snapshots.foreign_state``): nothing received from peers, taken back
    from disk or verified yet (a fresh listing after an object was replaced starts over)."""

    state: ForeignState


@dataclass(frozen=True, slots=True)
class ForeignReceived:
    """Stored chunk ``ref`` of a snapshot without a manifest came from peer ``url`` (``node_id``):
    not served on before its object verified, and the peer is blamed if that object fails.
    Applied only while a ``ForeignState`` is attached (else: not changed)."""

    ref: ChunkRef
    url: str
    node_id: str


@dataclass(frozen=True, slots=True)
class ForeignVerified:
    """Every object of a snapshot without a manifest matched the bucket's checksum (bad parts
    repaired from the bucket): its chunks from peers or from disk may be served now."""


@dataclass(frozen=True, slots=True)
class LayerStarted:
    """The fetch of ``layer`` (``STORED``/``RESULT``) begins: ``bytes_total`` and ``bytes_done``
    count that layer from now on."""

    layer: str


@dataclass(frozen=True, slots=True)
class ChunkVerified:
    """``ref`` of ``layer`` is written and verified on disk (a file that is not a diff is the
    same bytes in both layers: its chunk counts in both). Applied: True if it was new."""

    layer: str
    ref: ChunkRef


@dataclass(frozen=True, slots=True)
class BytesCounted:
    """``n`` bytes of a chunk came from ``source`` (``FROM_BUCKET``, ``FROM_PEERS`` or
    ``FROM_LOCAL``). Raises ValueError for another source or a negative count."""

    source: str
    n: int

    def __post_init__(self) -> None:
        if self.source not in SOURCES or self.n < 0:
            raise ValueError(f"bytes counted: {self.n} from {self.source!r} (sources: {', '.join(SOURCES)})")


@dataclass(frozen=True, slots=True)
class LayerComplete:
    """Every chunk of ``layer`` is known good (a full snapshot's result layer is its stored one;
    a delta's rebuilt files were verified; a snapshot found ready in the store)."""

    layer: str


@dataclass(frozen=True, slots=True)
class LayerReset:
    """What ``layer`` held is abandoned (result mode fell back to the delta chain)."""

    layer: str


@dataclass(frozen=True, slots=True)
class Resumed:
    """The chunks at ``positions`` of ``layer`` were re-verified on disk after a restart (of a
    snapshot without a manifest: taken back unhashed under unchanged ETags, held back from peers
    until their object verified)."""

    layer: str
    positions: Sequence[int]


@dataclass(frozen=True, slots=True)
class Restarted:
    """Everything fetched is abandoned for a new table (a snapshot without a manifest whose
    object was replaced mid-download): ``attached`` is taken, nothing is held, counters are zero."""

    attached: ManifestAttached


@dataclass(frozen=True, slots=True)
class Quarantined:
    """The rebuilt chunks at ``positions`` were found corrupted on disk (``bdnctl verify
    --repair``): no longer held (nor a non-diff file's stored chunk), and the ready snapshot goes
    back to ``downloading`` with ``reason`` while they are fetched again."""

    positions: Sequence[int]
    reason: str


@dataclass(frozen=True, slots=True)
class PublishDeadline:
    """An asker's patience: stop waiting for publication at ``deadline`` (monotonic s), or at
    the latest deadline of every asker so far."""

    deadline: float


@dataclass(frozen=True, slots=True)
class TensorIndexBuilt:
    """Every tensor of the ready snapshot by name: ``{name: (file path, TensorInfo)}``."""

    index: dict[str, tuple[str, Any]]


@dataclass(frozen=True, slots=True)
class TensorIndexRefused:
    """The snapshot's safetensors headers cannot be served: ``reason`` (one line, logged once)."""

    reason: str


@dataclass(frozen=True, slots=True)
class Shed:
    """A failed record whose task has ended drops what only a download needs (manifest, chunk
    lists, bitfields, tensor index, foreign table and its bookkeeping); ``describe`` is unchanged."""


@dataclass(frozen=True, slots=True)
class Stopping:
    """The daemon stops: the record's ``version`` moves (nothing else changes), so that every
    waiter looks again and sees the catalog closing."""


#: Every event ``SnapshotJob.apply`` takes.
Event = (
    StateChanged
    | ReasonChanged
    | ManifestAttached
    | ForeignAttached
    | ForeignReceived
    | ForeignVerified
    | LayerStarted
    | ChunkVerified
    | BytesCounted
    | LayerComplete
    | LayerReset
    | Resumed
    | Restarted
    | Quarantined
    | PublishDeadline
    | TensorIndexBuilt
    | TensorIndexRefused
    | Shed
    | Stopping
)
