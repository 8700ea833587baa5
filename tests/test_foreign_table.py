"""bdn.proto.foreign: listing + headers -> table, without I/O (files written by bdn's own writer;
tests/test_foreign_bucket.py does the same with fireworks-delta-compression through buckets)."""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import zstandard

from bdn.fileops import save, write_diff_file_from_arrays
from bdn.proto.errors import ManifestError, UnsupportedFormat
from bdn.proto.foreign import (
    MAX_HEADER_BYTES,
    ForeignObject,
    ForeignSnapshotError,
    IncompleteSnapshot,
    chunk_id,
    derive_table,
    header_span,
    listed_objects,
    policy_version_from_identity,
    sniff_compression,
)
from bdn.proto.safetensors_fmt import parse_header

CHUNK = 4096


@dataclass
class Listed:
    key: str
    size: int
    etag: str


def weights(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "a.weight": rng.standard_normal((64, 48)).astype(np.float32),
        "b.bias": rng.standard_normal(48).astype(np.float16),
    }


def step(w: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for k, v in w.items():
        v = v.copy()
        flat = v.reshape(-1)
        idx = rng.choice(flat.size, max(1, flat.size // 50), replace=False)
        flat[idx] += 1
        out[k] = v
    return out


def snapshot(tmp: Path, identity: str, files: dict[str, bytes]) -> tuple[list[ForeignObject], dict[str, bytes]]:
    """The listing and heads of a snapshot held in memory (etag: a hash of the content)."""
    listing = [Listed(f"{identity}/{p}", len(d), f"{zlib.crc32(d):08x}") for p, d in files.items()]
    objects = listed_objects(identity, listing)
    heads = {p: d[: header_span(d, len(d))] for p, d in files.items() if p.endswith(".safetensors")}
    return objects, heads


def full_files(tmp: Path, w: dict[str, np.ndarray]) -> dict[str, bytes]:
    save(tmp / "m.safetensors", w, {"format": "pt"})
    return {
        "model.safetensors": (tmp / "m.safetensors").read_bytes(),
        "config.json": b'{"hidden_size": 48}',
        "tokenizer/vocab.txt": b"a\nb\n",
    }


def delta_files(
    tmp: Path, base: dict[str, np.ndarray], target: dict[str, np.ndarray], fmt: str = "arc_v2"
) -> dict[str, bytes]:
    write_diff_file_from_arrays(base, target, tmp / "d.safetensors", fmt)
    return {"model.safetensors": (tmp / "d.safetensors").read_bytes(), "config.json": b'{"hidden_size": 48}'}


def test_full_table_is_the_same_whatever_the_listing_order(tmp_path: Path) -> None:
    files = full_files(tmp_path, weights(1))
    objects, heads = snapshot(tmp_path, "step000001", files)
    t1 = derive_table("step000001", objects, heads, chunk_size=CHUNK, policy_version=1)
    again, _ = snapshot(tmp_path, "step000001", dict(reversed(list(files.items()))))
    t2 = derive_table("step000001", list(reversed(again)), heads, chunk_size=CHUNK, policy_version=1)
    assert t1 == t2 and t1.table_id == t2.table_id and t1.to_json() == t2.to_json()
    m = t1.manifest
    assert m.kind == "full" and m.policy_version == 1 and m.chunk_size == CHUNK
    assert [f.path for f in m.files] == ["config.json", "model.safetensors", "tokenizer/vocab.txt"]
    shard = m.file("model.safetensors")
    assert shard.size == len(files["model.safetensors"]) and len(shard.chunks) == -(-shard.size // CHUNK)
    assert t1.object("model.safetensors").key == "step000001/model.safetensors"
    assert not t1.content_digests
    assert shard.chunks[0] == chunk_id(
        "step000001/model.safetensors", t1.object("model.safetensors").etag, shard.size, CHUNK, 0
    )
    # Another chunk size or another version of one object gives another table.
    assert derive_table("step000001", objects, heads, chunk_size=2 * CHUNK, policy_version=1).table_id != t1.table_id
    changed = [o if o.path != "config.json" else ForeignObject(o.path, o.key, o.size, "new") for o in objects]
    t3 = derive_table("step000001", changed, heads, chunk_size=CHUNK, policy_version=1)
    assert t3.manifest.file("config.json").chunks != m.file("config.json").chunks
    assert t3.manifest.file("model.safetensors").chunks == shard.chunks


@pytest.mark.parametrize("fmt", ["arc_v1", "arc_v2", "bdn_planes_v1"])
def test_delta_detected_with_its_codec_and_result_sizes(tmp_path: Path, fmt: str) -> None:
    w1 = weights(1)
    base_objects, base_heads = snapshot(tmp_path, "step000001", full_files(tmp_path, w1))
    base = derive_table("step000001", base_objects, base_heads, chunk_size=CHUNK, policy_version=1).manifest
    objects, heads = snapshot(tmp_path, "step000002", delta_files(tmp_path, w1, step(w1, 2), fmt))
    t = derive_table(
        "step000002", objects, heads, chunk_size=CHUNK, policy_version=2, base_identity="step000001", base=base
    )
    m = t.manifest
    assert (m.kind, m.base_identity, m.compression_format, m.checksum_format) == ("delta", "step000001", fmt, "alder32")
    diff = m.file("model.safetensors")
    assert diff.is_diff and diff.result_size == base.file("model.safetensors").size
    assert not m.file("config.json").is_diff
    assert set(diff.result_chunks).isdisjoint(base.file("model.safetensors").chunks)
    # The request may name the codec; a wrong one is refused.
    derive_table(
        "step000002",
        objects,
        heads,
        chunk_size=CHUNK,
        policy_version=2,
        base_identity="step000001",
        base=base,
        compression_format=fmt.upper(),
    )
    other = "arc_v1" if fmt != "arc_v1" else "arc_v2"
    with pytest.raises(UnsupportedFormat, match=f"names compression_format '{other}', but the diff files are {fmt}"):
        derive_table(
            "step000002",
            objects,
            heads,
            chunk_size=CHUNK,
            policy_version=2,
            base_identity="step000001",
            base=base,
            compression_format=other,
        )


def test_delta_needs_its_base(tmp_path: Path) -> None:
    w1 = weights(1)
    objects, heads = snapshot(tmp_path, "step000002", delta_files(tmp_path, w1, step(w1, 2)))
    with pytest.raises(ForeignSnapshotError, match="no base was given: name it as previous_snapshot_identity"):
        derive_table("step000002", objects, heads, chunk_size=CHUNK, policy_version=2)
    with pytest.raises(ForeignSnapshotError, match="the table of its base 'step000001' is needed"):
        derive_table("step000002", objects, heads, chunk_size=CHUNK, policy_version=2, base_identity="step000001")
    base_objects, base_heads = snapshot(
        tmp_path, "step000001", {"other.safetensors": full_files(tmp_path, w1)["model.safetensors"]}
    )
    base = derive_table("step000001", base_objects, base_heads, chunk_size=CHUNK, policy_version=1).manifest
    with pytest.raises(ForeignSnapshotError, match="the base 'step000001' has no 'model.safetensors'"):
        derive_table(
            "step000002", objects, heads, chunk_size=CHUNK, policy_version=2, base_identity="step000001", base=base
        )


def test_diff_names_checked_against_the_base_header(tmp_path: Path) -> None:
    w1 = weights(1)
    full = full_files(tmp_path, w1)
    base_objects, base_heads = snapshot(tmp_path, "step000001", full)
    base = derive_table("step000001", base_objects, base_heads, chunk_size=CHUNK, policy_version=1).manifest
    w_other = {"a.weight": w1["a.weight"], "c.other": w1["b.bias"]}
    save(tmp_path / "o.safetensors", w_other, {"format": "pt"})
    other_header = parse_header((tmp_path / "o.safetensors").read_bytes(), (tmp_path / "o.safetensors").stat().st_size)
    objects, heads = snapshot(tmp_path, "step000002", delta_files(tmp_path, w1, step(w1, 2)))
    with pytest.raises(ForeignSnapshotError, match="no stream for tensor 'c.other' of the base"):
        derive_table(
            "step000002",
            objects,
            heads,
            chunk_size=CHUNK,
            policy_version=2,
            base_identity="step000001",
            base=base,
            base_headers={"model.safetensors": other_header},
        )


def test_mixed_diff_and_full_files_refused(tmp_path: Path) -> None:
    w1 = weights(1)
    files = delta_files(tmp_path, w1, step(w1, 2))
    files["extra.safetensors"] = full_files(tmp_path, w1)["model.safetensors"]
    objects, heads = snapshot(tmp_path, "step000002", files)
    with pytest.raises(ForeignSnapshotError, match="mixes diff files .* and full safetensors files"):
        derive_table("step000002", objects, heads, chunk_size=CHUNK, policy_version=2, base_identity="step000001")


def test_sniff_compression() -> None:
    assert sniff_compression(zstandard.ZstdCompressor().compress(b"x" * 100)) == "arc_v2"
    for level in (1, 6, 9):
        assert sniff_compression(zlib.compress(b"x" * 100, level)) == "arc_v1"
    assert sniff_compression(b"BDNP\x01") == "bdn_planes_v1"
    assert sniff_compression(b"\x80\x04\x95\x00") is None  # a pickle (arc_v3's payloads)
    assert sniff_compression(b"") is None


def test_unknown_codec_refused_naming_the_file(tmp_path: Path) -> None:
    w1 = weights(1)
    data = bytearray(delta_files(tmp_path, w1, step(w1, 2))["model.safetensors"])
    start = 8 + struct.unpack_from("<Q", data)[0]
    data[start : start + 4] = b"\x80\x04\x95\x00"
    objects, heads = snapshot(tmp_path, "step000002", {"model.safetensors": bytes(data)})
    with pytest.raises(UnsupportedFormat, match="step000002/model.safetensors: the diff stream of tensor"):
        derive_table("step000002", objects, heads, chunk_size=CHUNK, policy_version=2, base_identity="step000001")


def test_every_header_is_validated(tmp_path: Path) -> None:
    good = full_files(tmp_path, weights(1))["model.safetensors"]
    # A gap: the object is longer than its tensors (or a header that lies about the offsets).
    objects, heads = snapshot(tmp_path, "s1", {"m.safetensors": good + b"\0" * 16})
    with pytest.raises(ForeignSnapshotError, match="s1/m.safetensors: safetensors tensors end at byte"):
        derive_table("s1", objects, heads, chunk_size=CHUNK, policy_version=1)
    # An unknown dtype.
    n = struct.unpack_from("<Q", good)[0]
    header = json.loads(good[8 : 8 + n])
    header["a.weight"]["dtype"] = "F13"
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (n - len(text))
    bad = good[:8] + text + good[8 + n :]
    objects, heads = snapshot(tmp_path, "s1", {"m.safetensors": bad})
    with pytest.raises(ForeignSnapshotError, match="unknown dtype 'F13'"):
        derive_table("s1", objects, heads, chunk_size=CHUNK, policy_version=1)
    # The safetensors library's limit: N of 100,000,000 bytes and more is refused.
    with pytest.raises(ForeignSnapshotError, match="over the 100000000-byte limit"):
        header_span(struct.pack("<Q", MAX_HEADER_BYTES + 1), 1 << 40)
    with pytest.raises(ForeignSnapshotError, match="runs past the end"):
        header_span(struct.pack("<Q", 100), 50)
    with pytest.raises(ForeignSnapshotError, match="shorter than its 8-byte length prefix"):
        header_span(b"\1\0", 2)


def test_listing_rules(tmp_path: Path) -> None:
    with pytest.raises(IncompleteSnapshot, match="nothing is published under step000009/"):
        listed_objects("step000009", [Listed("step000001/a", 1, "e")])
    with pytest.raises(ForeignSnapshotError, match="has a bdn.manifest.json: it is a bdn snapshot"):
        listed_objects("s1", [Listed("s1/a", 1, "e"), Listed("s1/bdn.manifest.json", 1, "e")])
    with pytest.raises(ForeignSnapshotError, match="no usable version token"):
        listed_objects("s1", [Listed("s1/a", 1, "")])
    got = listed_objects("s1", [Listed("s1/b", 1, "e"), Listed("s10/x", 1, "e"), Listed("s1/a", 2, "f")])
    assert [o.path for o in got] == ["a", "b"]


def test_index_names_a_missing_shard(tmp_path: Path) -> None:
    files = full_files(tmp_path, weights(1))
    index = {"metadata": {}, "weight_map": {"a.weight": "model.safetensors", "b.bias": "model-2.safetensors"}}
    files["model.safetensors.index.json"] = json.dumps(index).encode()
    objects, heads = snapshot(tmp_path, "s1", files)
    with pytest.raises(
        IncompleteSnapshot, match="names the shard 'model-2.safetensors', which is not \\(yet\\) in the bucket"
    ):
        derive_table(
            "s1",
            objects,
            heads,
            chunk_size=CHUNK,
            policy_version=1,
            indexes={"model.safetensors.index.json": files["model.safetensors.index.json"]},
        )
    index["weight_map"]["b.bias"] = "model.safetensors"
    ok = json.dumps(index).encode()
    derive_table("s1", objects, heads, chunk_size=CHUNK, policy_version=1, indexes={"model.safetensors.index.json": ok})


def test_limits_refused_at_once(tmp_path: Path) -> None:
    files = full_files(tmp_path, weights(1))
    objects, heads = snapshot(tmp_path, "s1", files)
    with pytest.raises(ForeignSnapshotError, match="has 3 files, over the limit of 2"):
        derive_table("s1", objects, heads, chunk_size=CHUNK, policy_version=1, max_files=2)
    with pytest.raises(ForeignSnapshotError, match="more than 2 chunks"):
        derive_table("s1", objects, heads, chunk_size=CHUNK, policy_version=1, max_chunks=2)
    with pytest.raises((ForeignSnapshotError, ManifestError)):
        derive_table("s1", objects, heads, chunk_size=100, policy_version=1)


def test_policy_version_from_identity() -> None:
    assert policy_version_from_identity("step000002") == 2
    assert policy_version_from_identity("run7-42") == 42
    assert policy_version_from_identity("anchor") is None


def test_index_naming_an_unusable_path_is_final(tmp_path: Path) -> None:
    files = full_files(tmp_path, weights(1))
    index = json.dumps({"weight_map": {"a.weight": "../other/model.safetensors"}}).encode()
    files["model.safetensors.index.json"] = index
    objects, heads = snapshot(tmp_path, "s1", files)
    with pytest.raises(ForeignSnapshotError, match="names an unusable shard") as err:
        derive_table(
            "s1", objects, heads, chunk_size=CHUNK, policy_version=1, indexes={"model.safetensors.index.json": index}
        )
    assert not isinstance(err.value, IncompleteSnapshot)


def test_short_object_error_names_it(tmp_path: Path) -> None:
    objects = listed_objects("s1", [Listed("s1/m.safetensors", 3, "e")])
    with pytest.raises(ForeignSnapshotError, match="s1/m.safetensors: safetensors object of 3 bytes"):
        derive_table("s1", objects, {"m.safetensors": b"\x05\0\0"}, chunk_size=CHUNK, policy_version=1)
