"""One snapshot's life on a node: state, stage times, have-bitfields and byte counters.

The record is written only through its event methods (``set_state``, ``chunk_verified``,
``layer_complete``, ``layer_reset``, ``resumed``, ``quarantined``, ``start_layer``, ``attach_manifest``), called
by the snapshot's runner and the fetcher; everything else reads it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from bdn.daemon.observe import versioned
from bdn.daemon.snapshots.layers import RESULT, STORED
from bdn.daemon.store.bitfield import Bitfield
from bdn.daemon.store.chunklist import ChunkList
from bdn.daemon.store.store import Store
from bdn.proto.manifest import ChunkRef, Manifest
from bdn.proto.states import SNAPSHOT_STATES, TERMINAL

STATES = SNAPSHOT_STATES
__all__ = ["STATES", "TERMINAL", "STORED", "RESULT", "Jobs", "Loc", "SnapshotJob"]


@dataclass(frozen=True)
class Loc:
    """Where a verified chunk lives on this node: ``layer`` file ``file_index`` of ``job``."""

    job: SnapshotJob
    layer: str
    file_index: int
    offset: int
    length: int
    digest: str

    def path(self) -> Path:
        """The file the chunk is in, under the job's current directory (``paths`` lists the others)."""
        return self.job.file_path(self.layer, self.file_index)

    def paths(self) -> list[Path]:
        """Where the bytes may be, most likely first: a snapshot's staging directory is renamed
        to its ready directory when it completes, and the rename and the job's state change are
        not one step, so a rebuilt (or full) file is looked for under both names."""
        out = [self.path()]
        m = self.job.manifest
        f = m.files[self.file_index] if m is not None else None
        if f is not None and not (self.layer == STORED and f.is_diff):
            for d in (self.job.store.ready_dir(self.job.identity), self.job.store.staging_dir(self.job.identity)):
                if d / f.path not in out:
                    out.append(d / f.path)
        return out


class SnapshotJob:
    """The node's record of one snapshot, from ``queued`` to ``ready`` or ``failed``."""

    def __init__(
        self, identity: str, store: Store, on_change: Callable[[SnapshotJob], Awaitable[None]] | None = None
    ) -> None:
        self.identity = identity
        self.store = store
        self.manifest: Manifest | None = None
        self.state = "queued"
        self.reason = ""
        self.kind: str | None = None
        self.policy_version: int | None = None
        self.base_identity: str | None = None
        self.stored: Bitfield | None = None
        self.result: Bitfield | None = None
        # the layers' chunks, compact sequences over the manifest (empty until it is attached)
        self.stored_refs: Sequence[ChunkRef] = ()
        self.result_refs: Sequence[ChunkRef] = ()
        self.version = 0  # bumps on every change: have long-polls and waiters watch it
        self.cond = asyncio.Condition()
        self.created = time.time()
        self.updated = self.created
        self._stage_started = time.monotonic()
        self.stages: dict[str, float] = {}
        self.bytes_total = 0
        self.bytes_done = 0
        self.bytes_from_bucket = 0
        self.bytes_from_peers = 0
        self.bytes_local = 0
        self.result_bytes = 0
        self.stored_bytes = 0
        self.task: asyncio.Task[None] | None = None
        self.inflight: dict[tuple[str, int], asyncio.Future[None]] = {}
        self.requested_by = "local"
        self.fetch_layer = STORED  # the layer whose bytes bytes_done counts
        self.on_change = on_change  # awaited after every notify (the catalog, for the hot-load view)
        self.manifest_digest = ""  # xxh3-128 of the manifest's bytes (ties saved progress to it)
        self.flusher: asyncio.Task[None] | None = None
        self.bytes_resumed = 0
        self.tensor_index: dict[str, tuple[str, Any]] | None = None  # built on the first tensor pull
        self.tensor_refused = ""  # why its headers cannot be served (logged once)
        self.foreign: Any = None  # ForeignState of a snapshot without a manifest (bdn.daemon.snapshots.foreign_source)
        self.wait_publish = True  # with nothing in the bucket yet: wait (True) or fail at once
        self.publish_deadline: float | None = None  # monotonic s: stop waiting for publication (None: manifest_wait_s)
        self.derived = False  # restored from the store with a table derived here: no claims to check

    # ---- layout --------------------------------------------------------------------------
    def result_dir(self) -> Path:
        """The directory the rebuilt files are in: the ready directory once ``ready``, else staging."""
        if self.state == "ready":
            return self.store.ready_dir(self.identity)
        return self.store.staging_dir(self.identity)

    def file_path(self, layer: str, file_index: int) -> Path:
        """Path of file ``file_index`` (manifest order) of ``layer``: a delta's stored diff
        files live in the stored directory, every other file in ``result_dir()``. Needs the manifest."""
        assert self.manifest is not None
        f = self.manifest.files[file_index]
        if layer == STORED and f.is_diff:
            return self.store.stored_dir(self.identity) / f.path
        return self.result_dir() / f.path

    def refs(self, layer: str) -> Sequence[ChunkRef]:
        """The chunks of ``layer`` (``STORED`` or ``RESULT``), in manifest order."""
        return self.stored_refs if layer == STORED else self.result_refs

    def bits(self, layer: str) -> Bitfield | None:
        """Which of ``layer``'s chunks this node holds (None before the manifest is attached)."""
        return self.stored if layer == STORED else self.result

    def ref_index(self, layer: str, ref: ChunkRef) -> int:
        """Position of ``ref`` in ``layer``'s chunk list (refs are in manifest order)."""
        refs = self.refs(layer)
        assert isinstance(refs, ChunkList)
        return refs.position(ref)

    # ---- state (written only through these methods) --------------------------------------
    def chunk_verified(self, layer: str, ref: ChunkRef) -> bool:
        """Event: ``ref`` of ``layer`` is written and verified. True if it was new.

        A file that is not a diff is the same bytes in both layers, so its chunk counts in both.
        """
        bits = self.bits(layer)
        assert bits is not None
        if not bits.set(self.ref_index(layer, ref)):
            return False
        if layer == self.fetch_layer:
            self.bytes_done += ref.length
        if self.manifest is not None and not self.manifest.files[ref.file_index].is_diff:
            other_layer = RESULT if layer == STORED else STORED
            other = self.bits(other_layer)
            if other is not None and self.result_refs and other.n:
                other.set(self.ref_index(other_layer, ref))
        self.touch()
        return True

    def layer_complete(self, layer: str) -> None:
        """Event: every chunk of ``layer`` is known good (a full snapshot's result is its stored
        layer; a delta's rebuilt files were verified; result mode makes the stored layer moot)."""
        bits = self.bits(layer)
        assert bits is not None  # a layer completes only once the manifest is attached
        bits.set_all()
        self.touch()

    def layer_reset(self, layer: str) -> None:
        """Event: what ``layer`` held is abandoned (result mode fell back to the delta chain)."""
        if layer == STORED:
            self.stored = Bitfield(len(self.stored_refs))
        else:
            self.result = Bitfield(len(self.result_refs))
        self.touch()

    def resumed(self, layer: str, positions: list[int]) -> None:
        """Event: chunks at ``positions`` of ``layer`` were re-verified on disk after a restart."""
        bits = self.bits(layer)
        assert bits is not None
        for i in positions:
            bits.set(i)
        if layer == STORED:
            self.bytes_done = self.bytes_resumed = self._bytes_of(STORED, positions)
        self.touch()

    def restarted(self, m: Manifest) -> None:
        """Event: everything fetched is abandoned for a new table ``m`` (a snapshot without a
        manifest whose object was replaced mid-download): nothing held, nothing in the index."""
        self.attach_manifest(m)  # (the index drops segments of the old table: bdn.daemon.store.index)
        self.fetch_layer = STORED
        self.bytes_done = self.bytes_resumed = self.bytes_from_bucket = self.bytes_from_peers = self.bytes_local = 0
        self.touch()

    def quarantined(self, positions: list[int]) -> None:
        """Event: the rebuilt chunks at ``positions`` of the result layer were found corrupted on
        disk (``bdnctl verify --repair``): no longer held (a file that is not a diff loses the same
        chunk of its stored layer too)."""
        assert self.result is not None and self.stored is not None and self.manifest is not None
        for i in positions:
            ref = self.result_refs[i]
            if self.result.clear(i) and self.fetch_layer == RESULT:
                self.bytes_done -= ref.length
            if not self.manifest.files[ref.file_index].is_diff:
                if self.stored.clear(self.ref_index(STORED, ref)) and self.fetch_layer == STORED:
                    self.bytes_done -= ref.length
        self.touch()

    def start_layer(self, layer: str) -> None:
        """Event: the fetch of ``layer`` begins; ``bytes_total``/``bytes_done`` count that layer."""
        if self.fetch_layer != layer:
            bits = self.bits(layer)
            self.fetch_layer = layer
            self.bytes_total = self.stored_bytes if layer == STORED else self.result_bytes
            assert bits is not None
            self.bytes_done = self._bytes_of(layer, bits.set_positions().tolist())

    def _bytes_of(self, layer: str, positions: Iterable[int]) -> int:
        refs = self.refs(layer)
        if isinstance(refs, ChunkList):
            return refs.bytes_of(positions)
        return sum(refs[i].length for i in positions)

    def attach_manifest(self, m: Manifest) -> None:
        """Take the verified manifest ``m``: its kind, policy version and base, the two
        layers' chunk lists and empty bitfields, and the byte totals. O(files): a worker thread
        may run it for a job nothing reads yet (``manifest`` is set last)."""
        stored_refs, result_refs = ChunkList(m, result=False), ChunkList(m, result=True)
        stored, result = Bitfield(len(stored_refs)), Bitfield(len(result_refs))
        stored_bytes, result_bytes = m.stored_bytes, m.result_bytes
        self.kind, self.policy_version, self.base_identity = m.kind, m.policy_version, m.base_identity
        self.stored_refs, self.result_refs, self.stored, self.result = stored_refs, result_refs, stored, result
        self.stored_bytes, self.result_bytes, self.bytes_total = stored_bytes, result_bytes, stored_bytes
        self.manifest = m

    def restored(self, manifest_digest: str, created: float, derived: bool) -> None:
        """Event: the snapshot was found READY in shm at start (``bdn.daemon.snapshots.records``), its
        manifest attached: both layers held, created at ``created`` (epoch s) as before the
        restart, ``ready``."""
        self.manifest_digest, self.created, self.derived = manifest_digest, created, derived
        self.layer_complete(STORED)
        self.layer_complete(RESULT)
        self.bytes_done = self.bytes_total
        self.requested_by = "store"
        self.set_state("ready")

    def set_state(self, state: str, reason: str = "") -> None:
        """Move to ``state`` (one of ``bdn.proto.states``) with ``reason``; the time spent in
        the state left is added to ``stages`` (seconds)."""
        now = time.monotonic()
        if state != self.state:
            self.stages[self.state] = self.stages.get(self.state, 0.0) + now - self._stage_started
            self._stage_started = now
        self.state, self.reason = state, reason
        self.touch()

    def touch(self) -> None:
        """Record a change: bump ``version`` (what waiters watch) and ``updated`` (epoch s)."""
        self.version += 1
        self.updated = time.time()

    async def notify(self) -> None:
        """Wake everything waiting on ``version`` (``wait_change``), then call ``on_change``."""
        async with self.cond:
            self.cond.notify_all()
        if self.on_change is not None:
            await self.on_change(self)

    async def wait_change(self, since: int, timeout: float) -> None:
        """Return once ``version`` differs from ``since`` or ``timeout`` seconds passed."""
        await versioned.wait_change(self.cond, lambda: self.version, since, timeout)

    def shed(self) -> None:
        """Drop what only a download needs (manifest, chunk lists, bitfields, tensor index, the
        in-flight table), keeping the record's scalars (``describe`` is unchanged): for a failed
        record whose task has ended, which the catalog keeps only to report its reason."""
        self.manifest = None
        self.stored_refs = self.result_refs = ()
        self.stored = self.result = None
        self.tensor_index = None
        self.inflight = {}
        self.foreign = None

    def describe(self) -> dict[str, Any]:
        """The snapshot's record as the local API returns it (``GET /v1/snapshots/{id}``):
        identity, kind, state, reason, path once ready, byte counts by source, and seconds per stage."""
        stages = dict(self.stages)
        if self.state not in TERMINAL:
            stages[self.state] = stages.get(self.state, 0.0) + time.monotonic() - self._stage_started
        return {
            "identity": self.identity,
            "kind": self.kind,
            "policy_version": self.policy_version,
            "base_identity": self.base_identity,
            "state": self.state,
            "reason": self.reason,
            "path": str(self.store.ready_dir(self.identity)) if self.state == "ready" else None,
            "bytes_total": self.bytes_total,
            "bytes_done": self.bytes_done,
            "stored_bytes": self.stored_bytes,
            "result_bytes": self.result_bytes,
            "bytes_from_bucket": self.bytes_from_bucket,
            "bytes_from_peers": self.bytes_from_peers,
            "bytes_local": self.bytes_local,
            "bytes_resumed": self.bytes_resumed,
            "stages": {k: round(v, 6) for k, v in stages.items()},
            "requested_by": self.requested_by,
            "created_at": self.created,
            "updated_at": self.updated,
        }

    def have_map(self, stored: Bitfield | None = None, result: Bitfield | None = None) -> dict[str, Any]:
        """The msgpack-able have answer: bitfields over the manifest's stored and result chunks
        (``stored``/``result``: the bits to advertise instead of the job's own, e.g. without the
        chunks of files gone from disk: ``bdn.daemon.fetch.held``)."""
        stored = stored if stored is not None else self.stored
        result = result if result is not None else self.result
        return {
            "v": self.version,
            "state": self.state,
            "ns": stored.n if stored else 0,
            "stored": stored.to_bytes() if stored else b"",
            "nr": result.n if result else 0,
            "result": result.to_bytes() if result else b"",
        }


class Jobs(Protocol):
    """The snapshots this node knows (``bdn.daemon.snapshots.catalog.Catalog``), as the runner, a fold and
    the foreign loader look them up and start them."""

    def get(self, identity: str) -> SnapshotJob | None:
        """The job of ``identity``, or None when the node has never seen it."""
        ...

    def all(self) -> list[SnapshotJob]:
        """Every job this node knows, in the order they were started."""
        ...

    def prefetch(self, identity: str, requested_by: str = "local") -> SnapshotJob:
        """The job of ``identity``, started (queued) if it was not known; ``requested_by`` names
        who asked, for the logs and the status."""
        ...
