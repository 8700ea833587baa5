"""Sharded publish (bdn.publish.publish_part / commit_step): ranks as real processes, a real bdnd
rebuilding what they published, file:// and a real moto S3 server, and every bad input refused
with one error and nothing visible."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load, load_file

from bdn.bucket import open_bucket
from bdn.fileops import apply_delta_file, save
from bdn.proto.errors import ChecksumError, TensorMismatch
from bdn.proto.manifest import MANIFEST_NAME, FileEntry, Manifest
from bdn.proto.parts import PartError, PartRecord, part_key
from bdn.publish import PublishError, commit_step, publish_part
from bdn.publish.layout import INDEX_NAME, REST_FILE, layer_file
from support.checkpoints import BF16
from support.ranks import CHUNK, model, owned, run_ranks
from support.swarm import Daemon
from tests.support.s3server import create_bucket

CONFIG = {"config.json": b'{"model_type": "llama"}\n'}


def _publish(url: str, identity: str, version: int, world: int, base: str | None = None) -> Manifest:
    """Every rank as its own process, then the commit."""
    procs = run_ranks(url, identity, version, world, base)
    for p in procs:
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0, out
    return commit_step(url, identity, version, world_size=world, extra_files=CONFIG)


def _files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and p.name != "READY"
    }


def test_four_ranks_and_one_rank_rebuild_identical_snapshots_on_a_daemon(tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    url = f"file://{bucket}"

    def chain(prefix: str, world: int) -> Manifest:
        _publish(url, f"{prefix}000001", 1, world)
        return _publish(url, f"{prefix}000002", 2, world, base=f"{prefix}000001")

    # the one-rank and the four-rank steps publish side by side (each rank its own process)
    with ThreadPoolExecutor(2) as pool:
        one_chain = pool.submit(chain, "one", 1)
        m = chain("four", 4)
        one_chain.result()
    assert m.kind == "delta" and m.compression_format == "bdn_planes_v1"
    assert sorted(f.path for f in m.files) == sorted(
        ["config.json", INDEX_NAME, REST_FILE, *(f"model.layers.{i}.safetensors" for i in range(4))]
    )
    d = Daemon(tmp_path / "work", "node0", url, extra_env={"BDN_LOAD_STARTUP": "false"})
    d.start([])
    try:
        d.wait_healthy()
        for ident in ("one000002", "four000002"):
            assert d.prefetch(ident)[0] == 202
            d.wait_ready(ident)
        one, four = _files(d.store / "one000002"), _files(d.store / "four000002")
    finally:
        d.stop()
    assert one == four
    # ... and they are the trainer's step 2, as save() lays each layer out, whole and loadable.
    want = model(2)
    for i in range(4):
        layer = {n: a for n, a in want.items() if layer_file(n) == f"model.layers.{i}.safetensors"}
        save(tmp_path / "want.safetensors", layer, {"format": "pt"})
        assert four[f"model.layers.{i}.safetensors"] == (tmp_path / "want.safetensors").read_bytes()
    index = json.loads(four[INDEX_NAME])
    assert set(index["weight_map"]) == set(want)
    loaded = load_file(str(d.store / "four000002" / REST_FILE))
    assert np.array_equal(loaded["model.norm.weight"], want["model.norm.weight"])


def test_s3_two_ranks_full_and_delta_rebuild_the_target(moto_endpoint: str, tmp_path: Path) -> None:
    url = f"s3://{create_bucket(moto_endpoint)}/run1"
    with open_bucket(url, endpoint_url=moto_endpoint) as b:
        for r in range(2):
            publish_part(b, "s1", owned(model(1), r, 2), rank=r, world_size=2, chunk_size=CHUNK)
        m1 = commit_step(b, "s1", 1, world_size=2, extra_files=CONFIG)
        for r in range(2):
            publish_part(
                b,
                "s2",
                owned(model(2), r, 2),
                rank=r,
                world_size=2,
                base="s1",
                base_tensors=owned(model(1), r, 2),
                chunk_size=CHUNK,
                compression_format="arc_v2",
            )
        m2 = commit_step(b, "s2", 2, world_size=2, extra_files=CONFIG)
        assert Manifest.from_json(b.read(f"s2/{MANIFEST_NAME}"), expect_identity="s2") == m2
        path = "model.layers.1.safetensors"
        for ident, name in (("s1", "base"), ("s2", "diff")):
            (tmp_path / name).write_bytes(b.read(f"{ident}/{path}"))
    apply_delta_file(tmp_path / "base", tmp_path / "diff", tmp_path / "out", "arc_v2", m2.file(path).result_size)
    layer = {n: a for n, a in model(2).items() if layer_file(n) == path}
    save(tmp_path / "want", layer, {"format": "pt"})
    assert (tmp_path / "out").read_bytes() == (tmp_path / "want").read_bytes()
    assert m1.file(path).chunks == m2.file(path).result_chunks or m2.file(path).result_size == m1.file(path).size


@pytest.fixture
def url(tmp_path: Path) -> str:
    (tmp_path / "bucket").mkdir()
    return f"file://{tmp_path / 'bucket'}"


def _nothing_published(url: str, identity: str) -> None:
    assert not (Path(url.removeprefix("file://")) / identity / MANIFEST_NAME).exists()


def test_a_rank_that_dies_leaves_a_step_that_never_loads_and_later_steps_publish(url: str) -> None:
    procs = run_ranks(url, "s1", 1, 4)
    procs[2].kill()  # rank 2 dies before (or while) it publishes
    for p in procs:
        p.communicate(timeout=600)
    if procs[2].returncode == 0:  # it finished before the kill landed: take its part away
        (Path(url.removeprefix("file://")) / part_key("s1", 2, 4)).unlink()
    with pytest.raises(PartError, match=r"the part of rank 2 of 4 is not in the bucket.*nothing was published"):
        commit_step(url, "s1", 1, world_size=4)
    _nothing_published(url, "s1")
    m = _publish(url, "s2", 1, 4)
    assert m.identity == "s2" and m.kind == "full"


def test_commit_waits_for_a_late_part(url: str) -> None:
    for r in range(2):
        publish_part(url, "s1", owned(model(1), r, 2), rank=r, world_size=2, chunk_size=CHUNK)
    assert commit_step(url, "s1", 1, world_size=2, wait_s=5).kind == "full"


def test_a_commit_waiting_for_parts_never_overwrites_a_step_committed_meanwhile(url: str) -> None:
    """Commit B waits for a late part; commit A of the same step lands first. B must refuse
    before it writes anything: its config.json over A's would break A's published step."""
    import threading

    publish_part(url, "s1", owned(model(1), 0, 2), rank=0, world_size=2, chunk_size=CHUNK)
    errors: list[BaseException] = []

    def commit_b() -> None:
        try:
            commit_step(url, "s1", 1, world_size=2, extra_files={"config.json": b'{"from": "B"}'}, wait_s=120)
        except BaseException as e:
            errors.append(e)

    b = threading.Thread(target=commit_b)
    b.start()
    publish_part(url, "s1", owned(model(1), 1, 2), rank=1, world_size=2, chunk_size=CHUNK)
    try:
        commit_step(url, "s1", 1, world_size=2, extra_files={"config.json": b'{"from": "A"}'})
        winner = b'{"from": "A"}'
    except PublishError as e:  # B saw the late part first and committed: then A is the refused one
        errors.append(e)
        winner = b'{"from": "B"}'
    b.join(300)
    assert not b.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], PublishError), errors
    with open_bucket(url) as bucket:
        assert bucket.read("s1/config.json") == winner  # the published step's own config, not the loser's


def test_a_commit_held_by_a_live_publisher_is_refused_and_a_dead_ones_claim_taken_over(url: str) -> None:
    """The step's claim (``.bdn-parts/<id>/commit.json``) names its holder: while that process
    runs, another commit is refused naming it and writes nothing; once it has exited (it died
    mid-commit on this host), the next commit takes the claim over and publishes."""
    import socket
    import subprocess
    import sys

    from bdn.publish.commit import claim_key

    publish_part(url, "s1", owned(model(1), 0, 1), rank=0, world_size=1, chunk_size=CHUNK)
    holder = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        claim = {"host": socket.gethostname(), "pid": holder.pid, "started": "2026-12-07T04:00:00Z"}
        with open_bucket(url) as bucket:
            bucket.write(claim_key("s1"), json.dumps(claim).encode())
        with pytest.raises(PublishError, match=rf"being committed by another publisher \(.* pid {holder.pid}"):
            commit_step(url, "s1", 1, world_size=1, extra_files={"config.json": b"{}"})
        _nothing_published(url, "s1")
        assert not (Path(url.removeprefix("file://")) / "s1" / "config.json").exists()
    finally:
        holder.communicate(b"", timeout=60)  # the holder exits: its claim is now a dead process's
    manifest = commit_step(url, "s1", 1, world_size=1, extra_files={"config.json": b"{}"})
    assert manifest.identity == "s1"
    with open_bucket(url) as bucket:
        assert json.loads(bucket.read(claim_key("s1")))["pid"] != holder.pid


def test_a_tensor_published_by_two_ranks_is_refused(url: str) -> None:
    state = model(1)
    publish_part(url, "s1", owned(state, 0, 2), rank=0, world_size=2, chunk_size=CHUNK, file_of=layer_file)
    mine = owned(state, 1, 2)
    stolen = "model.layers.0.mlp.up_proj.weight"  # rank 0's
    publish_part(
        url,
        "s1",
        {**mine, stolen: state[stolen]},
        rank=1,
        world_size=2,
        chunk_size=CHUNK,
        file_of=lambda n: "stolen.safetensors" if n == stolen else layer_file(n),
    )
    with pytest.raises(PartError, match=rf"tensor '{stolen}' is published by rank 0 and rank 1"):
        commit_step(url, "s1", 1, world_size=2)
    _nothing_published(url, "s1")


def test_a_file_split_over_two_ranks_is_refused(url: str) -> None:
    state = model(1)
    a = {n: x for n, x in state.items() if "layers.0." in n}
    names = sorted(a)
    publish_part(url, "s1", {names[0]: a[names[0]]}, rank=0, world_size=2, chunk_size=CHUNK)
    publish_part(url, "s1", {n: a[n] for n in names[1:]}, rank=1, world_size=2, chunk_size=CHUNK)
    with pytest.raises(PartError, match=r"file 'model.layers.0.safetensors' is written by rank 0 and rank 1"):
        commit_step(url, "s1", 1, world_size=2)
    _nothing_published(url, "s1")


def test_a_rank_publishing_its_part_twice_is_refused(url: str) -> None:
    publish_part(url, "s1", owned(model(1), 0, 1), rank=0, world_size=1, chunk_size=CHUNK)
    with pytest.raises(PublishError, match=r"rank 0 of 1 already stored its part of step 's1'"):
        publish_part(url, "s1", owned(model(1), 0, 1), rank=0, world_size=1, chunk_size=CHUNK)
    commit_step(url, "s1", 1, world_size=1)
    with pytest.raises(PublishError, match="already published"):
        publish_part(url, "s1", owned(model(1), 0, 1), rank=0, world_size=1, chunk_size=CHUNK, overwrite=False)


def test_ranks_that_disagree_are_refused(url: str) -> None:
    state = model(1)
    publish_part(url, "s1", owned(state, 0, 2), rank=0, world_size=2, chunk_size=CHUNK)
    publish_part(url, "s1", owned(state, 1, 2), rank=1, world_size=2, chunk_size=2 * CHUNK)
    with pytest.raises(PartError, match=r"ranks disagree on chunk_size: 16384 on rank 0, 32768 on rank 1"):
        commit_step(url, "s1", 1, world_size=2)
    publish_part(url, "s2", owned(state, 0, 2), rank=0, world_size=2, chunk_size=CHUNK)
    with pytest.raises(PartError, match=r"world size of 3, but the bucket holds part-00000-of-00002.json"):
        commit_step(url, "s2", 1, world_size=3)
    _nothing_published(url, "s1")
    _nothing_published(url, "s2")


def test_delta_with_mismatched_shapes_or_wrong_base_is_refused(url: str) -> None:
    for r in range(2):
        publish_part(url, "s1", owned(model(1), r, 2), rank=r, world_size=2, chunk_size=CHUNK)
    commit_step(url, "s1", 1, world_size=2)
    tgt, base = owned(model(2), 0, 2), owned(model(1), 0, 2)
    name = "model.layers.0.mlp.up_proj.weight"
    bad = {**tgt, name: tgt[name][:-1]}
    with pytest.raises(
        TensorMismatch,
        match=rf"model.layers.0.safetensors: tensor '{name}': shape \[192, 48\] in the base, \[191, 48\] in the target",
    ):
        publish_part(url, "s2", bad, rank=0, world_size=2, base="s1", base_tensors=base, chunk_size=CHUNK)
    with pytest.raises(
        ChecksumError, match=r"model.layers.0.safetensors: base_tensors are not what base snapshot 's1'"
    ):
        publish_part(url, "s2", tgt, rank=0, world_size=2, base="s1", base_tensors=tgt, chunk_size=CHUNK)
    # Rank 1 never publishes; rank 0's valid part alone cannot be committed.
    publish_part(url, "s2", tgt, rank=0, world_size=2, base="s1", base_tensors=base, chunk_size=CHUNK)
    with pytest.raises(PartError, match="the part of rank 1 of 2 is not in the bucket"):
        commit_step(url, "s2", 2, world_size=2)
    _nothing_published(url, "s2")


def test_bad_arguments_are_refused_before_any_upload(url: str) -> None:
    state = owned(model(1), 0, 1)
    with pytest.raises(PublishError, match=r"rank must be an integer in \[0, 2\), got 2"):
        publish_part(url, "s1", state, rank=2, world_size=2)
    with pytest.raises(PublishError, match="rank 0 has no tensors"):
        publish_part(url, "s1", {}, rank=0, world_size=1)
    with pytest.raises(PublishError, match="'x' is a list, not a numpy array or a torch tensor"):
        publish_part(url, "s1", {"x": [1, 2]}, rank=0, world_size=1)
    with pytest.raises(PublishError, match=r"file_of\('model.embed_tokens.weight'\) gave 'norm.bin'"):
        publish_part(url, "s1", state, rank=0, world_size=1, file_of=lambda n: "norm.bin")
    with pytest.raises(PublishError, match="a delta part needs base_tensors"):
        publish_part(url, "s1", state, rank=0, world_size=1, base="s0")
    assert not any(Path(url.removeprefix("file://")).rglob("*"))


def test_part_records_from_the_bucket_are_checked() -> None:
    good = PartRecord(
        "s1", 0, 1, "full", CHUNK, (FileEntry("a.safetensors", 0, ()),), {"t": ("a.safetensors", "BF16", (0,))}
    )
    assert PartRecord.from_json(good.to_json(), where="k") == good
    obj = json.loads(good.to_json())
    for edit, msg in (
        (lambda o: o.update(rank=3), "rank 3 of world size 1 is out of range"),
        (lambda o: o.update(format="x"), "not a bdn.part/1 part record"),
        (lambda o: o.update(tensors={"t": ["nofile.safetensors", "BF16", [2]]}), "tensor 't' is not"),
        (lambda o: o.pop("files"), "part record has no 'files'"),
        (lambda o: o.update(chunk_size=3), "k: "),
    ):
        o = json.loads(json.dumps(obj))
        edit(o)
        with pytest.raises(PartError, match=msg):
            PartRecord.from_json(json.dumps(o).encode(), where="k")
    with pytest.raises(PartError, match="not JSON"):
        PartRecord.from_json(b"{", where="k")


def test_s3_large_file_goes_up_in_parts_straight_from_memory(moto_endpoint: str) -> None:
    url = f"s3://{create_bucket(moto_endpoint)}/run1"
    big = np.random.default_rng(3).normal(0, 0.02, (6 << 20,)).astype(np.float32).view(np.uint8)[: 12 << 20]
    state = {"model.layers.0.w": big.view(np.float16).reshape(-1, 1024)}
    with open_bucket(url, endpoint_url=moto_endpoint, multipart_threshold=5 << 20, multipart_chunksize=5 << 20) as b:
        rec = publish_part(b, "s1", state, rank=0, world_size=1)
        m = commit_step(b, "s1", 1, world_size=1)
        path = "model.layers.0.safetensors"
        assert b.stat(f"s1/{path}").etag.endswith("-3")  # three parts of 5 MiB, 5 MiB and the rest
        data = b.read(f"s1/{path}", 64 << 20)
    assert rec.files == tuple(f for f in m.files if f.path == path)
    assert load(data)["model.layers.0.w"].tobytes() == big.tobytes()


def test_torch_tensors_publish_the_same_bytes_as_numpy(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    state = model(1)
    as_torch = {
        n: torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) if a.dtype == BF16 else torch.from_numpy(a)
        for n, a in state.items()
    }
    recs = []
    for name, tensors in (("np", state), ("torch", as_torch)):
        (tmp_path / name).mkdir()
        recs.append(publish_part(f"file://{tmp_path / name}", "s1", tensors, rank=0, world_size=1, chunk_size=CHUNK))
    assert recs[0].files == recs[1].files and recs[0].tensors == recs[1].tensors
