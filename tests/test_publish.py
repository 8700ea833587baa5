"""bdn.publish and ``bdn-publish``, on real files, a ``file://`` bucket and a real moto S3 server."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy as st_np
import zstandard
from safetensors import safe_open

from bdn.bucket import AccessDenied, Bucket, ObjectNotFound, open_bucket
from bdn.fileops import apply_delta_file
from bdn.fileops import chunk_digests as file_digests
from bdn.proto.errors import (
    ChecksumError,
    IdentityError,
    PathError,
    TensorMismatch,
    UnsupportedFormat,
)
from bdn.proto.manifest import MANIFEST_NAME, STARTUP_NAME, Manifest
from bdn.publish import (
    BaseNotPublished,
    PublishError,
    publish_delta,
    publish_full,
    publish_startup,
)
from tests.support.s3server import S3Proxy, create_bucket

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent  # the venv running the tests (a worktree has no .venv of its own)
CLI = VENV_BIN / "bdn-publish"
CHUNK = 64 << 10
BF16 = ml_dtypes.bfloat16
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


# ---- checkpoints ------------------------------------------------------------------------------


def _tensors(seed: int) -> dict[str, dict[str, np.ndarray]]:
    """Two shards of bf16 tensors (~0.9 MB in all) shaped like a tiny decoder."""
    rng = np.random.default_rng(seed)

    def t(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(BF16)

    return {
        SHARDS[0]: {
            "model.embed_tokens.weight": t(512, 256),
            "model.layers.0.self_attn.q_proj.weight": t(256, 256),
            "model.layers.0.input_layernorm.weight": t(256),
        },
        SHARDS[1]: {
            "model.layers.0.mlp.up_proj.weight": t(512, 256),
            "model.norm.weight": t(256),
            "lm_head.weight": t(300, 256),
        },
    }


def _write_hf_dir(root: Path, shards: dict[str, dict[str, np.ndarray]]) -> Path:
    """A Hugging Face checkpoint directory; shards written by the reference safetensors library."""
    root.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    total = 0
    for shard, tensors in shards.items():
        st_np.save_file(tensors, str(root / shard), metadata={"format": "pt"})
        for name, arr in tensors.items():
            weight_map[name] = shard
            total += arr.nbytes
    (root / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 256, "torch_dtype": "bfloat16"})
    )
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    (root / "tokenizer_config.json").write_text('{"model_max_length": 4096}')
    (root / "original").mkdir(exist_ok=True)
    (root / "original" / "params.json").write_text('{"dim": 256}')
    (root / "special_tokens_map.json").write_bytes(b"")  # empty objects have no chunks
    return root


def _optimizer_step(
    shards: dict[str, dict[str, np.ndarray]], seed: int, frac: float = 0.02
) -> dict[str, dict[str, np.ndarray]]:
    """The same tensors with ~``frac`` of the bf16 values nudged, as one optimizer step would."""
    rng = np.random.default_rng(seed)
    out: dict[str, dict[str, np.ndarray]] = {}
    for shard, tensors in shards.items():
        out[shard] = {}
        for name, arr in tensors.items():
            flat = arr.astype(np.float32).ravel()
            idx = rng.choice(flat.size, size=max(1, int(flat.size * frac)), replace=False)
            flat[idx] += rng.standard_normal(idx.size, dtype=np.float32) * 0.01
            out[shard][name] = flat.astype(BF16).reshape(arr.shape)
    return out


@pytest.fixture
def ckpt(tmp_path: Path) -> tuple[Path, dict[str, dict[str, np.ndarray]]]:
    shards = _tensors(1)
    return _write_hf_dir(tmp_path / "step1", shards), shards


# ---- buckets ----------------------------------------------------------------------------------


@dataclass
class S3Server:
    endpoint: str
    credentials_file: Path


@pytest.fixture(scope="module")
def s3_server(moto_endpoint: str, tmp_path_factory: pytest.TempPathFactory) -> S3Server:
    """The session's moto S3 server (tests/conftest.py) and a writer's credentials file for it."""
    creds = tmp_path_factory.mktemp("creds") / "writer.json"
    creds.write_text(
        json.dumps({"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "aws_region": "us-east-1"})
    )
    return S3Server(moto_endpoint, creds)


@pytest.fixture
def s3_proxy(s3_server: S3Server) -> Iterator[S3Proxy]:
    proxy = S3Proxy(s3_server.endpoint).start()
    try:
        yield proxy
    finally:
        proxy.stop()


@dataclass
class BucketSpec:
    """How to reach one test bucket: URL plus the CLI flags that go with it."""

    url: str
    endpoint: str | None = None
    credentials_file: Path | None = None
    local_root: Path | None = None  # file:// only

    def open(self) -> Bucket:
        return open_bucket(
            self.url,
            credentials_file=str(self.credentials_file) if self.credentials_file else None,
            endpoint_url=self.endpoint,
        )

    def cli_flags(self) -> list[str]:
        flags = ["--bucket", self.url]
        if self.endpoint:
            flags += ["--endpoint-url", self.endpoint, "--credentials-file", str(self.credentials_file)]
        return flags


@pytest.fixture(params=["file", "s3"])
def spec(request: pytest.FixtureRequest, tmp_path: Path) -> BucketSpec:
    if request.param == "file":
        root = tmp_path / "bucket"
        return BucketSpec(f"file://{root}", local_root=root)
    server: S3Server = request.getfixturevalue("s3_server")
    name = create_bucket(server.endpoint)
    return BucketSpec(f"s3://{name}/run1", server.endpoint, server.credentials_file)


@pytest.fixture
def bucket(spec: BucketSpec) -> Iterator[Bucket]:
    b = spec.open()
    try:
        yield b
    finally:
        b.close()


def _read_manifest(b: Bucket, identity: str) -> Manifest:
    return Manifest.from_json(b.read(f"{identity}/{MANIFEST_NAME}"), expect_identity=identity)


def _local_files(root: Path) -> dict[str, Path]:
    return {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*")) if p.is_file()}


def _download(b: Bucket, key: str, dest: Path) -> Path:
    size = b.stat(key).size
    buf = bytearray(size)
    if size:
        b.read_range_into(key, 0, memoryview(buf))
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(buf)
    return dest


# ---- full snapshots ---------------------------------------------------------------------------


def test_full_dir_uploads_every_file_and_a_true_manifest(bucket: Bucket, ckpt, tmp_path: Path) -> None:
    src, _ = ckpt
    m = publish_full(bucket, "step000001", 1, dir=src, chunk_size=CHUNK, workers=4)

    local = _local_files(src)
    stored = {o.key for o in bucket.list("step000001/")}
    assert stored == {f"step000001/{p}" for p in local} | {f"step000001/{MANIFEST_NAME}"}
    assert "original/params.json" in local  # nested paths are published with '/'

    got = _read_manifest(bucket, "step000001")
    assert got == m
    assert got.kind == "full" and got.policy_version == 1 and got.chunk_size == CHUNK
    assert got.base_identity is None and got.compression_format is None
    assert got.created_at.endswith("Z") and len(got.created_at) == len("2026-11-29T10:00:00Z")
    assert [f.path for f in got.files] == sorted(local)
    for f in got.files:
        assert f.result is None
        assert f.size == local[f.path].stat().st_size
        assert list(f.chunks) == file_digests(local[f.path], CHUNK)
        copy = _download(bucket, f"step000001/{f.path}", tmp_path / "dl" / f.path)
        assert copy.read_bytes() == local[f.path].read_bytes()
    assert any(len(f.chunks) > 1 for f in got.files)  # shards span several chunks


def test_full_manifest_is_the_last_object_written(tmp_path: Path, ckpt) -> None:
    """file://: the manifest's mtime is the newest (S3: see test_s3_manifest_is_the_last_request)."""
    spec = BucketSpec(f"file://{tmp_path / 'bucket'}", local_root=tmp_path / "bucket")
    assert spec.local_root is not None
    src, _ = ckpt
    publish_full(spec.url, "step000001", 1, dir=src, chunk_size=CHUNK)
    snap = spec.local_root / "step000001"
    mtimes = {p.name: p.stat().st_mtime_ns for p in snap.rglob("*") if p.is_file()}
    manifest_mtime = mtimes.pop(MANIFEST_NAME)
    assert manifest_mtime >= max(mtimes.values())


def test_failed_upload_midway_writes_no_manifest(ckpt, tmp_path: Path) -> None:
    """file://: one object cannot be stored (its parent 'directory' is a file): no manifest."""
    spec = BucketSpec(f"file://{tmp_path / 'bucket'}", local_root=tmp_path / "bucket")
    assert spec.local_root is not None
    src, _ = ckpt
    (spec.local_root / "step000001").mkdir(parents=True)
    (spec.local_root / "step000001" / "original").write_text("in the way")
    with pytest.raises(Exception) as ei:
        publish_full(spec.url, "step000001", 1, dir=src, chunk_size=CHUNK, workers=2)
    assert "original/params.json" in str(ei.value)
    assert not (spec.local_root / "step000001" / MANIFEST_NAME).exists()
    # Files that could be stored were; the snapshot is still not published.
    with pytest.raises(PublishError, match="not published"):
        publish_startup(spec.url, "step000001")


def test_unreadable_file_fails_before_the_manifest(bucket: Bucket, ckpt) -> None:
    """A file that cannot be read (a dangling, in-directory symlink) stops the publish."""
    src, _ = ckpt
    (src / "tokenizer.json").symlink_to(src / "gone.json")
    with pytest.raises(PathError, match="tokenizer.json"):
        publish_full(bucket, "step000001", 1, dir=src, chunk_size=CHUNK)
    with pytest.raises(ObjectNotFound):
        bucket.stat(f"step000001/{MANIFEST_NAME}")


def test_s3_manifest_is_the_last_request(s3_server: S3Server, s3_proxy: S3Proxy, ckpt) -> None:
    src, _ = ckpt
    name = create_bucket(s3_server.endpoint)
    with open_bucket(
        f"s3://{name}/run1", credentials_file=str(s3_server.credentials_file), endpoint_url=s3_proxy.url
    ) as b:
        m = publish_full(b, "step000001", 1, dir=src, chunk_size=CHUNK, workers=4)
    writes = [r for r in s3_proxy.requests() if r.method in ("PUT", "POST")]
    claim = "run1/.bdn-parts/step000001/commit.json"  # the publish's claim: its first write
    assert {r.key for r in writes} == {f"run1/step000001/{f.path}" for f in m.files} | {
        f"run1/step000001/{MANIFEST_NAME}",
        claim,
    }
    assert writes[0].key == claim and [r.key for r in writes].count(claim) == 1
    assert writes[-1].key == f"run1/step000001/{MANIFEST_NAME}"
    assert [r.key for r in writes].count(f"run1/step000001/{MANIFEST_NAME}") == 1


def test_s3_upload_refused_midway_writes_no_manifest(s3_server: S3Server, s3_proxy: S3Proxy, ckpt) -> None:
    """The bucket refuses one PUT (403) while others are stored: the manifest is never sent."""
    src, _ = ckpt
    name = create_bucket(s3_server.endpoint)
    s3_proxy.fail_next(1, status=403, code="AccessDenied", methods=("PUT",))
    with open_bucket(
        f"s3://{name}/run1", credentials_file=str(s3_server.credentials_file), endpoint_url=s3_proxy.url
    ) as b:
        with pytest.raises(AccessDenied):
            publish_full(b, "step000001", 1, dir=src, chunk_size=CHUNK, workers=2)
        keys = {o.key for o in b.list("step000001/")}
    assert f"step000001/{MANIFEST_NAME}" not in keys
    assert not s3_proxy.requests(key=f"run1/step000001/{MANIFEST_NAME}", method="PUT")
    assert any(r.injected for r in s3_proxy.requests(method="PUT"))


def test_full_from_state_dict(bucket: Bucket, tmp_path: Path) -> None:
    sd = _tensors(3)[SHARDS[0]]
    config = json.dumps({"hidden_size": 256}).encode()
    m = publish_full(bucket, "sd-1", 7, state_dict=sd, extra_files={"config.json": config}, chunk_size=CHUNK)
    assert [f.path for f in m.files] == ["config.json", "model.safetensors"]
    assert bucket.read("sd-1/config.json") == config
    model = _download(bucket, "sd-1/model.safetensors", tmp_path / "model.safetensors")
    assert list(m.file("model.safetensors").chunks) == file_digests(model, CHUNK)
    with safe_open(str(model), framework="np") as f:
        assert f.metadata() == {"format": "pt"}
        assert sorted(f.keys()) == sorted(sd)
    raw = model.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    for name, arr in sd.items():
        b0, b1 = header[name]["data_offsets"]
        assert header[name]["dtype"] == "BF16"
        assert raw[8 + n + b0 : 8 + n + b1] == arr.tobytes()


def test_refuses_to_overwrite_a_published_snapshot(bucket: Bucket, ckpt) -> None:
    src, _ = ckpt
    publish_full(bucket, "step000001", 1, dir=src, chunk_size=CHUNK)
    with pytest.raises(PublishError, match="already published"):
        publish_full(bucket, "step000001", 2, dir=src, chunk_size=CHUNK)
    assert _read_manifest(bucket, "step000001").policy_version == 1
    publish_full(bucket, "step000001", 2, dir=src, chunk_size=CHUNK, overwrite=True)
    assert _read_manifest(bucket, "step000001").policy_version == 2


@pytest.mark.parametrize(
    "identity, rule",
    [("a/b", "one path segment"), ("STARTUP_SNAPSHOT", "reserved"), ("-x", "does not match"), ("", "does not match")],
)
def test_bad_identity_is_refused(bucket: Bucket, ckpt, identity: str, rule: str) -> None:
    src, _ = ckpt
    with pytest.raises(IdentityError, match=rule):
        publish_full(bucket, identity, 1, dir=src)
    assert bucket.list("") == []


def test_symlink_escaping_the_dir_is_refused(bucket: Bucket, ckpt, tmp_path: Path) -> None:
    src, _ = ckpt
    (tmp_path / "secret.txt").write_text("not part of the checkpoint")
    (src / "link.txt").symlink_to(tmp_path / "secret.txt")
    with pytest.raises(PathError, match="outside"):
        publish_full(bucket, "step000001", 1, dir=src)
    assert bucket.list("") == []


def test_symlink_inside_the_dir_is_published(bucket: Bucket, ckpt) -> None:
    src, _ = ckpt
    (src / "generation_config.json").symlink_to(src / "config.json")
    m = publish_full(bucket, "step000001", 1, dir=src, chunk_size=CHUNK)
    assert m.file("generation_config.json").chunks == m.file("config.json").chunks


def test_special_files_and_stray_manifest_are_refused(bucket: Bucket, ckpt) -> None:
    src, _ = ckpt
    os.mkfifo(src / "pipe")
    with pytest.raises(PathError, match="not a regular file"):
        publish_full(bucket, "step000001", 1, dir=src)
    (src / "pipe").unlink()
    (src / MANIFEST_NAME).write_text("{}")
    with pytest.raises(PathError, match="written by bdn"):
        publish_full(bucket, "step000001", 1, dir=src)


# ---- deltas -----------------------------------------------------------------------------------


def _rebuild_independently(base: Path, diff: Path, fmt: str) -> bytes:
    """The arc rule, decoded with the reference libraries: base bytes, each tensor XOR its stream."""
    out = bytearray(base.read_bytes())
    n = int.from_bytes(out[:8], "little")
    header = json.loads(out[8 : 8 + n])
    header.pop("__metadata__", None)
    with safe_open(str(diff), framework="np") as d:
        checks = d.metadata()
        assert sorted(d.keys()) == sorted(header)
        for name, info in header.items():
            frame = d.get_tensor(name).tobytes()
            xor = zstandard.ZstdDecompressor().decompress(frame) if fmt == "arc_v2" else zlib.decompress(frame)
            b0, b1 = (8 + n + o for o in info["data_offsets"])
            assert len(xor) == b1 - b0
            t = np.bitwise_xor(np.frombuffer(out, np.uint8, b1 - b0, b0), np.frombuffer(xor, np.uint8))
            out[b0:b1] = t.tobytes()
            assert int(checks[name]) == zlib.adler32(t.tobytes())
    return bytes(out)


def _check_delta(b: Bucket, m: Manifest, base_dir: Path, target_dir: Path, scratch: Path) -> None:
    """Apply every diff of ``m`` to ``base_dir``: the result must be ``target_dir``, byte for byte.

    Rebuilt twice: through ``arc.apply_diff`` (via the publisher's file helper) and independently.
    """
    target = _local_files(target_dir)
    assert [f.path for f in m.files] == sorted(target)
    for f in m.files:
        stored = _download(b, f"{m.identity}/{f.path}", scratch / "diff" / f.path)
        assert list(f.chunks) == file_digests(stored, m.chunk_size)
        if not f.path.endswith(".safetensors"):
            assert f.result is None
            assert stored.read_bytes() == target[f.path].read_bytes()
            continue
        assert f.result is not None
        out = scratch / "rebuilt" / f.path
        out.parent.mkdir(parents=True, exist_ok=True)
        apply_delta_file(base_dir / f.path, stored, out, m.compression_format or "", f.result.size)
        assert out.read_bytes() == target[f.path].read_bytes()
        assert _rebuild_independently(base_dir / f.path, stored, m.compression_format or "") == out.read_bytes()
        assert f.result.size == out.stat().st_size
        assert list(f.result.chunks) == file_digests(out, m.chunk_size)


@pytest.mark.parametrize("fmt", ["arc_v2", "arc_v1"])
def test_delta_from_an_optimizer_step_rebuilds_the_target(bucket: Bucket, ckpt, tmp_path: Path, fmt: str) -> None:
    base_dir, shards = ckpt
    publish_full(bucket, "step000001", 1, dir=base_dir, chunk_size=CHUNK)
    target_dir = _write_hf_dir(tmp_path / "step2", _optimizer_step(shards, seed=2))

    m = publish_delta(
        bucket,
        "step000002",
        2,
        "step000001",
        dir=target_dir,
        base_dir=base_dir,
        compression_format=fmt,
        chunk_size=CHUNK,
    )
    got = _read_manifest(bucket, "step000002")
    assert got == m
    assert (got.kind, got.base_identity, got.compression_format, got.checksum_format) == (
        "delta",
        "step000001",
        fmt,
        "alder32",
    )
    _check_delta(bucket, got, base_dir, target_dir, tmp_path / "check")
    diff_bytes = sum(f.size for f in got.files if f.result)
    target_bytes = sum(f.result.size for f in got.files if f.result)
    assert diff_bytes < target_bytes // 2  # 2% of values changed: the diff is mostly zeros


def test_delta_downloads_its_base_chain_from_the_bucket(bucket: Bucket, ckpt, tmp_path: Path) -> None:
    """No local base: step3's base (a delta itself) is rebuilt from step1 + step2's diffs."""
    base_dir, shards = ckpt
    publish_full(bucket, "step000001", 1, dir=base_dir, chunk_size=CHUNK)
    s2 = _optimizer_step(shards, seed=2)
    dir2 = _write_hf_dir(tmp_path / "step2", s2)
    publish_delta(bucket, "step000002", 2, "step000001", dir=dir2, chunk_size=CHUNK)
    dir3 = _write_hf_dir(tmp_path / "step3", _optimizer_step(s2, seed=3))
    m = publish_delta(bucket, "step000003", 3, "step000002", dir=dir3, chunk_size=CHUNK, workers=3)
    _check_delta(bucket, m, dir2, dir3, tmp_path / "check")


def test_delta_from_state_dicts(bucket: Bucket, tmp_path: Path) -> None:
    sd1 = _tensors(5)[SHARDS[1]]
    sd2 = _optimizer_step({"m": sd1}, seed=6)["m"]
    cfg = {"config.json": b"{}"}
    publish_full(bucket, "s1", 1, state_dict=sd1, extra_files=cfg, chunk_size=CHUNK)
    m = publish_delta(bucket, "s2", 2, "s1", state_dict=sd2, base_state_dict=sd1, extra_files=cfg, chunk_size=CHUNK)
    assert m.file("model.safetensors").is_diff and not m.file("config.json").is_diff
    base = _download(bucket, "s1/model.safetensors", tmp_path / "b" / "model.safetensors")
    diff = _download(bucket, "s2/model.safetensors", tmp_path / "d" / "model.safetensors")
    apply_delta_file(base, diff, tmp_path / "out.safetensors", "arc_v2", m.file("model.safetensors").result_size)
    assert list(m.file("model.safetensors").result_chunks) == file_digests(tmp_path / "out.safetensors", CHUNK)


def test_delta_refuses_a_base_dir_that_differs_from_the_published_base(bucket: Bucket, ckpt, tmp_path: Path) -> None:
    base_dir, shards = ckpt
    publish_full(bucket, "step000001", 1, dir=base_dir, chunk_size=CHUNK)
    other = _write_hf_dir(tmp_path / "other", _optimizer_step(shards, seed=9))
    target = _write_hf_dir(tmp_path / "step2", _optimizer_step(shards, seed=2))
    with pytest.raises(ChecksumError, match="base_dir file 'model-0000"):
        publish_delta(bucket, "step000002", 2, "step000001", dir=target, base_dir=other, chunk_size=CHUNK)
    assert bucket.list("step000002/") == []


def test_delta_refuses_an_unpublished_base(bucket: Bucket, ckpt) -> None:
    src, _ = ckpt
    with pytest.raises(BaseNotPublished, match=r"base snapshot 'step000000' is not published \(no bdn.manifest.json\)"):
        publish_delta(bucket, "step000001", 1, "step000000", dir=src)
    assert bucket.list("") == []


def test_delta_refuses_unsupported_format(bucket: Bucket, ckpt) -> None:
    src, _ = ckpt
    publish_full(bucket, "step000001", 1, dir=src, chunk_size=CHUNK)
    with pytest.raises(UnsupportedFormat) as ei:
        publish_delta(bucket, "step000002", 2, "step000001", dir=src, compression_format="arc_v3")
    assert "arc_v1" in str(ei.value) and "arc_v2" in str(ei.value)


def test_delta_refuses_a_tensor_mismatch_naming_the_tensor(bucket: Bucket, ckpt, tmp_path: Path) -> None:
    base_dir, shards = ckpt
    publish_full(bucket, "step000001", 1, dir=base_dir, chunk_size=CHUNK)
    changed = _optimizer_step(shards, seed=2)
    changed[SHARDS[1]]["model.norm.weight"] = np.zeros(128, dtype=BF16)
    target = _write_hf_dir(tmp_path / "step2", changed)
    with pytest.raises(TensorMismatch, match="model.norm.weight"):
        publish_delta(bucket, "step000002", 2, "step000001", dir=target, base_dir=base_dir, chunk_size=CHUNK)
    with pytest.raises(ObjectNotFound):
        bucket.stat(f"step000002/{MANIFEST_NAME}")


def test_delta_refuses_a_shard_the_base_lacks(bucket: Bucket, ckpt, tmp_path: Path) -> None:
    base_dir, shards = ckpt
    publish_full(bucket, "step000001", 1, dir=base_dir, chunk_size=CHUNK)
    target = _write_hf_dir(tmp_path / "step2", _optimizer_step(shards, seed=2))
    shutil.copy(target / SHARDS[0], target / "extra.safetensors")
    with pytest.raises(PublishError, match="'extra.safetensors' has no counterpart in base snapshot 'step000001'"):
        publish_delta(bucket, "step000002", 2, "step000001", dir=target, base_dir=base_dir, chunk_size=CHUNK)


# ---- STARTUP_SNAPSHOT -------------------------------------------------------------------------


def test_startup_names_a_published_snapshot_only(bucket: Bucket, ckpt) -> None:
    src, _ = ckpt
    with pytest.raises(PublishError, match="not published"):
        publish_startup(bucket, "step000001")
    publish_full(bucket, "step000001", 1, dir=src, chunk_size=CHUNK)
    publish_startup(bucket, "step000001")
    assert bucket.read(STARTUP_NAME) == b"step000001\n"
    with pytest.raises(IdentityError):
        publish_startup(bucket, "../x")


# ---- the command ------------------------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(CLI), *args], capture_output=True, text=True, timeout=120)


def test_cli_full_delta_startup(spec: BucketSpec, ckpt, tmp_path: Path) -> None:
    base_dir, shards = ckpt
    target = _write_hf_dir(tmp_path / "step2", _optimizer_step(shards, seed=2))
    flags = spec.cli_flags()

    r = _cli(
        "full",
        "--dir",
        str(base_dir),
        *flags,
        "--identity",
        "step000001",
        "--policy-version",
        "1",
        "--chunk-size",
        str(CHUNK),
    )
    assert r.returncode == 0, r.stderr
    line = r.stdout.strip()
    assert "\n" not in line and "step000001" in line and "7 files" in line

    r = _cli(
        "delta",
        "--dir",
        str(target),
        *flags,
        "--identity",
        "step000002",
        "--policy-version",
        "2",
        "--base",
        "step000001",
        "--chunk-size",
        str(CHUNK),
    )
    assert r.returncode == 0, r.stderr
    assert "step000002" in r.stdout and "delta" in r.stdout

    r = _cli("startup", *flags, "--identity", "step000001")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "STARTUP_SNAPSHOT names step000001\n"

    with spec.open() as b:
        assert b.read(STARTUP_NAME) == b"step000001\n"
        m = _read_manifest(b, "step000002")
        _check_delta(b, m, base_dir, target, tmp_path / "check")


def test_cli_version_json_and_units(tmp_path: Path, ckpt) -> None:
    """Issue 12 item 15: --version, --json (one object on stdout), SI units in the human line."""
    import bdn

    src, _ = ckpt
    flags = ["--bucket", f"file://{tmp_path / 'bucket'}"]
    r = _cli("--version")
    assert r.returncode == 0 and r.stdout == f"bdn {bdn.__version__}\n"
    r = _cli("full", "--dir", str(src), *flags, "--identity", "s1", "--policy-version", "1", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)  # exactly one JSON document
    stored = sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
    assert out == {
        "identity": "s1",
        "kind": "full",
        "base_identity": None,
        "policy_version": 1,
        "stored_bytes": stored,
        "result_bytes": stored,
        "files": 7,
        "seconds": out["seconds"],
    }
    assert isinstance(out["seconds"], float) and out["seconds"] >= 0
    r = _cli("delta", "--dir", str(src), *flags, "--identity", "s2", "--policy-version", "2", "--base", "s1", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert (out["kind"], out["base_identity"], out["result_bytes"]) == ("delta", "s1", stored)
    r = _cli("startup", *flags, "--identity", "s2", "--json")
    assert r.returncode == 0 and json.loads(r.stdout) == {"startup_snapshot": "s2"}
    r = _cli("full", "--dir", str(src), *flags, "--identity", "s1", "--policy-version", "1", "--json")
    assert r.returncode == 1 and json.loads(r.stdout)["exit_code"] == 1
    assert r.stderr.startswith("bdn-publish: error: snapshot 's1' is already published")
    r = _cli("full", "--dir", str(src), *flags, "--identity", "s3", "--policy-version", "3")
    assert r.returncode == 0, r.stderr
    assert f"{stored / 1e3:.1f} kB stored" in r.stdout  # SI: kB = 10^3 bytes (~0.8 MB of tensors)


def test_cli_errors(spec: BucketSpec, ckpt) -> None:
    src, _ = ckpt
    flags = spec.cli_flags()

    r = _cli("startup", *flags, "--identity", "step000001")
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and r.stderr.startswith(
        "bdn-publish: error: snapshot 'step000001' is not published"
    )

    r = _cli(
        "delta", "--dir", str(src), *flags, "--identity", "step000002", "--policy-version", "2", "--base", "step000001"
    )
    assert r.returncode == 1
    assert r.stderr == "bdn-publish: error: base snapshot 'step000001' is not published (no bdn.manifest.json)\n"


def test_cli_refusals_and_usage_errors(tmp_path: Path, ckpt) -> None:
    src, _ = ckpt
    flags = ["--bucket", f"file://{tmp_path / 'bucket'}"]

    # usage errors (argparse's convention: exit 2, before anything is read or written)
    r = _cli("full", "--dir", str(src), *flags, "--identity", "bad/id", "--policy-version", "1")
    assert r.returncode == 2 and "one path segment" in r.stderr

    r = _cli(
        "delta",
        "--dir",
        str(src),
        *flags,
        "--identity",
        "s2",
        "--policy-version",
        "1",
        "--base",
        "s1",
        "--compression-format",
        "arc_v3",
    )
    assert r.returncode in (1, 2) and "arc_v1" in r.stderr and "arc_v2" in r.stderr

    r = _cli("full", "--dir", str(src), *flags, "--identity", "s1")  # no --policy-version
    assert r.returncode == 2 and "--policy-version" in r.stderr
    r = _cli("full", "--dir", str(src), *flags, "--identity", "s1", "--policy-version", "-3")
    assert r.returncode == 2
    r = _cli("full", "--dir", str(src), *flags, "--identity", "s1", "--policy-version", "1", "--chunk-size", "100")
    assert r.returncode == 2 and "--chunk-size" in r.stderr
    r = _cli("full", "--dir", str(src / "nope"), *flags, "--identity", "s1", "--policy-version", "1")
    assert r.returncode == 2 and r.stderr.startswith("bdn-publish: error: ") and "not a directory" in r.stderr
    r = _cli("bogus")
    assert r.returncode == 2
