"""The page pool (``bdn.daemon.store.spares``, issue 9) through a real bdnd: GC keeps the files of a
collected snapshot that no process maps or holds open as spares, and the next snapshot's files
are those spares renamed and truncated, their bytes received and verified like any other.

Promises checked: a file a process maps is never recycled (its bytes stay the old snapshot's
while the next ones load); a recycled file's snapshot is byte-identical to the trainer's and
passes ``verify()``; spares count in ``shm_budget_bytes``; ``shm_spare_bytes=0`` turns the pool off.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest

from bdn.client import open_snapshot
from bdn.proto.keys import derive_keys
from bdn.proto.manifest import Manifest
from support.checkpoints import publish_state
from support.faults import stable_ports
from support.swarm import SECRET, Daemon

CHUNK = 64 << 10
SWARM_ID = derive_keys(SECRET).swarm_id
BASE_ENV = {"BDN_LOAD_STARTUP": "false", "BDN_STARTUP_SETTLE_S": "2", "BDN_KEEP_READY": "1", "BDN_GC_GRACE_S": "0"}
SHARD = "model-00001-of-00002.safetensors"

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def file_bucket(tmp_path: Path) -> str:
    (tmp_path / "bucket").mkdir()
    return f"file://{tmp_path}/bucket"


def publish(tmp_path: Path, bucket: str, identity: str, version: int) -> tuple[Manifest, Path]:
    return publish_state(tmp_path, bucket, identity, version, scale=2, chunk_size=CHUNK)


def daemon(tmp_path: Path, bucket: str, **env: str) -> Daemon:
    return stable_ports(Daemon(tmp_path / "nodes", "node0", bucket, extra_env=dict(BASE_ENV, **env)))


def root(d: Daemon) -> Path:
    return d.shm_dir / SWARM_ID


def inodes(directory: Path) -> dict[int, str]:
    return {p.stat().st_ino: p.name for p in directory.iterdir() if p.is_file()}


def load(d: Daemon, identity: str, trainer: Path) -> Path:
    assert d.prefetch(identity)[0] in (200, 202)
    d.wait_ready(identity, 120)
    path = root(d) / identity
    for p in trainer.iterdir():
        assert (path / p.name).read_bytes() == p.read_bytes(), p.name
    with open_snapshot(path) as s:
        s.verify()
    return path


def collect(d: Daemon, identity: str) -> None:
    """GC (the daemon may have run it on its own when the newer snapshot became ready)."""
    status, body = d.request("POST", "/v1/gc")
    assert status == 200, body
    assert not (root(d) / identity).exists(), body


def allocated(directory: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in directory.rglob("*") if p.is_file())


def test_mapped_file_never_recycled_and_recycled_files_verified(tmp_path: Path, file_bucket: str) -> None:
    snaps = {i: publish(tmp_path, file_bucket, f"step00000{i}", i) for i in (1, 2, 3)}
    # (no seed: every spare here must be a file of a collected snapshot)
    d = daemon(tmp_path, file_bucket, BDN_SPARSE_SEED_MBIT="0")
    d.start([])
    try:
        d.wait_healthy()
        p1 = load(d, "step000001", snaps[1][1])
        old = inodes(p1)
        want = (p1 / SHARD).read_bytes()
        # a serving process maps one shard of step000001 (and closes its descriptor)
        with open(p1 / SHARD, "rb") as fh:
            mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        mapped_ino = os.stat(p1 / SHARD).st_ino
        try:
            load(d, "step000002", snaps[2][1])
            collect(d, "step000001")
            spares = inodes(root(d) / ".spares")
            assert spares, "no file of the collected snapshot was kept as a spare"
            assert mapped_ino not in spares, "a mapped file became a spare"
            assert set(spares) <= set(old), (spares, old)
            # the next snapshot lands in the spares: same inodes, new verified bytes
            p3 = load(d, "step000003", snaps[3][1])
            reused = set(inodes(p3)) & set(spares)
            assert reused, "step000003 allocated fresh files while spares were there"
            assert mapped[:] == want, "the mapped file's bytes changed"
            st = d.get("/v1/snapshots/step000003")
            assert st["state"] == "ready", st
        finally:
            mapped.close()
    finally:
        d.stop()


def test_spares_count_in_the_budget_and_can_be_turned_off(tmp_path: Path, file_bucket: str) -> None:
    snaps = {i: publish(tmp_path, file_bucket, f"step00000{i}", i) for i in (1, 2, 3)}
    need = snaps[1][0].result_bytes  # what the store counts for a full snapshot
    budget = int(need * 2.5)  # two snapshots fit, plus half of one as spares
    d = daemon(tmp_path, file_bucket, BDN_SHM_BUDGET_BYTES=str(budget))
    d.start([])
    try:
        d.wait_healthy()
        load(d, "step000001", snaps[1][1])
        load(d, "step000002", snaps[2][1])
        collect(d, "step000001")
        spares = allocated(root(d) / ".spares")
        assert 0 < spares <= budget - need, (spares, budget, need)
        assert allocated(root(d)) <= budget + (64 << 10), (allocated(root(d)), budget)
        load(d, "step000003", snaps[3][1])
        assert allocated(root(d)) <= budget + (64 << 10), (allocated(root(d)), budget)
    finally:
        d.stop()
    off = stable_ports(
        Daemon(tmp_path / "nodes-off", "node1", file_bucket, extra_env=dict(BASE_ENV, BDN_SHM_SPARE_BYTES="0"))
    )
    off.start([])
    try:
        off.wait_healthy()
        load(off, "step000001", snaps[1][1])
        load(off, "step000002", snaps[2][1])
        collect(off, "step000001")
        assert list((root(off) / ".spares").iterdir()) == []
        load(off, "step000003", snaps[3][1])
    finally:
        off.stop()


def test_a_restart_with_the_same_pid_never_leaves_an_old_tag_on_other_bytes(tmp_path: Path) -> None:
    """Spare names are ``<pid>-<n>``, n counting from 0 in each pool: a daemon restarted with the
    same pid (PID 1 in a container) reuses names. An untagged file recycled under a name that
    still has a tag must not inherit it: the tag describes other bytes."""
    from bdn.daemon.store.spares import Spares

    root = tmp_path / "store"
    root.mkdir()
    for name, fill, tags in (
        ("one", b"X", {"model.safetensors": {"path": "model.safetensors", "size": 8192}}),
        ("two", b"Y", {}),
    ):
        d = tmp_path / name
        d.mkdir()
        (d / "model.safetensors").write_bytes(fill * 8192)
        Spares(root).absorb(d, tags)  # a new pool each time: the restart, same pid
    got = Spares(root).take_tagged("model.safetensors", 8192, tmp_path / "out", lambda t: True)
    assert got is None or (tmp_path / "out").read_bytes() == b"X" * 8192, "a tag over another file's bytes"


def test_the_lease_probe_says_in_use_while_a_descriptor_or_a_mapping_holds_the_file(tmp_path: Path) -> None:
    """``spares.unused``: what the background catch-up waits on before GC (an engine closes the
    snapshot it swapped away from only after its ack)."""
    from bdn.daemon.store.spares import unused

    p = tmp_path / "f"
    p.write_bytes(b"x" * 8192)
    assert unused(p)
    fd = os.open(p, os.O_RDONLY)
    try:
        assert not unused(p)  # an open descriptor (this process's too)
        m = mmap.mmap(fd, 8192, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    assert not unused(p)  # a mapping keeps its file description after close
    m.close()
    assert unused(p)
    assert not unused(tmp_path / "gone")


def _shm_dir(tmp_path: Path) -> Path:
    """A directory on tmpfs (/dev/shm), where holes and allocated pages are the daemon's case."""
    import tempfile

    return Path(tempfile.mkdtemp(prefix="bdn-test-pool-", dir="/dev/shm" if os.path.isdir("/dev/shm") else tmp_path))


def test_a_tagged_spare_with_a_hole_is_not_taken_as_a_buffer(tmp_path: Path) -> None:
    """A buffer brought forward sparsely keeps every byte it does not write: a page freed behind
    the daemon (a truncation or a punched hole, then the size restored) would read as zeros, not
    as the tag's snapshot, so ``take_tagged`` refuses a spare whose blocks do not cover its size
    (``room.allocated``); the same spare whole is taken."""
    import shutil

    from bdn.daemon.store.spares import Spares

    base = _shm_dir(tmp_path)
    try:
        (base / "store").mkdir()
        pool = Spares(base / "store", limit=1 << 30)  # (-1 would keep only the largest batch)
        size = 1 << 20
        tag = {"path": "model.safetensors", "size": size}
        for name in ("holed", "whole"):
            d = base / name
            d.mkdir()
            (d / "model.safetensors").write_bytes(b"W" * size)
            if name == "holed":
                os.truncate(d / "model.safetensors", size // 2)  # pages freed behind the daemon
                os.truncate(d / "model.safetensors", size)  # size back, a hole where they were
            pool.absorb(d, {"model.safetensors": dict(tag, name=name)})
        got = pool.take_tagged("model.safetensors", size, base / "out", lambda t: True)
        assert got is not None and got["name"] == "whole"
        assert (base / "out").read_bytes() == b"W" * size
        assert pool.take_tagged("model.safetensors", size, base / "out2", lambda t: True) is None
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_grow_allocates_a_sparse_file_and_keeps_an_allocated_one_as_it_is(tmp_path: Path) -> None:
    """``room.grow``: a new or sparse file gets its blocks (``posix_fallocate``); a file whose
    blocks already cover the size (a recycled spare) is truncated only, its bytes kept."""
    import shutil

    from bdn.daemon.store.room import allocated, grow

    base = _shm_dir(tmp_path)
    try:
        fresh = base / "fresh"
        grow(fresh, 1 << 20)
        assert fresh.stat().st_size == 1 << 20 and allocated(fresh.stat())
        sparse = base / "sparse"
        sparse.write_bytes(b"")
        os.truncate(sparse, 1 << 20)
        assert not allocated(sparse.stat())
        grow(sparse, 1 << 20)
        assert allocated(sparse.stat())
        kept = base / "kept"
        kept.write_bytes(b"K" * (1 << 20))
        grow(kept, 1 << 20)
        assert kept.read_bytes() == b"K" * (1 << 20) and allocated(kept.stat())
    finally:
        shutil.rmtree(base, ignore_errors=True)
