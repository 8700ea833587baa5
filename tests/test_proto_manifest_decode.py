"""The windowed decode of a manifest's chunk lists (bdn/proto/manifest.py, ``decode_manifest_json``):
the same value as a plain JSON parse for every valid document, a refusal for every broken one,
whatever the window size (a small window here cuts the lists into many pieces)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bdn.proto import manifest as mf
from bdn.proto.errors import ManifestError, ProtocolError


@pytest.fixture(autouse=True)
def small_window(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mf, "DECODE_WINDOW", 40)


def _doc(n: int, indent: int | None = 1) -> bytes:
    files = [
        {"path": "a.bin", "size": n * 4096, "chunks": [f"{c:032x}" for c in range(n)]},
        {
            "path": "b.safetensors",
            "size": 1,
            "chunks": ["f" * 32],
            "result": {"size": 4096 * n, "chunks": [f"{c + 7:032x}" for c in range(n)]},
        },
    ]
    return json.dumps(
        {
            "format": "bdn.snapshot/1",
            "identity": "s1",
            "kind": "delta",
            "policy_version": 1,
            "chunk_size": 4096,
            "base_identity": "s0",
            "compression_format": "arc_v2",
            "checksum_format": "alder32",
            "files": files,
        },
        indent=indent,
    ).encode()


@settings(max_examples=25, deadline=None)
@given(n=st.integers(0, 200), indent=st.sampled_from([None, 0, 1, 3]))
def test_same_value_as_json(n: int, indent: int | None) -> None:
    data = _doc(n, indent)
    assert mf.decode_manifest_json(data) == json.loads(data)


@pytest.mark.parametrize(
    "broken",
    [
        b'["' + b"a" * 32 + b'",]',  # trailing comma
        b'["' + b"a" * 32 + b'", ,"' + b"b" * 32 + b'"]',  # a stray comma
        b'[,"' + b"a" * 32 + b'"]',  # a leading comma
        b'["' + b"a" * 20 + b"," + b"b" * 40 + b'"]',  # a comma inside a string, past the window
        b'[["' + b"a" * 32 + b'", "' + b"b" * 32 + b'"], "' + b"c" * 32 + b'"]',  # nested
    ],
)
def test_broken_chunk_lists_are_refused(broken: bytes) -> None:
    data = b'{"format": "bdn.snapshot/1", "files": [{"path": "a", "size": 1, "chunks": ' + broken + b"}]}"
    try:
        obj = mf.decode_manifest_json(data)
    except ManifestError as e:
        assert "not valid JSON" in str(e)
        return
    # JSON-valid (the nested case): the same value as json, and the manifest rules refuse it.
    assert obj == json.loads(data)
    with pytest.raises(ProtocolError):
        mf.Manifest.from_dict(obj)


def test_a_comma_inside_a_string_is_never_a_cut() -> None:
    """A cut inside a string fails that piece: refused, never split into several elements (such
    a string is no digest anyway); within one window it decodes as one element."""
    data = b'{"format": "bdn.snapshot/1", "files": [{"path": "a", "size": 1, "chunks": ["' + b"a," * 40 + b'"]}]}'
    with pytest.raises(ManifestError, match="not valid JSON"):
        mf.decode_manifest_json(data)
    short = b'{"format": "bdn.snapshot/1", "files": [{"path": "a", "size": 1, "chunks": ["a,b", "c"]}]}'
    assert mf.decode_manifest_json(short)["files"][0]["chunks"] == ["a,b", "c"]


def test_a_large_manifest_parses_to_the_same_manifest() -> None:
    data = _doc(5000)
    m = mf.Manifest.from_json(data)
    assert m.files[0].chunks == tuple(f"{c:032x}" for c in range(5000))
    assert m.files[1].result is not None and len(m.files[1].result.chunks) == 5000
