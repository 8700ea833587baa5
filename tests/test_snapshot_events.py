"""A snapshot's record changes only by events (bdn/daemon/snapshots/events.py) applied by
``SnapshotJob.apply`` (issue 27, "One owner per snapshot"): each event's effect, the version bump
that long-polls watch, and the moves a state may not make. Pure: no loop, no I/O (a real Store
under tmp_path only names the directories)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from bdn.bucket import ObjectChecksum
from bdn.daemon.snapshots.events import (
    FROM_BUCKET,
    FROM_LOCAL,
    FROM_PEERS,
    BytesCounted,
    ChunkVerified,
    ForeignAttached,
    ForeignReceived,
    ForeignVerified,
    LayerComplete,
    LayerReset,
    LayerStarted,
    ManifestAttached,
    PublishDeadline,
    Quarantined,
    ReasonChanged,
    Restarted,
    Resumed,
    Shed,
    StateChanged,
    Stopping,
    TensorIndexBuilt,
    TensorIndexRefused,
)
from bdn.daemon.snapshots.foreign_state import ForeignState, Hint
from bdn.daemon.snapshots.layers import RESULT, STORED
from bdn.daemon.snapshots.snapshot import TRANSITIONS, SnapshotJob, TransitionRefused
from bdn.daemon.store.chunklist import ChunkList
from bdn.daemon.store.store import Store
from bdn.proto.foreign import ForeignObject, ForeignTable
from bdn.proto.manifest import FileEntry, FileResult, Manifest
from bdn.proto.states import SNAPSHOT_STATES, TERMINAL

CS = 4096


def _manifest(identity: str = "step000002", delta: bool = True) -> Manifest:
    """A delta (base ``step000001``): ``a.bin`` a diff of 2 stored chunks rebuilding 3 result
    chunks, ``b.bin`` 2 chunks the same in both layers (or, ``delta=False``, a full snapshot of
    ``b.bin`` alone)."""
    b = FileEntry("b.bin", 2 * CS, ("b0" * 16, "b1" * 16))
    files = (b,)
    if delta:
        a = FileEntry(
            "a.bin", 2 * CS, ("a0" * 16, "a1" * 16), FileResult(3 * CS, tuple(f"r{i}" * 16 for i in range(3)))
        )
        files = (a, b)
    return Manifest(
        identity=identity,
        kind="delta" if delta else "full",
        policy_version=2,
        chunk_size=CS,
        files=files,
        base_identity="step000001" if delta else None,
    )


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "shm", "swarm")


def _attached(store: Store, m: Manifest | None = None, **kw: object) -> SnapshotJob:
    m = m or _manifest()
    job = SnapshotJob(m.identity, store, **kw)  # type: ignore[arg-type]
    job.apply(ManifestAttached.of(m, "d" * 32))
    return job


def _bumps(job: SnapshotJob, event: object, changed: bool = True) -> None:
    before = job.version
    assert job.apply(event) is changed  # type: ignore[arg-type]
    assert job.version == before + (1 if changed else 0)


def test_a_new_record_is_queued_with_what_its_constructor_was_given(store: Store) -> None:
    job = SnapshotJob("s", store, requested_by="store", wait_publish=False, created=1234.5)
    assert (job.state, job.reason, job.version, job.manifest) == ("queued", "", 0, None)
    assert (job.requested_by, job.wait_publish, job.created) == ("store", False, 1234.5)
    fresh = SnapshotJob("s", store)
    assert (fresh.requested_by, fresh.wait_publish, fresh.created) == ("local", True, fresh.updated)


def test_manifest_attached_takes_kind_layers_and_totals(store: Store) -> None:
    m = _manifest()
    job = SnapshotJob(m.identity, store)
    _bumps(job, ManifestAttached.of(m, "d" * 32, derived=True))
    assert (job.kind, job.policy_version, job.base_identity) == ("delta", 2, "step000001")
    assert (len(job.stored_refs), len(job.result_refs)) == (4, 5)
    assert job.stored is not None and job.result is not None and job.stored.count == job.result.count == 0
    assert (job.stored_bytes, job.result_bytes, job.bytes_total) == (4 * CS, 5 * CS, 4 * CS)
    assert (job.manifest_digest, job.derived, job.manifest) == ("d" * 32, True, m)


def test_chunk_verified_counts_once_and_in_both_layers_for_a_file_that_is_not_a_diff(store: Store) -> None:
    job = _attached(store)
    assert job.stored is not None and job.result is not None
    diff_ref, same_ref = job.stored_refs[0], job.stored_refs[2]
    _bumps(job, ChunkVerified(STORED, diff_ref))
    assert job.stored.count == 1 and job.result.count == 0 and job.bytes_done == CS
    _bumps(job, ChunkVerified(STORED, same_ref))
    assert job.stored.count == 2 and job.result[job.ref_index(RESULT, same_ref)] and job.bytes_done == 2 * CS
    _bumps(job, ChunkVerified(STORED, same_ref), changed=False)  # not new: nothing moves
    assert job.bytes_done == 2 * CS
    _bumps(job, ChunkVerified(RESULT, job.result_refs[0]))  # not the layer being fetched
    assert job.bytes_done == 2 * CS and job.result.count == 2


def test_bytes_counted_by_source(store: Store) -> None:
    job = _attached(store)
    for source, n in ((FROM_BUCKET, 10), (FROM_PEERS, 20), (FROM_LOCAL, 30), (FROM_PEERS, 1)):
        _bumps(job, BytesCounted(source, n))
    assert (job.bytes_from_bucket, job.bytes_from_peers, job.bytes_local) == (10, 21, 30)
    d = job.describe()
    assert (d["bytes_from_bucket"], d["bytes_from_peers"], d["bytes_local"]) == (10, 21, 30)
    for bad in (("relay", 1), (FROM_PEERS, -1)):
        with pytest.raises(ValueError):
            BytesCounted(*bad)


def test_layer_started_counts_that_layer(store: Store) -> None:
    job = _attached(store)
    job.apply(ChunkVerified(RESULT, job.result_refs[1]))
    _bumps(job, LayerStarted(STORED), changed=False)  # already the layer counted
    _bumps(job, LayerStarted(RESULT))
    assert (job.fetch_layer, job.bytes_total, job.bytes_done) == (RESULT, 5 * CS, CS)


def test_layer_complete_and_reset(store: Store) -> None:
    job = _attached(store)
    assert job.stored is not None and job.result is not None
    _bumps(job, LayerComplete(RESULT))
    assert job.result.complete and job.bytes_done == 0  # not the layer counted
    _bumps(job, LayerComplete(STORED))
    assert job.stored.complete and job.bytes_done == job.bytes_total == 4 * CS
    _bumps(job, LayerReset(RESULT))
    assert job.result is not None and job.result.count == 0 and job.stored.complete


def test_resumed_sets_the_positions_and_the_resumed_bytes(store: Store) -> None:
    job = _attached(store)
    _bumps(job, Resumed(STORED, [0, 3]))
    _bumps(job, Resumed(RESULT, [4]))
    assert job.stored is not None and job.result is not None
    assert job.stored.set_positions().tolist() == [0, 3] and job.result.set_positions().tolist() == [4]
    assert job.bytes_done == job.bytes_resumed == 2 * CS


def test_restarted_takes_the_new_table_and_zeroes_the_counters(store: Store) -> None:
    job = _attached(store)
    job.apply(ChunkVerified(STORED, job.stored_refs[0]))
    job.apply(BytesCounted(FROM_BUCKET, CS))
    job.apply(LayerStarted(RESULT))
    new = _manifest(delta=False)
    _bumps(job, Restarted(ManifestAttached.of(new, "e" * 32)))
    assert job.manifest is new and job.manifest_digest == "e" * 32 and job.fetch_layer == STORED
    assert job.stored is not None and job.stored.count == 0 and len(job.stored_refs) == 2
    assert (job.bytes_done, job.bytes_resumed, job.bytes_from_bucket, job.bytes_from_peers, job.bytes_local) == (
        0,
        0,
        0,
        0,
        0,
    )


def _ready(store: Store) -> SnapshotJob:
    """A delta taken the way a fresh download goes: downloading, applying, verifying, ready."""
    job = _attached(store)
    job.apply(StateChanged("downloading"))
    for ref in job.stored_refs:
        job.apply(ChunkVerified(STORED, ref))
    for s in ("applying", "verifying"):
        job.apply(StateChanged(s))
    job.apply(LayerComplete(RESULT))
    job.apply(StateChanged("ready"))
    return job


def test_quarantined_takes_a_ready_snapshot_back_to_downloading(store: Store) -> None:
    job = _ready(store)
    assert job.stored is not None and job.result is not None and job.bytes_done == 4 * CS
    same = job.ref_index(RESULT, job.stored_refs[2])  # b.bin's first chunk: in both layers
    _bumps(job, Quarantined([0, same], "repairing 2 corrupted chunk(s)"))
    assert (job.state, job.reason) == ("downloading", "repairing 2 corrupted chunk(s)")
    assert not job.result[0] and not job.result[same] and job.result.count == 3
    assert not job.stored[2] and job.stored.count == 3 and job.bytes_done == 3 * CS
    assert job.describe()["path"] is None
    before = job.version
    with pytest.raises(TransitionRefused):  # only a ready snapshot is repaired
        job.apply(Quarantined([1], "again"))
    assert job.version == before and job.result[1] and job.reason == "repairing 2 corrupted chunk(s)"
    job.apply(StateChanged("verifying"))
    job.apply(StateChanged("ready"))  # the repair's way back


def _reach(store: Store, state: str) -> SnapshotJob:
    """A job in ``state``, reached by allowed moves only."""
    job = _attached(store)
    path = {
        "queued": [],
        "downloading": ["downloading"],
        "applying": ["downloading", "applying"],
        "verifying": ["downloading", "verifying"],
        "ready": ["downloading", "verifying", "ready"],
        "failed": ["failed"],
    }[state]
    for s in path:
        job.apply(StateChanged(s))
    assert job.state == state
    return job


@pytest.mark.parametrize(("left", "to"), list(itertools.product(SNAPSHOT_STATES, SNAPSHOT_STATES)))
def test_state_changed_makes_only_the_moves_in_the_table(store: Store, left: str, to: str) -> None:
    job = _reach(store, left)
    before = (job.version, job.state, job.reason, dict(job.stages))
    if to in TRANSITIONS[left]:
        _bumps(job, StateChanged(to, "why" if to == "failed" else ""))
        assert job.state == to and left in job.stages
    else:
        with pytest.raises(TransitionRefused):
            job.apply(StateChanged(to, "no"))
        assert (job.version, job.state, job.reason, dict(job.stages)) == before


def test_the_table_leaves_a_terminal_state_only_as_the_daemon_does() -> None:
    assert set(TRANSITIONS) == set(SNAPSHOT_STATES)
    assert TRANSITIONS["failed"] == frozenset()  # a prefetch makes a new record instead
    assert TRANSITIONS["ready"] == frozenset({"failed"})  # back to downloading: Quarantined only
    assert all(s not in TRANSITIONS[s] for s in SNAPSHOT_STATES)  # a reason alone: ReasonChanged


def test_reason_changed_while_waiting_never_once_terminal(store: Store) -> None:
    job = _attached(store)
    _bumps(job, ReasonChanged("waiting for manifest: looked 1 time"))
    assert (job.state, job.reason) == ("queued", "waiting for manifest: looked 1 time")
    _bumps(job, ReasonChanged(""))
    for state in TERMINAL:
        done = _reach(store, state)
        before = (done.version, done.reason)
        with pytest.raises(TransitionRefused):
            done.apply(ReasonChanged("late"))
        assert (done.version, done.reason) == before


def test_stages_add_the_time_of_each_state_left(store: Store) -> None:
    job = _ready(store)
    assert list(job.stages) == ["queued", "downloading", "applying", "verifying"]
    assert all(v >= 0.0 for v in job.stages.values())
    assert set(job.describe()["stages"]) == set(job.stages)  # a terminal state adds no running stage


def test_publish_deadline_keeps_the_latest(store: Store) -> None:
    job = SnapshotJob("s", store)
    _bumps(job, PublishDeadline(50.0))
    _bumps(job, PublishDeadline(20.0))
    assert job.publish_deadline == 50.0
    job.apply(PublishDeadline(80.0))
    assert job.publish_deadline == 80.0


def test_tensor_index_built_and_the_first_refusal_kept(store: Store) -> None:
    job = _ready(store)
    _bumps(job, TensorIndexBuilt({"w": ("b.bin", None)}))
    assert job.tensor_index == {"w": ("b.bin", None)}
    _bumps(job, TensorIndexRefused("b.bin: bad header"))
    _bumps(job, TensorIndexRefused("b.bin: another"), changed=False)
    assert job.tensor_refused == "b.bin: bad header"


def _foreign(m: Manifest, md5: bool = True) -> ForeignState:
    """A table over ``m``'s files (ids stand for digests), the bucket vouching for every object
    (``md5``) or for none."""
    objects = tuple(ForeignObject(f.path, f"{m.identity}/{f.path}", f.size, f"e-{f.path}") for f in m.files)
    sums = {o.path: ObjectChecksum(o.key, o.etag, o.size, md5="0" * 32 if md5 else None) for o in objects}
    return ForeignState(ForeignTable(m, objects, "t" * 32), sums, allow_unverifiable=False, hint=Hint("step000001"))


def _foreign_job(store: Store) -> tuple[SnapshotJob, ForeignState]:
    m = _manifest()
    job = SnapshotJob(m.identity, store)
    state = _foreign(m)
    _bumps(job, ForeignAttached(state))
    job.apply(ManifestAttached.of(m, state.table.table_id, derived=True))
    return job, state


def test_foreign_state_is_an_immutable_value(store: Store) -> None:
    m = _manifest()
    state, none = _foreign(m), _foreign(m, md5=False)
    with pytest.raises(AttributeError):
        state.allow_unverifiable = True  # type: ignore[misc]
    ref = ChunkList(m, result=False)[0]
    assert state.unverifiable == frozenset() and none.unverifiable == frozenset({0, 1})
    assert not state.bucket_only(ref) and none.bucket_only(ref)
    assert state.etag(ref) == "e-a.bin"
    assert state.persisted() == {
        "table": "t" * 32,
        "base": "step000001",
        "codec": None,
        "etags": {"a.bin": "e-a.bin", "b.bin": "e-b.bin"},
    }


def test_foreign_chunks_from_peers_or_disk_are_held_back_until_verified(store: Store) -> None:
    job, state = _foreign_job(store)
    assert job.foreign is state and not job.foreign_verified
    a, b, c, d = job.stored_refs
    _bumps(job, ForeignReceived(a, "http://p1", "p1"))
    _bumps(job, Resumed(STORED, [1]))  # b taken back from disk after a restart
    assert job.foreign_senders == {(0, 0): ("http://p1", "p1")} and job.foreign_restored == {(0, 1)}
    assert [job.held_back(r) for r in (a, b, c)] == [True, True, False]
    assert [job.servable(r) for r in (a, b, c)] == [False, False, True]  # c: read from the bucket here
    _bumps(job, ForeignVerified())
    _bumps(job, ForeignVerified(), changed=False)
    assert all(job.servable(r) for r in (a, b, c, d)) and job.held_back(a)  # registered once verified
    # a fresh listing (an object replaced mid-download) starts the bookkeeping over
    _bumps(job, ForeignAttached(_foreign(_manifest())))
    assert (job.foreign_senders, job.foreign_restored, job.foreign_verified) == ({}, set(), False)
    assert job.servable(a)


def test_a_snapshot_with_a_manifest_has_no_foreign_bookkeeping(store: Store) -> None:
    job = _attached(store)
    ref = job.stored_refs[0]
    _bumps(job, ForeignReceived(ref, "http://p1", "p1"), changed=False)
    _bumps(job, ForeignVerified(), changed=False)
    job.apply(Resumed(STORED, [0]))
    assert (job.foreign_senders, job.foreign_restored) == ({}, set())
    assert job.servable(ref) and not job.held_back(ref)


def test_shed_drops_the_foreign_table_and_its_bookkeeping(store: Store) -> None:
    job, _ = _foreign_job(store)
    job.apply(ForeignReceived(job.stored_refs[0], "http://p1", "p1"))
    job.apply(StateChanged("failed", "cancelled"))
    _bumps(job, Shed())
    assert (job.foreign, job.foreign_senders, job.foreign_restored) == (None, {}, set())
    _bumps(job, Shed(), changed=False)


def test_shed_drops_the_download_state_once_and_keeps_the_record(store: Store) -> None:
    job = _attached(store)
    job.apply(StateChanged("downloading"))
    job.apply(ChunkVerified(STORED, job.stored_refs[0]))
    job.apply(StateChanged("failed", "cancelled"))
    before = job.describe()
    _bumps(job, Shed())
    assert (job.manifest, job.stored, job.result, job.stored_refs, job.result_refs) == (None, None, None, (), ())
    after = job.describe()
    assert {k: v for k, v in after.items() if k != "updated_at"} == {
        k: v for k, v in before.items() if k != "updated_at"
    }
    _bumps(job, Shed(), changed=False)


def test_stopping_moves_only_the_version(store: Store) -> None:
    job = _ready(store)
    before = job.describe()
    _bumps(job, Stopping())
    assert {k: v for k, v in job.describe().items() if k != "updated_at"} == {
        k: v for k, v in before.items() if k != "updated_at"
    }


def test_a_value_that_is_not_an_event_is_refused(store: Store) -> None:
    job = SnapshotJob("s", store)
    with pytest.raises(TypeError):
        job.apply("ready")  # type: ignore[arg-type]
    assert job.version == 0


def test_a_record_restored_from_the_store_equals_a_fresh_one_but_for_this_run(store: Store) -> None:
    """The catalog's restore (``Catalog.load_ready_from_store``) uses the same constructor and
    the same events as a download: what differs is only who asked, when, and this run's byte
    counts and stage times."""
    fresh = _ready(store)
    restored = SnapshotJob(fresh.identity, store, requested_by="store", created=fresh.created)
    for event in (
        ManifestAttached.of(_manifest(), "d" * 32),
        LayerComplete(STORED),
        LayerComplete(RESULT),
        StateChanged("ready"),
    ):
        restored.apply(event)
    this_run = {"requested_by", "updated_at", "stages", "bytes_from_bucket", "bytes_from_peers", "bytes_local"}
    a, b = fresh.describe(), restored.describe()
    assert {k: v for k, v in a.items() if k not in this_run} == {k: v for k, v in b.items() if k not in this_run}
    assert restored.stored is not None and restored.stored.complete and restored.result is not None
    assert restored.result.complete and restored.have_map()["stored"] == fresh.have_map()["stored"]
