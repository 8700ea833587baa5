"""The chunk index (bdn/daemon/store/index.py): what it answers, and that its state per chunk is a few
bytes in arrays, not Python objects (issue 12, item 2: "control-plane state per chunk must be
compact")."""

from __future__ import annotations

import gc
import tracemalloc

import pytest

from bdn.daemon.snapshots.events import ManifestAttached, Restarted, StateChanged
from bdn.daemon.snapshots.layers import RESULT, STORED
from bdn.daemon.snapshots.snapshot import SnapshotJob
from bdn.daemon.store.index import ChunkIndex
from bdn.proto.keys import derive_keys
from bdn.proto.manifest import FileEntry, FileResult, Manifest

CS = 4096
KEYS = derive_keys("index-test-secret-0123456789")


def _digest(i: int) -> str:
    return f"{i:032x}"


def _job(identity: str, files: list[list[int]], diff: dict[int, list[int]] | None = None) -> SnapshotJob:
    """A job whose file ``k`` has the chunks of digests ``files[k]`` (``diff[k]``: a diff file
    rebuilding a file of those digests)."""
    entries = []
    for k, ds in enumerate(files):
        result = None
        if diff and k in diff:
            result = FileResult(len(diff[k]) * CS, tuple(_digest(d) for d in diff[k]))
        entries.append(FileEntry(f"f{k}.bin", len(ds) * CS, tuple(_digest(d) for d in ds), result))
    m = Manifest(
        identity=identity,
        kind="delta" if diff else "full",
        policy_version=1,
        chunk_size=CS,
        files=tuple(entries),
        base_identity="base" if diff else None,
    )
    job = SnapshotJob(identity, None)  # type: ignore[arg-type]  (no store: nothing touches files)
    job.apply(ManifestAttached.of(m, ""))
    return job


def _addr(i: int) -> str:
    return KEYS.address(_digest(i))


def test_pending_then_held_then_forgotten() -> None:
    idx = ChunkIndex(KEYS.address)
    job = _job("s1", [[1, 2, 3], [4]])
    job.apply(StateChanged("downloading"))
    idx.add_pending(job, STORED, job.stored_refs)
    pend = idx.pending_for(_addr(4))
    assert pend is not None and pend[0] is job and pend[1] == STORED
    assert (pend[2].file_index, pend[2].index, pend[2].digest) == (1, 0, _digest(4))
    assert idx.fetching(_addr(2)) and idx.lookup(_addr(2)) is None
    assert idx.pending_for(_addr(9)) is None and idx.pending_for("not an address") is None

    idx.register(job, STORED, job.stored_refs[1])
    loc = idx.lookup(_addr(2))
    assert loc is not None and (loc.job, loc.layer, loc.file_index, loc.offset, loc.length) == (job, STORED, 0, CS, CS)
    assert idx.by_content(_digest(2)) == loc
    assert not idx.fetching(_addr(2))  # held now
    idx.drop_pending_of(job)
    assert idx.pending_for(_addr(1)) is None and not idx.fetching(_addr(1))
    assert idx.lookup(_addr(2)) == loc  # held stays held
    idx.forget(job, [job])
    assert idx.lookup(_addr(2)) is None and idx.chunks() == {"positions": 0, "pending": 0, "held": 0}


def test_another_holder_serves_when_one_is_forgotten_or_quarantined_but_not_a_failed_one() -> None:
    idx = ChunkIndex(KEYS.address)
    a, b, c = _job("a", [[1, 2]]), _job("b", [[7, 2]]), _job("c", [[2]])
    for j in (a, b, c):
        j.apply(StateChanged("ready"))
        for ref in j.result_refs:
            idx.register(j, RESULT, ref)
    assert idx.lookup(_addr(2)).job is a  # the first to hold it
    c.apply(StateChanged("failed"))
    idx.quarantine(a, [a.result_refs[1]], [a, b, c])
    loc = idx.lookup(_addr(2))
    assert loc is not None and loc.job is b and loc.offset == CS
    idx.forget(b, [a, b, c])
    assert idx.lookup(_addr(2)) is None  # c failed: its copy is not served
    assert idx.lookup(_addr(1)).job is a


def test_unindex_stops_serving_that_copy() -> None:
    idx = ChunkIndex(KEYS.address)
    a = _job("a", [[5, 6]])
    for ref in a.stored_refs:
        idx.register(a, STORED, ref)
    idx.unindex(_addr(6))
    assert idx.lookup(_addr(6)) is None and idx.lookup(_addr(5)) is not None


def test_repeated_digests() -> None:
    """A chunk repeated in a snapshot (zero pages): pending answers its first place, and a held
    copy is found whichever of its places is held."""
    idx = ChunkIndex(KEYS.address)
    job = _job("z", [[0, 0, 3], [0]])
    idx.add_pending(job, STORED, job.stored_refs)
    assert idx.pending_for(_addr(0))[2].offset == 0 and idx.pending_for(_addr(0))[2].file_index == 0
    idx.register(job, STORED, job.stored_refs[3])  # file 1, chunk 0
    loc = idx.lookup(_addr(0))
    assert loc is not None and (loc.file_index, loc.offset) == (1, 0)
    idx.quarantine(job, [job.stored_refs[3]])
    assert idx.lookup(_addr(0)) is None


def test_the_first_snapshot_listing_a_chunk_answers_pending() -> None:
    idx = ChunkIndex(KEYS.address)
    a, b = _job("a", [[1]]), _job("b", [[9, 1]])
    idx.add_pending(a, STORED, a.stored_refs)
    idx.add_pending(b, STORED, b.stored_refs)
    assert idx.pending_for(_addr(1))[0] is a and idx.pending_for(_addr(9))[0] is b
    idx.drop_pending(a, a.stored_refs)
    assert idx.pending_for(_addr(1))[0] is b  # b still fetches it


def test_a_delta_layers_have_their_own_addresses_and_a_full_one_shares_them() -> None:
    idx = ChunkIndex(KEYS.address)
    d = _job("d", [[40], [41, 42]], diff={0: [50, 51]})
    idx.prepare(d, STORED)
    idx.prepare(d, RESULT)
    idx.register(d, RESULT, d.result_refs[1])  # rebuilt chunk 51
    idx.register(d, STORED, d.stored_refs[0])  # the diff object's chunk 40
    assert idx.lookup(_addr(51)).layer == RESULT and idx.lookup(_addr(40)).layer == STORED
    assert idx.lookup(_addr(50)) is None
    f = _job("f", [[60, 61]])
    idx.prepare(f, STORED)
    idx.prepare(f, RESULT)
    segs = {s.layer: s for s in idx._segments if s.job is f}
    assert segs[STORED].cols is segs[RESULT].cols


def test_a_replaced_table_drops_the_old_layer() -> None:
    """A snapshot without a manifest whose object changed mid-download gets a new table
    (``Restarted``): nothing of the old one is answered."""
    idx = ChunkIndex(KEYS.address)
    job = _job("r", [[1, 2]])
    idx.add_pending(job, STORED, job.stored_refs)
    idx.register(job, STORED, job.stored_refs[0])
    job.apply(Restarted(ManifestAttached.of(_job("r", [[3]]).manifest, "")))
    assert idx.lookup(_addr(1)) is None and idx.pending_for(_addr(2)) is None
    idx.add_pending(job, STORED, job.stored_refs)
    assert idx.pending_for(_addr(3))[0] is job


def test_registering_a_chunk_of_another_layer_is_an_error() -> None:
    idx = ChunkIndex(KEYS.address)
    a, b = _job("a", [[1, 2]]), _job("b", [[3, 4]])
    with pytest.raises(ValueError):
        idx.register(a, STORED, b.stored_refs[1])


# The bound, per chunk, of what the index keeps for a snapshot it is fetching and holds: the
# keyed addresses as two int64 columns (16 B), their positions (uint32, 4 B), the pending and
# held masks (1 B each) = 22 B, plus a few fixed-size objects. Before (a dict entry, an address
# string, a tuple and a ChunkRef per pending chunk, and per held chunk a Loc in two dicts and a
# (layer, ChunkRef) in the job's list) it was ~375 B pending + ~540 B held. The manifest's own
# digest strings (89 B per chunk) are not the index's and are allocated before the measure.
BYTES_PER_CHUNK = 32
N = 200_000


def test_index_state_per_chunk_is_a_few_bytes() -> None:
    job = _job("big", [list(range(k * N // 4, (k + 1) * N // 4)) for k in range(4)])
    job.apply(StateChanged("downloading"))
    idx = ChunkIndex(KEYS.address)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        idx.add_pending(job, STORED, job.stored_refs)
        for ref in job.stored_refs:
            idx.register(job, STORED, ref)
        idx.prepare(job, RESULT)  # a full snapshot's result layer shares the columns
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert idx.chunks() == {"positions": 2 * N, "pending": N, "held": N}
    assert used / N < BYTES_PER_CHUNK, f"{used / N:.1f} bytes per chunk"
    assert idx.lookup(_addr(N - 1)).offset == (N // 4 - 1) * CS


def test_a_parsed_manifest_keeps_16_bytes_per_digest() -> None:
    """The manifest's chunk lists (and a READY marker's) are one bytes block per file, 16 bytes
    per digest, not a tuple of 32-char strings (89 bytes per chunk with the tuple's slot)."""
    import json

    from bdn.proto.chunks import Digests
    from bdn.proto.manifest import Manifest as M

    n = 100_000
    doc = {
        "format": "bdn.snapshot/1",
        "identity": "step000001",
        "kind": "full",
        "policy_version": 1,
        "chunk_size": CS,
        "files": [{"path": "a.bin", "size": n * CS, "chunks": [_digest(i) for i in range(n)]}],
    }
    raw = json.dumps(doc).encode()
    del doc
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        m = M.from_json(raw)
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    chunks = m.files[0].chunks
    assert isinstance(chunks, Digests) and used / n < 20, f"{used / n:.1f} bytes per chunk"
    assert chunks[7] == _digest(7) and chunks[-1] == _digest(n - 1) and list(chunks[2:4]) == [_digest(2), _digest(3)]
    assert chunks == tuple(_digest(i) for i in range(n)) and hash(chunks[:3]) == hash(Digests.of(chunks[:3]))
    assert _digest(5) in chunks and "0" * 31 + "g" not in chunks
    assert json.loads(m.to_json())["files"][0]["chunks"][9] == _digest(9)
