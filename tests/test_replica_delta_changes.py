"""The changed-tensor list from a delta's own streams (bdn/daemon/replica/changes.py, ``from_diffs``).

Real files: a base safetensors shard in a READY directory, a target shard, and the diff file the
publisher writes between them (``bdn.fileops.write_diff_file``, every compression format); the
answer must equal the tensors that differ, byte for byte, and be the same as the READY-directory
comparison's.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from bdn.daemon.replica import changes
from bdn.daemon.replica.changes import ChangedTensorsCache, DeltaSource, from_diffs
from bdn.daemon.store.bitfield import Bitfield
from bdn.fileops import save, write_diff_file
from bdn.proto.arc import COMPRESSION_FORMATS
from bdn.proto.chunks import digest
from bdn.proto.ready import READY_NAME

CHUNK = 64 << 10


def _ready(d: Path, identity: str, tensors: dict[str, np.ndarray]) -> Path:
    d.mkdir(parents=True)
    save(d / "model.safetensors", tensors)
    data = (d / "model.safetensors").read_bytes()
    (d / READY_NAME).write_text(
        json.dumps(
            {
                "format": "bdn.ready/1",
                "identity": identity,
                "policy_version": 1,
                "kind": "full",
                "chunk_size": CHUNK,
                "files": [
                    {
                        "path": "model.safetensors",
                        "size": len(data),
                        "chunks": [digest(data[i : i + CHUNK]) for i in range(0, len(data), CHUNK)],
                    }
                ],
            }
        )
    )
    return d


def _pair(tmp_path: Path, fmt: str) -> tuple[Path, Path, DeltaSource, list[str]]:
    rng = np.random.default_rng(1)
    # small tensors share 64 KiB chunks with their neighbours; "big" spans several chunks
    base = {f"t{i}": rng.normal(size=(40, 40)).astype(np.float32) for i in range(8)}
    base["big"] = rng.normal(size=(300, 300)).astype(np.float32)
    base["zero"] = np.zeros((0,), np.float32)
    target = {k: v.copy() for k, v in base.items()}
    target["t1"][5, 5] += 1.0  # one value: a tiny stream that is not all zeros
    target["t6"] += rng.normal(size=(40, 40)).astype(np.float32)  # every value
    mask = rng.random(base["big"].shape) < 0.02
    target["big"][mask] *= 1.5  # 2 % of the values
    want = ["big", "t1", "t6"]
    bdir = _ready(tmp_path / "base", "step000001", base)
    tdir = tmp_path / "target"
    tdir.mkdir()
    save(tdir / "model.safetensors", target)
    stored = tmp_path / "stored"
    stored.mkdir()
    write_diff_file(bdir / "model.safetensors", tdir / "model.safetensors", stored / "model.safetensors", fmt)
    delta = DeltaSource("step000001", stored, ("model.safetensors",), ("model.safetensors",), fmt)
    return bdir, tdir, delta, want


@pytest.mark.parametrize("fmt", COMPRESSION_FORMATS)
def test_the_delta_streams_name_exactly_the_changed_tensors(tmp_path: Path, fmt: str) -> None:
    bdir, tdir, delta, want = _pair(tmp_path, fmt)
    got = from_diffs(bdir, delta)
    assert got is not None and sorted(got) == want
    # in the target's (the base header's) order, as the READY comparison gives it
    (tdir / READY_NAME).write_text((bdir / READY_NAME).read_text().replace("step000001", "step000002"))
    data = (tdir / "model.safetensors").read_bytes()
    marker = json.loads((tdir / READY_NAME).read_text())
    marker["files"][0].update(size=len(data), chunks=[digest(data[i : i + CHUNK]) for i in range(0, len(data), CHUNK)])
    (tdir / READY_NAME).write_text(json.dumps(marker))
    assert got == changes.compute(bdir, tdir)


def test_a_stream_of_another_base_or_a_whole_shard_gives_no_list(tmp_path: Path) -> None:
    bdir, _tdir, delta, _want = _pair(tmp_path, "arc_v2")
    whole = DeltaSource(
        delta.base,
        delta.stored_dir,
        delta.diff_files,
        ("model.safetensors", "extra.safetensors"),
        delta.compression_format,
    )
    assert from_diffs(bdir, whole) is None  # a tensor file stored whole: the READY comparison decides

    async def run() -> tuple[list[str] | None, list[str] | None]:
        cache = ChangedTensorsCache(lambda ident: bdir)
        cache.start("other-base", "step000002", delta)  # not this delta's base: nothing starts
        assert not cache._running
        cache.start(delta.base, "step000002", delta)  # before READY: from the streams
        early = await cache.between(delta.base, "step000002", delta)
        return early, await cache.between(delta.base, "step000002")

    early, again = asyncio.run(run())
    assert early == again and early is not None and sorted(early) == ["big", "t1", "t6"]


def test_a_corrupt_small_stream_counts_as_changed(tmp_path: Path) -> None:
    assert changes._zero_stream(b"\x28\xb5\x2f\xfd garbage", 1600, "arc_v2") is False
    assert changes._zero_stream(b"not zlib", 1600, "arc_v1") is False
    assert changes._zero_stream(b"BDNP", 1600, "bdn_planes_v1") is False


@pytest.mark.parametrize("fmt", COMPRESSION_FORMATS)
def test_the_changed_ranges_cover_every_changed_byte_and_little_else(tmp_path: Path, fmt: str) -> None:
    bdir, tdir, delta, want = _pair(tmp_path, fmt)
    names = from_diffs(bdir, delta)
    assert names is not None
    got = changes.ranges_from_diffs(bdir, delta, names)
    assert sorted(got) == want
    b = np.frombuffer((bdir / "model.safetensors").read_bytes(), np.uint8)
    t = np.frombuffer((tdir / "model.safetensors").read_bytes(), np.uint8)
    covered = np.zeros(len(b), bool)
    for ranges in got.values():
        assert len(ranges) <= 64
        for lo, hi in ranges:
            covered[lo:hi] = True
    assert not (b != t)[~covered].any()  # no changed byte outside the ranges
    if fmt == "bdn_planes_v1":  # pages, not whole tensors: "big" (360 KB, 2 % changed) is mostly covered,
        layout = changes.layout(bdir)  # t1 (one value changed) by one page
        t1 = got["t1"]
        assert sum(hi - lo for lo, hi in t1) <= 4096 < layout.tensors["t1"].end - layout.tensors["t1"].start


@pytest.mark.parametrize("applied", [True, False])  # the sparse apply gave its ranges; it fell back to a full apply
def test_a_sparse_applys_ranges_are_the_offers_and_the_streams_are_not_decoded_twice(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    applied: bool,
) -> None:
    from bdn.fileops import read_header
    from bdn.proto import arc, sparse

    bdir, tdir, delta, want = _pair(tmp_path, "bdn_planes_v1")
    names = from_diffs(bdir, delta)
    assert names is not None
    expected = changes.ranges_from_diffs(bdir, delta, names)
    # what the daemon's sparse apply computes while it writes the changed words (bdn.daemon.apply.forward)
    buf = np.fromfile(bdir / "model.safetensors", dtype=np.uint8)
    d = np.fromfile(delta.stored_dir / "model.safetensors", dtype=np.uint8)
    _, streams = arc.read_diff_header(d, len(d))
    res = sparse.apply_sparse(buf, read_header(bdir / "model.safetensors"), d, streams)
    assert buf.tobytes() == (tdir / "model.safetensors").read_bytes()

    class Applies:
        def planned(self, identity: str) -> bool:
            return identity == "step000002"

        def ranges(self, identity: str) -> dict[str, list[list[int]]] | None:
            return {n: [[a, b] for a, b in r] for n, r in res.ranges.items()} if applied else None

    decoded: list[str] = []
    real = changes.ranges_from_diffs

    def counted(*a: object) -> dict[str, list[list[int]]]:
        decoded.append("x")
        return real(*a)  # type: ignore[arg-type]

    monkeypatch.setattr(changes, "ranges_from_diffs", counted)

    async def run() -> tuple[list[str] | None, dict[str, object]]:
        cache = ChangedTensorsCache(lambda ident: bdir, sparse=Applies())
        cache.start(delta.base, "step000002", delta)  # while applying: names only
        await asyncio.wait(list(cache._running.values()))
        assert not decoded
        got = await cache.between(delta.base, "step000002", delta)  # at READY
        return got, cache.ranges_of(delta.base, "step000002")

    got, offer = asyncio.run(run())
    assert got is not None and sorted(got) == want
    assert offer == {"changed_ranges": expected}
    assert len(decoded) == (0 if applied else 1)


def test_changed_words_are_offered_only_for_a_verified_planes_delta_on_the_engines_base(tmp_path: Path) -> None:
    """The offer's ``changed_words``: the target's diff files, only when the stored layer is complete,
    every tensor file is a diff at its manifest size, the codec is bdn_planes_v1 and the base is the
    engine's; anything else gives no field (the engine stages)."""
    _bdir, _tdir, delta, _want = _pair(tmp_path, "bdn_planes_v1")
    diff = delta.stored_dir / "model.safetensors"
    size = diff.stat().st_size
    done = Bitfield(3)
    done.set_all()
    m = SimpleNamespace(files=[SimpleNamespace(path="model.safetensors", size=size, is_diff=True)])
    job = SimpleNamespace(stored=done, manifest=m)
    got = changes.changed_words(delta, "step000001", job)
    assert got == {
        "changed_words": {"codec": "bdn_planes_v1", "base": "step000001", "files": {"model.safetensors": str(diff)}}
    }
    assert changes.changed_words(delta, "step000009", job) == {}  # the engine serves another snapshot
    assert changes.changed_words(None, "step000001", job) == {}  # not a delta with its diffs here
    partial = Bitfield(3)
    partial.set(0)
    assert changes.changed_words(delta, "step000001", SimpleNamespace(stored=partial, manifest=m)) == {}  # unverified
    short = SimpleNamespace(files=[SimpleNamespace(path="model.safetensors", size=size + 1, is_diff=True)])
    assert changes.changed_words(delta, "step000001", SimpleNamespace(stored=done, manifest=short)) == {}
    arc = DeltaSource(delta.base, delta.stored_dir, delta.diff_files, delta.tensor_files, "arc_v2")
    assert changes.changed_words(arc, "step000001", job) == {}  # another codec
    whole = DeltaSource(
        delta.base, delta.stored_dir, delta.diff_files, ("model.safetensors", "extra.safetensors"), "bdn_planes_v1"
    )
    assert changes.changed_words(whole, "step000001", job) == {}  # a tensor file stored whole
    diff.unlink()
    assert changes.changed_words(delta, "step000001", job) == {}  # the file is gone
