"""One snapshot's life on a node: state, stage times, have-bitfields and byte counters.

The record changes only in ``SnapshotJob.apply``, one event at a time
(``bdn.daemon.snapshots.events``: state moved, manifest attached, chunk verified, bytes counted,
layer complete, quarantined...), sent by the runner, the fetcher and its sources, the manifest
reader, the foreign loader, a fold and the catalog; everything else reads it
(``tests/test_policy_layout.py`` fails on an assignment to its fields anywhere else).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from bdn.daemon.observe import versioned
from bdn.daemon.snapshots import events as ev
from bdn.daemon.snapshots.foreign_state import ForeignState
from bdn.daemon.snapshots.layers import RESULT, STORED
from bdn.daemon.store.bitfield import Bitfield
from bdn.daemon.store.chunklist import ChunkList
from bdn.daemon.store.store import Store
from bdn.proto.manifest import ChunkRef, Manifest
from bdn.proto.states import SNAPSHOT_STATES, TERMINAL

STATES = SNAPSHOT_STATES
__all__ = ["STATES", "TERMINAL", "TRANSITIONS", "STORED", "RESULT", "Jobs", "Loc", "SnapshotJob", "TransitionRefused"]


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


#: The moves ``StateChanged`` may make, by the state left: what the runner, a fold and the
#: catalog do. ``queued -> ready`` is a snapshot found ready in the store at start; a ready one
#: fails only if what follows its publication fails (GC); ``failed`` is left by no event (a
#: prefetch starts a new record). ``ready -> downloading`` is ``Quarantined``'s alone.
TRANSITIONS: dict[str, frozenset[str]] = {
    "queued": frozenset({"downloading", "ready", "failed"}),
    "downloading": frozenset({"queued", "applying", "verifying", "failed"}),
    "applying": frozenset({"verifying", "failed"}),
    "verifying": frozenset({"ready", "failed"}),
    "ready": frozenset({"failed"}),
    "failed": frozenset(),
}


class TransitionRefused(RuntimeError):
    """An event the record's state does not allow (a bug in its sender): nothing was changed."""


class SnapshotJob:
    """The node's record of one snapshot, from ``queued`` to ``ready`` or ``failed``.

    Its fields change only in :meth:`apply` (events: ``bdn.daemon.snapshots.events``); every
    other part reads them. ``requested_by`` (who asked), ``wait_publish`` (with nothing in the
    bucket yet: wait, or fail at once) and ``created`` (epoch s; a snapshot restored from the
    store keeps its record's) are given at construction, the same for a fresh download and a
    snapshot found ready at start. What drives a job is not part of it: its asyncio task (the
    runner keeps it, ``Runner.task``) and its chunk acquisitions (the fetcher's single-flight
    table, ``Fetcher.acquiring``).
    """

    def __init__(
        self,
        identity: str,
        store: Store,
        on_change: Callable[[SnapshotJob], Awaitable[None]] | None = None,
        *,
        requested_by: str = "local",
        wait_publish: bool = True,
        created: float | None = None,
    ) -> None:
        self.identity = identity
        self.store = store
        self.requested_by = requested_by
        self.wait_publish = wait_publish
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
        self.updated = time.time()
        self.created = created if created is not None else self.updated
        self._stage_started = time.monotonic()
        self.stages: dict[str, float] = {}
        self.ready_count = 0  # times it became ready (a repair takes it out and back): engines' re-offers
        self.bytes_total = 0
        self.bytes_done = 0
        self.bytes_from_bucket = 0
        self.bytes_from_peers = 0
        self.bytes_local = 0
        self.result_bytes = 0
        self.stored_bytes = 0
        self.fetch_layer = STORED  # the layer whose bytes bytes_done counts
        self.on_change = on_change  # awaited after every notify (the catalog, for the hot-load view)
        self.manifest_digest = ""  # xxh3-128 of the manifest's bytes (ties saved progress to it)
        self.bytes_resumed = 0
        self.tensor_index: dict[str, tuple[str, Any]] | None = None  # built on the first tensor pull
        self.tensor_refused = ""  # why its headers cannot be served (logged once)
        # a snapshot without a manifest: its table (None for a bdn one), which of its stored chunks
        # (file index, chunk index in the file) came from which peer (url, node id) or were taken
        # back from disk after a restart, and whether every object verified (bdn.daemon.snapshots.foreign_state)
        self.foreign: ForeignState | None = None
        self.foreign_senders: dict[tuple[int, int], tuple[str, str]] = {}
        self.foreign_restored: set[tuple[int, int]] = set()
        self.foreign_verified = False
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

    def held_back(self, ref: ChunkRef) -> bool:
        """Whether stored chunk ``ref`` of a snapshot without a manifest waits for its object's
        verification before it is served (it came from a peer, or from disk after a restart):
        its id is no digest. False for a snapshot with a manifest (chunks are hashed on arrival)."""
        key = (ref.file_index, ref.index)
        return key in self.foreign_senders or key in self.foreign_restored

    def servable(self, ref: ChunkRef) -> bool:
        """Whether ``ref``, held here, may be served to peers now: always with a manifest; without
        one, once every object verified or when this node read the chunk from the bucket itself."""
        return self.foreign is None or self.foreign_verified or not self.held_back(ref)

    def _bytes_of(self, layer: str, positions: Iterable[int]) -> int:
        refs = self.refs(layer)
        if isinstance(refs, ChunkList):
            return refs.bytes_of(positions)
        return sum(refs[i].length for i in positions)

    # ---- the one mutator -----------------------------------------------------------------
    def apply(self, event: ev.Event) -> bool:
        """Apply ``event`` (``bdn.daemon.snapshots.events``): the only code that changes this
        record's fields. Returns True if the record changed; then ``version`` (what waiters and
        have long-polls watch) and ``updated`` (epoch s) move. Waiters are woken by the
        caller's :meth:`notify` (async; ``apply`` never awaits, so events apply one at a time).

        Raises:
            TransitionRefused: a ``StateChanged`` not in ``TRANSITIONS``, a ``Quarantined`` of a
                snapshot that is not ready, a ``ReasonChanged`` of a terminal one.
            TypeError: ``event`` is not one of the events.
        """
        handler = _APPLY.get(type(event))
        if handler is None:
            raise TypeError(f"not a snapshot event: {event!r}")
        changed = handler(self, event)
        if changed:
            self.version += 1
            self.updated = time.time()
        return changed

    def _state_changed(self, e: ev.StateChanged) -> bool:
        if e.state not in TRANSITIONS.get(self.state, frozenset()):
            raise TransitionRefused(f"snapshot {self.identity}: {self.state} -> {e.state} is not a move it makes")
        self._move(e.state, e.reason)
        return True

    def _move(self, state: str, reason: str) -> None:
        # the time spent in the state left is added to ``stages`` (seconds)
        now = time.monotonic()
        if state != self.state:
            self.stages[self.state] = self.stages.get(self.state, 0.0) + now - self._stage_started
            self._stage_started = now
            if state == "ready":
                self.ready_count += 1
        self.state, self.reason = state, reason

    def _reason_changed(self, e: ev.ReasonChanged) -> bool:
        if self.state in TERMINAL:
            raise TransitionRefused(f"snapshot {self.identity} is {self.state}: its reason is final")
        self.reason = e.reason
        return True

    def _manifest_attached(self, e: ev.ManifestAttached) -> bool:
        m = e.manifest
        self.kind, self.policy_version, self.base_identity = m.kind, m.policy_version, m.base_identity
        self.stored_refs, self.result_refs = e.stored_refs, e.result_refs
        self.stored, self.result = Bitfield(len(e.stored_refs)), Bitfield(len(e.result_refs))
        self.stored_bytes, self.result_bytes, self.bytes_total = m.stored_bytes, m.result_bytes, m.stored_bytes
        self.manifest_digest, self.derived = e.digest, e.derived
        self.manifest = m
        return True

    def _foreign_attached(self, e: ev.ForeignAttached) -> bool:
        self.foreign = e.state
        self.foreign_senders, self.foreign_restored, self.foreign_verified = {}, set(), False
        return True

    def _foreign_received(self, e: ev.ForeignReceived) -> bool:
        if self.foreign is None:
            return False
        self.foreign_senders[(e.ref.file_index, e.ref.index)] = (e.url, e.node_id)
        return True

    def _foreign_verified(self, e: ev.ForeignVerified) -> bool:
        if self.foreign is None or self.foreign_verified:
            return False
        self.foreign_verified = True
        return True

    def _layer_started(self, e: ev.LayerStarted) -> bool:
        if self.fetch_layer == e.layer:
            return False
        bits = self.bits(e.layer)
        assert bits is not None
        self.fetch_layer = e.layer
        self.bytes_total = self.stored_bytes if e.layer == STORED else self.result_bytes
        self.bytes_done = self._bytes_of(e.layer, bits.set_positions().tolist())
        return True

    def _chunk_verified(self, e: ev.ChunkVerified) -> bool:
        layer, ref = e.layer, e.ref
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
        return True

    def _bytes_counted(self, e: ev.BytesCounted) -> bool:
        if e.source == ev.FROM_BUCKET:
            self.bytes_from_bucket += e.n
        elif e.source == ev.FROM_PEERS:
            self.bytes_from_peers += e.n
        else:  # FROM_LOCAL (the event checks its source)
            self.bytes_local += e.n
        return True

    def _layer_complete(self, e: ev.LayerComplete) -> bool:
        bits = self.bits(e.layer)
        assert bits is not None  # a layer completes only once the manifest is attached
        bits.set_all()
        if e.layer == self.fetch_layer:
            self.bytes_done = self.bytes_total
        return True

    def _layer_reset(self, e: ev.LayerReset) -> bool:
        if e.layer == STORED:
            self.stored = Bitfield(len(self.stored_refs))
        else:
            self.result = Bitfield(len(self.result_refs))
        return True

    def _resumed(self, e: ev.Resumed) -> bool:
        bits = self.bits(e.layer)
        assert bits is not None
        for i in e.positions:
            bits.set(i)
        if e.layer == STORED:
            self.bytes_done = self.bytes_resumed = self._bytes_of(STORED, e.positions)
            if self.foreign is not None:  # unhashed (ids are no digests): held back until verified
                for i in e.positions:
                    ref = self.stored_refs[i]
                    self.foreign_restored.add((ref.file_index, ref.index))
        return True

    def _restarted(self, e: ev.Restarted) -> bool:
        # (the index drops segments of the old table: bdn.daemon.store.index)
        self._manifest_attached(e.attached)
        self.fetch_layer = STORED
        self.bytes_done = self.bytes_resumed = self.bytes_from_bucket = self.bytes_from_peers = self.bytes_local = 0
        return True

    def _quarantined(self, e: ev.Quarantined) -> bool:
        if self.state != "ready":
            raise TransitionRefused(f"snapshot {self.identity} is {self.state}: only a ready one is repaired")
        assert self.result is not None and self.stored is not None and self.manifest is not None
        for i in e.positions:
            ref = self.result_refs[i]
            if self.result.clear(i) and self.fetch_layer == RESULT:
                self.bytes_done -= ref.length
            if not self.manifest.files[ref.file_index].is_diff:
                if self.stored.clear(self.ref_index(STORED, ref)) and self.fetch_layer == STORED:
                    self.bytes_done -= ref.length
        self._move("downloading", e.reason)
        return True

    def _publish_deadline(self, e: ev.PublishDeadline) -> bool:
        self.publish_deadline = max(self.publish_deadline or 0.0, e.deadline)
        return True

    def _tensor_index_built(self, e: ev.TensorIndexBuilt) -> bool:
        self.tensor_index = e.index
        return True

    def _tensor_index_refused(self, e: ev.TensorIndexRefused) -> bool:
        if self.tensor_refused:
            return False  # the first reason stays (logged once)
        self.tensor_refused = e.reason
        return True

    def _shed(self, e: ev.Shed) -> bool:
        if self.manifest is None and self.stored is None and self.result is None and self.foreign is None:
            return False  # shed already (or never attached)
        self.manifest = None
        self.stored_refs = self.result_refs = ()
        self.stored = self.result = None
        self.tensor_index = None
        self.foreign = None
        self.foreign_senders, self.foreign_restored = {}, set()
        return True

    def _stopping(self, e: ev.Stopping) -> bool:
        return True

    # ---- waiting and reading ---------------------------------------------------------------
    async def notify(self) -> None:
        """Wake everything waiting on ``version`` (``wait_change``), then call ``on_change``."""
        async with self.cond:
            self.cond.notify_all()
        if self.on_change is not None:
            await self.on_change(self)

    async def wait_change(self, since: int, timeout: float) -> None:
        """Return once ``version`` differs from ``since`` or ``timeout`` seconds passed."""
        await versioned.wait_change(self.cond, lambda: self.version, since, timeout)

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


_APPLY: dict[type, Callable[[SnapshotJob, Any], bool]] = {
    ev.ChunkVerified: SnapshotJob._chunk_verified,
    ev.BytesCounted: SnapshotJob._bytes_counted,
    ev.StateChanged: SnapshotJob._state_changed,
    ev.ReasonChanged: SnapshotJob._reason_changed,
    ev.ManifestAttached: SnapshotJob._manifest_attached,
    ev.ForeignAttached: SnapshotJob._foreign_attached,
    ev.ForeignReceived: SnapshotJob._foreign_received,
    ev.ForeignVerified: SnapshotJob._foreign_verified,
    ev.LayerStarted: SnapshotJob._layer_started,
    ev.LayerComplete: SnapshotJob._layer_complete,
    ev.LayerReset: SnapshotJob._layer_reset,
    ev.Resumed: SnapshotJob._resumed,
    ev.Restarted: SnapshotJob._restarted,
    ev.Quarantined: SnapshotJob._quarantined,
    ev.PublishDeadline: SnapshotJob._publish_deadline,
    ev.TensorIndexBuilt: SnapshotJob._tensor_index_built,
    ev.TensorIndexRefused: SnapshotJob._tensor_index_refused,
    ev.Shed: SnapshotJob._shed,
    ev.Stopping: SnapshotJob._stopping,
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
