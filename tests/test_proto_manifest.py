"""Tests for bdn.proto.manifest: ``bdn.manifest.json`` (format ``bdn.snapshot/1``) and STARTUP_SNAPSHOT.

The manifest comes from a bucket, so every rule of ``Manifest.from_json`` is exercised with a
hostile input, and hypothesis checks that nothing but ManifestError ever escapes.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bdn.fileops import chunk_digests as file_digests
from bdn.proto import manifest as manifest_mod
from bdn.proto.chunks import MIN_CHUNK_SIZE, chunk_range, digest
from bdn.proto.errors import IdentityError, ManifestError, ProtocolError
from bdn.proto.manifest import (
    FORMAT,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    ChunkRef,
    FileEntry,
    FileResult,
    Manifest,
    parse_startup,
)

CS = MIN_CHUNK_SIZE  # 4 KiB chunks keep real files small
D = "0123456789abcdef0123456789abcdef"  # a well-formed digest


def _entry(path: str, size: int, chunks: list[str] | None = None) -> dict[str, Any]:
    n = -(-size // CS)
    return {"path": path, "size": size, "chunks": chunks if chunks is not None else [D] * n}


def full_dict(**over: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "format": FORMAT,
        "identity": "step000002",
        "kind": "full",
        "policy_version": 2,
        "created_at": "2026-11-29T10:00:00Z",
        "chunk_size": CS,
        "files": [
            _entry("config.json", 100),
            _entry("model-00001-of-00002.safetensors", 3 * CS),
            _entry("model-00002-of-00002.safetensors", 2 * CS + 7),
            _entry("tokenizer/tokenizer.json", 0),
        ],
    }
    d.update(over)
    return d


def delta_dict(**over: Any) -> dict[str, Any]:
    d = full_dict(kind="delta", identity="step000003", policy_version=3)
    d.update(base_identity="step000002", compression_format="arc_v2", checksum_format="alder32")
    d["files"] = [
        _entry("config.json", 100),
        {**_entry("model.safetensors", CS + 1), "result": {"size": 5 * CS, "chunks": [D] * 5}},
    ]
    d.update(over)
    return d


def _bytes(d: Any) -> bytes:
    return json.dumps(d).encode()


def _refused(d: Any, *needles: str, **kw: Any) -> str:
    with pytest.raises(ManifestError) as ei:
        Manifest.from_json(_bytes(d) if not isinstance(d, (bytes, str)) else d, **kw)
    msg = str(ei.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, (n, msg)
    return msg


# ---- a manifest built from real files ------------------------------------------------------


def test_manifest_of_real_files(tmp_path: Path) -> None:
    sizes = {"config.json": 321, "model.safetensors": 5 * CS + 11, "sub/empty.txt": 0}
    files = []
    for rel, size in sizes.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(os.urandom(size))
        files.append({"path": rel, "size": size, "chunks": file_digests(p, CS)})
    m = Manifest.from_json(_bytes(full_dict(files=files)), expect_identity="step000002")
    # Every chunk ref points at bytes whose digest the manifest lists.
    for ref in m.stored_chunks():
        with open(tmp_path / ref.path, "rb") as f:
            f.seek(ref.offset)
            assert digest(f.read(ref.length)) == ref.digest
    assert m.stored_bytes == sum(sizes.values())


# ---- round trips ---------------------------------------------------------------------------


def test_full_round_trip() -> None:
    m = Manifest.from_json(_bytes(full_dict()))
    assert m.kind == "full" and not m.is_delta
    assert m.identity == "step000002" and m.policy_version == 2 and m.chunk_size == CS
    assert m.base_identity is None and m.compression_format is None and m.checksum_format is None
    assert all(f.result is None and not f.is_diff for f in m.files)
    text = m.to_json()
    assert Manifest.from_json(text) == m
    assert Manifest.from_json(text.decode()) == m  # str accepted too
    assert Manifest.from_json(text).to_json() == text  # canonical
    assert text.endswith(b"\n")
    assert json.loads(text) == full_dict()


def test_full_round_trip_of_constructed_manifest() -> None:
    m = Manifest(
        identity="a1",
        kind="full",
        policy_version=0,
        chunk_size=CS,
        files=(FileEntry("w.safetensors", CS + 1, (D, D)),),
    )
    back = Manifest.from_json(m.to_json())
    assert back == m
    assert back.created_at == ""


def test_delta_round_trip() -> None:
    m = Manifest.from_json(_bytes(delta_dict()), expect_identity="step000003")
    assert m.is_delta and m.base_identity == "step000002"
    assert m.compression_format == "arc_v2" and m.checksum_format == "alder32"
    st_file = m.file("model.safetensors")
    assert st_file.is_diff and st_file.result == FileResult(5 * CS, (D,) * 5)
    assert st_file.result_size == 5 * CS and st_file.size == CS + 1
    cfg = m.file("config.json")
    assert not cfg.is_diff and cfg.result_chunks == cfg.chunks and cfg.result_size == cfg.size
    text = m.to_json()
    assert Manifest.from_json(text) == m
    assert Manifest.from_json(text).to_json() == text
    assert json.loads(text) == delta_dict()


def test_delta_arc_v1_zlib_accepted() -> None:
    Manifest.from_json(_bytes(delta_dict(compression_format="arc_v1")))


def test_delta_compression_format_stored_in_one_spelling() -> None:
    m = Manifest.from_json(_bytes(delta_dict(compression_format="ARC_V2")))
    assert m.compression_format == "arc_v2"


def test_file_lookup() -> None:
    m = Manifest.from_json(_bytes(full_dict()))
    assert m.file("config.json").size == 100
    with pytest.raises(KeyError):
        m.file("nope.json")


def test_optional_created_at_may_be_absent() -> None:
    d = full_dict()
    del d["created_at"]
    assert Manifest.from_json(_bytes(d)).created_at == ""


def test_unknown_keys_are_ignored_for_forward_compatibility() -> None:
    d = full_dict(publisher="bdn 0.2")
    d["files"][0]["mode"] = 420
    assert Manifest.from_json(_bytes(d)) == Manifest.from_json(_bytes(full_dict()))


# ---- chunk tables --------------------------------------------------------------------------


def test_stored_chunks_offsets_and_lengths() -> None:
    m = Manifest.from_json(_bytes(full_dict()))
    refs = list(m.stored_chunks())
    assert len(refs) == 1 + 3 + 3 + 0
    by_file: dict[str, list[ChunkRef]] = {}
    for r in refs:
        by_file.setdefault(r.path, []).append(r)
        f = m.files[r.file_index]
        assert f.path == r.path
        assert (r.offset, r.length) == chunk_range(f.size, CS, r.index)
        assert r.digest == f.chunks[r.index]
    assert [(r.offset, r.length) for r in by_file["config.json"]] == [(0, 100)]
    assert [(r.offset, r.length) for r in by_file["model-00002-of-00002.safetensors"]] == [
        (0, CS),
        (CS, CS),
        (2 * CS, 7),
    ]
    assert "tokenizer/tokenizer.json" not in by_file  # empty file: no chunks
    # Manifest order (the order of have-bitfields): file by file, chunk by chunk.
    assert [(r.file_index, r.index) for r in refs] == sorted((r.file_index, r.index) for r in refs)
    assert m.stored_bytes == 100 + 3 * CS + 2 * CS + 7
    assert list(m.result_chunks()) == refs  # full snapshot: stored = result
    assert m.result_bytes == m.stored_bytes


def test_result_chunks_of_delta() -> None:
    m = Manifest.from_json(_bytes(delta_dict()))
    stored = list(m.stored_chunks())
    assert [(r.path, r.offset, r.length) for r in stored] == [
        ("config.json", 0, 100),
        ("model.safetensors", 0, CS),
        ("model.safetensors", CS, 1),
    ]
    result = list(m.result_chunks())
    assert [(r.path, r.index, r.offset, r.length) for r in result] == [
        ("config.json", 0, 0, 100),
        *[("model.safetensors", i, i * CS, CS) for i in range(5)],
    ]
    assert m.stored_bytes == 100 + CS + 1
    assert m.result_bytes == 100 + 5 * CS


# ---- validation rules ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"{",
        b"not json",
        b"\xff\xfe\x00",
        b"{'a': 1}",
        b"[1,]",
        b"NaN x",
        '{"a": \ud800'.encode("utf-8", "surrogatepass"),
    ],
)
def test_bad_json(data: bytes) -> None:
    _refused(data, "not valid JSON")


def test_deeply_nested_json_is_manifest_error() -> None:
    _refused(b"[" * 100_000 + b"]" * 100_000, "not valid JSON")
    _refused(b'{"a":' * 50_000, "not valid JSON")


@pytest.mark.parametrize("value", [[], "x", 1, None, True])
def test_not_an_object(value: Any) -> None:
    _refused(json.dumps(value).encode(), "JSON object")


@pytest.mark.parametrize("fmt", [None, "bdn.snapshot/2", "BDN.SNAPSHOT/1", 1])
def test_wrong_format(fmt: Any) -> None:
    d = full_dict(format=fmt)
    if fmt is None:
        del d["format"]
    _refused(d, "format", FORMAT)


@pytest.mark.parametrize("identity", [None, "", "../etc", "a/b", "latest", "STARTUP_SNAPSHOT", 5, "a" * 129])
def test_bad_identity(identity: Any) -> None:
    _refused(full_dict(identity=identity), "identity")


@pytest.mark.parametrize("kind", [None, "Full", "anchor", "", 1, ["full"]])
def test_bad_kind(kind: Any) -> None:
    _refused(full_dict(kind=kind), "kind")


@pytest.mark.parametrize("pv", [True, False, -1, 1.0, "2", None, 2**63, [2]])
def test_bad_policy_version(pv: Any) -> None:
    _refused(full_dict(policy_version=pv), "policy_version")


def test_policy_version_limits_accepted() -> None:
    assert Manifest.from_json(_bytes(full_dict(policy_version=0))).policy_version == 0
    big = 2**63 - 1
    assert Manifest.from_json(_bytes(full_dict(policy_version=big))).policy_version == big


@pytest.mark.parametrize("cs", [True, 0, -1, CS - 1, (1 << 30) + 1, 4096.0, "4096"])
def test_bad_chunk_size(cs: Any) -> None:
    _refused(full_dict(chunk_size=cs), "chunk_size")


@pytest.mark.parametrize("created", [1, None, ["x"], "x" * 65])
def test_bad_created_at(created: Any) -> None:
    _refused(full_dict(created_at=created), "created_at")


@pytest.mark.parametrize("files", [None, [], {}, "config.json", 3])
def test_bad_files_list(files: Any) -> None:
    _refused(full_dict(files=files), "files")


@pytest.mark.parametrize("item", [None, "config.json", [1], 1])
def test_file_item_not_an_object(item: Any) -> None:
    d = full_dict()
    d["files"].append(item)
    _refused(d, "files[4]")


def test_too_many_files() -> None:
    files = [_entry(f"f{i}", 0) for i in range(manifest_mod.MAX_FILES + 1)]
    _refused(full_dict(files=files), "files", str(manifest_mod.MAX_FILES))


def test_too_many_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(manifest_mod, "MAX_TOTAL_CHUNKS", 6)
    _refused(full_dict(), "more than 6 chunks")


@pytest.mark.parametrize(
    ("size", "n"),
    [(100, 0), (100, 2), (0, 1), (3 * CS, 2), (3 * CS, 4), (3 * CS + 1, 3)],
)
def test_chunk_count_not_matching_size(size: int, n: int) -> None:
    d = full_dict()
    d["files"][0] = _entry("config.json", size, [D] * n)
    _refused(d, "config.json", "chunks listed", "expected")


@pytest.mark.parametrize("size", [-1, True, 1.5, "100", None, (1 << 50) + 1])
def test_bad_size(size: Any) -> None:
    d = full_dict()
    d["files"][0] = {"path": "config.json", "size": size, "chunks": [D]}
    _refused(d, "config.json", "size")


@pytest.mark.parametrize("chunks", [None, "abc", {D: 1}, D])
def test_chunks_not_a_list(chunks: Any) -> None:
    d = full_dict()
    d["files"][0]["chunks"] = chunks
    _refused(d, "config.json", "chunks must be a list")


@pytest.mark.parametrize(
    "bad",
    [D.upper(), D[:-1], D + "0", "g" * 32, " " + D[1:], D[:-1] + "\n", 1, None, ["x"], ""],
)
def test_bad_digest(bad: Any) -> None:
    d = full_dict()
    d["files"][1]["chunks"][1] = bad
    _refused(d, "model-00001-of-00002.safetensors", "digest")


def test_duplicate_path() -> None:
    d = full_dict()
    d["files"].append(_entry("config.json", 100))
    _refused(d, "'config.json' twice")


@pytest.mark.parametrize(
    ("path", "rule"),
    [
        ("../config.json", "'..'"),
        ("a/../../b", "'..'"),
        ("/etc/passwd", "absolute"),
        ("a//b", "empty"),
        ("./a", "'.'"),
        ("a\\b", "backslash"),
        ("a\x00b", "NUL"),
        ("", "empty"),
        (None, "string"),
        (7, "string"),
        ("x" * 1025, "longer"),
        ("\ud800", "UTF-8"),
    ],
)
def test_bad_path(path: Any, rule: str) -> None:
    d = full_dict()
    d["files"][0]["path"] = path
    data = json.dumps(d).encode()  # json escapes the lone surrogate as \ud800
    _refused(data, "path", rule)


def test_manifest_listing_itself() -> None:
    d = full_dict()
    d["files"].append(_entry(MANIFEST_NAME, 10))
    _refused(d, "itself")


def test_nested_file_named_like_the_manifest_is_fine() -> None:
    d = full_dict()
    d["files"].append(_entry(f"extras/{MANIFEST_NAME}", 10))
    Manifest.from_json(_bytes(d))


@pytest.mark.parametrize(
    "paths",
    [["a", "a/b"], ["a/b", "a"], ["x/y/z", "x/y"], ["x/y", "x/y/z/w"], ["t/config.json", "t"]],
)
def test_file_and_directory_clash(paths: list[str]) -> None:
    d = full_dict(files=[_entry(p, 1) for p in paths])
    _refused(d, repr(paths[1]), "clashes")


def test_siblings_sharing_a_prefix_are_fine() -> None:
    d = full_dict(files=[_entry(p, 1) for p in ["a", "ab", "a.b/c", "abc/d", "abc/e/f", "abc/e/g"]])
    assert len(Manifest.from_json(_bytes(d)).files) == 6


def test_deep_paths_are_checked_in_linear_time() -> None:
    # 2000 files of ~1 KiB paths with ~500 segments each: a prefix set would build ~0.5 GB.
    files = [_entry(f"{i:04d}/" + "a/" * 508 + "z", 0) for i in range(2000)]
    assert len(Manifest.from_json(_bytes(full_dict(files=files))).files) == 2000


def test_delta_without_base() -> None:
    d = delta_dict()
    del d["base_identity"]
    _refused(d, "base_identity")


@pytest.mark.parametrize("base", ["", "a/b", "latest", 3, ".."])
def test_delta_bad_base(base: Any) -> None:
    _refused(delta_dict(base_identity=base), "base_identity")


def test_delta_base_is_itself() -> None:
    _refused(delta_dict(base_identity="step000003"), "'step000003'", "base")


def test_delta_safetensors_file_without_result() -> None:
    d = delta_dict()
    del d["files"][1]["result"]
    _refused(d, "model.safetensors", "result")
    d["files"][1]["result"] = None
    _refused(d, "model.safetensors", "result")


@pytest.mark.parametrize(
    "result",
    [
        [],
        "x",
        1,
        {},
        {"size": 5 * CS},
        {"size": -1, "chunks": []},
        {"size": 5 * CS, "chunks": [D] * 4},
        {"size": 5 * CS, "chunks": [D] * 4 + ["XYZ"]},
        {"size": True, "chunks": []},
    ],
)
def test_delta_bad_result(result: Any) -> None:
    d = delta_dict()
    d["files"][1]["result"] = result
    _refused(d, "model.safetensors")


def test_full_with_result() -> None:
    d = full_dict()
    d["files"][0]["result"] = {"size": 100, "chunks": [D]}
    _refused(d, "config.json", "only a delta")


@pytest.mark.parametrize(
    ("key", "value"),
    [("base_identity", "step000001"), ("compression_format", "arc_v2"), ("checksum_format", "alder32")],
)
def test_full_with_delta_fields(key: str, value: str) -> None:
    _refused(full_dict(**{key: value}), key)


@pytest.mark.parametrize(
    "over",
    [
        {"compression_format": "arc_v3"},
        {"compression_format": None},
        {"compression_format": ["arc_v2"]},
        {"compression_format": {"arc_v2": 1}},
        {"checksum_format": "crc32"},
        {"checksum_format": None},
        {"checksum_format": ["alder32"]},
    ],
)
def test_delta_unsupported_formats(over: dict[str, Any]) -> None:
    _refused(delta_dict(**over))


@pytest.mark.parametrize("key", ["compression_format", "checksum_format"])
def test_delta_missing_format_field(key: str) -> None:
    d = delta_dict()
    del d[key]
    _refused(d, key)


def test_delta_unsupported_compression_names_supported_ones() -> None:
    msg = _refused(delta_dict(compression_format="arc_v3"), "arc_v3")
    assert "arc_v2" in msg and "arc_v1" in msg


def test_expect_identity_mismatch() -> None:
    data = _bytes(full_dict())
    assert Manifest.from_json(data, expect_identity="step000002").identity == "step000002"
    _refused(data, "'step000002'", "'step000001'", expect_identity="step000001")


def test_oversize_refused_before_parsing() -> None:
    data = b" " * (MAX_MANIFEST_BYTES + 1)
    _refused(data, "limit", str(MAX_MANIFEST_BYTES))


def test_non_manifest_protocol_errors_are_wrapped() -> None:
    # from_json's contract is ManifestError alone (IdentityError/PathError become ManifestError).
    for d in (full_dict(identity="../x"), full_dict(files=[_entry("../x", 0)])):
        with pytest.raises(ManifestError) as ei:
            Manifest.from_json(_bytes(d))
        assert type(ei.value) is ManifestError


# ---- hypothesis: nothing but ManifestError escapes -----------------------------------------

_json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
    st.sampled_from(["full", "delta", FORMAT, "step000001", "arc_v2", "alder32", D, "a/b", ".."]),
)
_json_values = st.recursive(
    _json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=12), inner, max_size=5)),
    max_leaves=20,
)


def _check_only_manifest_error(data: bytes | str) -> None:
    try:
        m = Manifest.from_json(data)
    except ManifestError as e:
        assert "\n" not in str(e)
        return
    # Whatever parses must survive its own round trip.
    assert Manifest.from_json(m.to_json()) == m


@settings(max_examples=400)
@given(st.binary(max_size=300))
def test_property_arbitrary_bytes(data: bytes) -> None:
    _check_only_manifest_error(data)


@settings(max_examples=300)
@given(_json_values)
def test_property_arbitrary_json(value: Any) -> None:
    _check_only_manifest_error(json.dumps(value))


_FILE_KEYS = ["path", "size", "chunks", "result"]
_TOP_KEYS = [
    "format",
    "identity",
    "kind",
    "policy_version",
    "chunk_size",
    "created_at",
    "files",
    "base_identity",
    "compression_format",
    "checksum_format",
]


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(
    base=st.sampled_from(["full", "delta"]),
    where=st.sampled_from(["top", "file", "result"]),
    key=st.sampled_from(sorted(set(_TOP_KEYS + _FILE_KEYS))),
    value=_json_values,
    delete=st.booleans(),
)
def test_property_mutated_manifest(base: str, where: str, key: str, value: Any, delete: bool) -> None:
    """One field of a valid manifest replaced by arbitrary JSON, or deleted."""
    d = copy.deepcopy(full_dict() if base == "full" else delta_dict())
    target: dict[str, Any]
    if where == "top":
        target = d
    elif where == "file":
        target = d["files"][-1]
    else:
        target = d["files"][-1].setdefault("result", {"size": 1, "chunks": [D]})
    if delete:
        target.pop(key, None)
    else:
        target[key] = value
    _check_only_manifest_error(json.dumps(d))


@settings(max_examples=200)
@given(st.text(max_size=80))
def test_property_arbitrary_text(text: str) -> None:
    _check_only_manifest_error(text)


# ---- STARTUP_SNAPSHOT ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "want"),
    [
        (b"step000002\n", "step000002"),
        (b"step000002", "step000002"),
        (b"step000002\r\n", "step000002"),
        (b"  step000002 \n\n", "step000002"),
        (b"a", "a"),
    ],
)
def test_parse_startup(data: bytes, want: str) -> None:
    assert parse_startup(data) == want


@pytest.mark.parametrize(
    "data",
    [b"", b"\n", b"latest\n", b"STARTUP_SNAPSHOT\n", b"../x\n", b"a/b\n", b"step1\nstep2\n", b"st ep\n", b".x\n"],
)
def test_parse_startup_bad_identity(data: bytes) -> None:
    with pytest.raises(IdentityError):
        parse_startup(data)


@pytest.mark.parametrize("data", [b"\xff\xfe", b"step\xc3", b"a" * 1025])
def test_parse_startup_not_text_or_too_long(data: bytes) -> None:
    with pytest.raises(ProtocolError) as ei:
        parse_startup(data)
    assert "STARTUP_SNAPSHOT" in str(ei.value)


@given(st.binary(max_size=200))
def test_property_parse_startup_only_protocol_error(data: bytes) -> None:
    try:
        out = parse_startup(data)
    except ProtocolError as e:
        assert "\n" not in str(e)
        return
    assert out.encode() in data
