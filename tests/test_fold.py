"""Delta folding (bdn/daemon/apply/fold.py): a chain of diffs applied in place on one copy of the
ancestor gives the bytes of applying them one by one, checks every diff's Adler-32, and a daemon
that lags several deltas behind rebuilds the target without a ready snapshot per step."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from typing import Any

import pytest

from bdn import fileops
from bdn.bucket import open_bucket
from bdn.daemon.apply.fold import Folder, fold_file, plan_fold
from bdn.daemon.config import Config
from bdn.daemon.fetch.bucketio import BucketIO
from bdn.daemon.fetch.ratelimit import RateLimit
from bdn.daemon.observe.stats import Stats
from bdn.daemon.process.executors import Executors
from bdn.fileops import read_header, save_raw
from bdn.proto.errors import ChecksumError
from bdn.proto.manifest import MANIFEST_NAME, Manifest
from support.chains import chain_states, daemon_on_anchor, file_chain, write_chain

CHUNK = 64 << 10
SHARD = "model-00001-of-00002.safetensors"


def _chain_files(tmp_path: Path, fmt: str, k: int) -> tuple[list[Path], list[Path]]:
    """``k + 1`` checkpoint dirs and the ``k`` diff files of SHARD between them."""
    dirs = write_chain(tmp_path / "ck", chain_states(k))
    diffs = []
    for i in range(1, k + 1):
        d = tmp_path / f"d{i}" / SHARD
        d.parent.mkdir()
        fileops.write_diff_file(dirs[i - 1] / SHARD, dirs[i] / SHARD, d, fmt)
        diffs.append(d)
    return dirs, diffs


@pytest.mark.parametrize("fmt", ["arc_v1", "arc_v2", "bdn_planes_v1"])
def test_fold_is_bit_identical_to_one_by_one(tmp_path: Path, fmt: str) -> None:
    dirs, diffs = _chain_files(tmp_path, fmt, 4)
    size = (dirs[0] / SHARD).stat().st_size
    prev = dirs[0] / SHARD
    for i, d in enumerate(diffs, 1):  # one by one, each into its own file
        out = tmp_path / f"one{i}"
        fileops.apply_delta_file(prev, d, out, fmt, size, workers=2)
        prev = out
    folded = tmp_path / "fold" / SHARD
    fold_file(dirs[0] / SHARD, [(d, fmt) for d in diffs], folded, size, workers=2)
    assert folded.read_bytes() == prev.read_bytes() == (dirs[-1] / SHARD).read_bytes()
    assert (dirs[0] / SHARD).read_bytes() != folded.read_bytes()  # the ancestor is left as it was


def test_fold_checks_every_diffs_adler32_and_names_the_step(tmp_path: Path) -> None:
    dirs, diffs = _chain_files(tmp_path, "arc_v2", 3)
    # Corrupt the middle diff's Adler-32 of one tensor (its frame left alone): only the check of
    # the intermediate catches it, since the last diff's own checksums still hold.
    h = read_header(diffs[1])
    raw = diffs[1].read_bytes()
    victim = sorted(h.tensors)[0]
    meta = dict(h.metadata)
    meta[victim] = str((int(meta[victim]) + 1) % (1 << 32))
    save_raw(diffs[1], {n: ("U8", (t.end - t.start,), raw[t.start : t.end]) for n, t in h.tensors.items()}, meta)
    size = (dirs[0] / SHARD).stat().st_size
    with pytest.raises(ChecksumError, match=rf"^{SHARD}: delta 2 of 3 \(d2\): adler32 mismatch for tensor '{victim}'"):
        fold_file(dirs[0] / SHARD, [(d, "arc_v2") for d in diffs], tmp_path / "o", size, name=SHARD)


def _m(identity: str, base: str | None, files: list[dict[str, Any]]) -> Manifest:
    doc: dict[str, Any] = {
        "format": "bdn.snapshot/1",
        "identity": identity,
        "kind": "delta" if base else "full",
        "policy_version": 1,
        "created_at": "",
        "chunk_size": CHUNK,
        "files": files,
    }
    if base:
        doc.update(base_identity=base, compression_format="arc_v2", checksum_format="alder32")
    return Manifest.from_dict(doc)


def _diff(path: str, rsize: int) -> dict[str, Any]:
    return {"path": path, "size": 10, "chunks": ["0" * 32], "result": {"size": rsize, "chunks": ["1" * 32]}}


def test_plan_fold_rules() -> None:
    full = _m("a", None, [{"path": "m.safetensors", "size": 10, "chunks": ["0" * 32]}])
    d1, d2 = _m("b", "a", [_diff("m.safetensors", 100)]), _m("c", "b", [_diff("m.safetensors", 100)])
    assert plan_fold([d1, d2]) is None
    assert plan_fold([d2]) == "fewer than two deltas"
    assert plan_fold([full, d1]) == "'a' is not a delta"
    assert plan_fold([d2, d1]) == "'b' is not built on 'c'"
    other = _m("b", "a", [_diff("n.safetensors", 100)])
    assert plan_fold([other, d2]) == "'b' has no 'm.safetensors'"
    resized = _m("b", "a", [_diff("m.safetensors", 99)])
    assert "not a diff of the same size" in (plan_fold([resized, d2]) or "")


def test_daemon_folds_a_lagging_chain_without_intermediate_snapshots(tmp_path: Path) -> None:
    chain = file_chain(tmp_path, 4, chunk_size=CHUNK, scale=2, formats={3: "bdn_planes_v1"})
    with daemon_on_anchor(tmp_path, chain.url) as d:
        assert d.prefetch("step000005")[0] == 202
        snap = d.wait_ready("step000005")
        got = Path(snap["path"])
        for f in chain.dirs[-1].iterdir():
            assert hashlib.sha256((got / f.name).read_bytes()).digest() == hashlib.sha256(f.read_bytes()).digest(), (
                f.name
            )
        for i in (2, 3, 4):  # folded through: never a snapshot on this node
            assert d.request("GET", f"/v1/snapshots/step{i:06d}")[0] == 404
        assert not [p for p in d.store.rglob("*") if "step000003" in p.name or ".fold-" in p.name]  # cleaned up
        assert "folding 4 deltas on step000001" in d.log()


class _NoJobs:
    """A catalog that knows no snapshot (the chain walk then reads every manifest down the chain)."""

    def get(self, identity: str) -> None:
        return None

    def all(self) -> list[Any]:
        return []

    def prefetch(self, identity: str, requested_by: str = "local") -> Any:
        raise AssertionError("the chain walk prefetches nothing")


def test_a_job_started_during_the_chain_walks_manifest_read_takes_that_read(tmp_path: Path) -> None:
    """A job of ``step000002`` started (by a peer's hint) while the chain walk under
    ``step000003`` reads ``step000002``'s manifest waits for that read instead of a second GET
    (tests/test_swarm.py::test_s3_bucket_no_stored_byte_fetched_twice saw 4 GETs for 3 daemons
    under load); a walk whose read failed leaves nothing to take (the job reads and reports)."""
    chain = file_chain(tmp_path, 2, chunk_size=CHUNK)
    bucket = open_bucket(chain.url)
    pools = Executors.create(4)
    m3 = Manifest.from_json((chain.bucket / "step000003" / MANIFEST_NAME).read_bytes())

    async def run() -> None:
        io = BucketIO(bucket, chain.url, 4, RateLimit(0), pools.bucket, Stats())
        folder = Folder(Config(), None, io, None, None, pools)  # type: ignore[arg-type]  # the walk reads manifests only
        walk = asyncio.ensure_future(folder.chain(m3, _NoJobs()))
        await asyncio.sleep(0)  # the walk's first step: its read of step000002's manifest is in flight
        assert bucket.stats.get_requests <= 1
        got = await folder.take_recent("step000002")
        assert got is not None and got[1].identity == "step000002"
        found = await walk
        assert found is not None and [c.identity for c in found[1]] == ["step000002", "step000003"]
        assert bucket.stats.get_requests == 2  # step000002's and step000001's manifests, once each
        assert await folder.take_recent("step000002") is None  # taken once

        (chain.bucket / "step000002" / MANIFEST_NAME).unlink()
        walk = asyncio.ensure_future(folder.chain(m3, _NoJobs()))
        await asyncio.sleep(0)
        assert await folder.take_recent("step000002") is None
        assert await walk is None  # the walk gives up on folding; the job reads and reports itself

    try:
        asyncio.run(run())
    finally:
        pools.shutdown()
        bucket.close()
