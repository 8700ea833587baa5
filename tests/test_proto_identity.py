"""Tests for bdn.proto.identity: snapshot identities and relative file paths (DESIGN.md, "Bucket layout")."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bdn.proto.errors import IdentityError, PathError, ProtocolError
from bdn.proto.identity import (
    IDENTITY_RULE,
    MAX_PATH_BYTES,
    RESERVED_IDENTITIES,
    validate_identity,
    validate_relpath,
)

_ID_FIRST = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
_ID_REST = _ID_FIRST + "._-"


# ---- identities ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "identity",
    [
        "step000002",
        "a",
        "0",
        "Z9",
        "step-1",
        "step_1",
        "run.7.step.12",
        "a..b",  # '..' inside a segment is harmless: only the whole segment is special
        "a" * 128,
        "Latest",  # reserved names are case-sensitive (S3 keys are)
        "startup_snapshot",
        "x-",
        "x.",
    ],
)
def test_valid_identities_pass(identity: str) -> None:
    assert validate_identity(identity) == identity


@pytest.mark.parametrize("identity", sorted(RESERVED_IDENTITIES))
def test_reserved_identities_refused(identity: str) -> None:
    with pytest.raises(IdentityError, match="reserved"):
        validate_identity(identity)


def test_reserved_set_matches_design() -> None:
    assert RESERVED_IDENTITIES == {"STARTUP_SNAPSHOT", "latest", "current", ".", ".."}


@pytest.mark.parametrize("identity", ["/", "a/b", "/a", "a/", "a\\b", "..\\x"])
def test_identity_with_separator_names_the_segment_rule(identity: str) -> None:
    with pytest.raises(IdentityError, match="one path segment"):
        validate_identity(identity)


@pytest.mark.parametrize(
    "identity",
    [
        "",
        "a" * 129,
        ".hidden",
        "-rf",
        "_x",
        "step 1",
        "step\n",
        "\nstep",
        "step\x00",
        "stép",
        "шаг1",
        "step１",  # fullwidth digit
        "a:b",
        "a*",
        "a~",
    ],
)
def test_identity_breaking_the_pattern_names_the_rule(identity: str) -> None:
    with pytest.raises(IdentityError) as ei:
        validate_identity(identity)
    assert IDENTITY_RULE in str(ei.value)


@pytest.mark.parametrize("value", [None, 1, 1.5, b"step1", ["step1"], {"a": 1}, True])
def test_identity_non_string_refused(value: object) -> None:
    with pytest.raises(IdentityError, match="must be a string"):
        validate_identity(value)


def test_identity_error_is_a_protocol_error_with_one_line() -> None:
    with pytest.raises(ProtocolError) as ei:
        validate_identity("bad\nname/with\nlines" * 50)
    msg = str(ei.value)
    assert "\n" not in msg
    assert len(msg) < 400  # long hostile input is cut, not echoed whole


@given(
    st.text(alphabet=_ID_FIRST, min_size=1, max_size=1).flatmap(
        lambda first: st.text(alphabet=_ID_REST, max_size=127).map(lambda rest: first + rest)
    )
)
def test_identity_property_every_pattern_match_passes(identity: str) -> None:
    if identity in RESERVED_IDENTITIES:
        return
    assert validate_identity(identity) == identity


@settings(max_examples=500)
@given(st.one_of(st.text(), st.binary(), st.integers(), st.none(), st.floats(), st.lists(st.text())))
def test_identity_property_only_identity_error(value: object) -> None:
    try:
        out = validate_identity(value)
    except IdentityError as e:
        assert "\n" not in str(e)
        return
    # Whatever passes is exactly the documented rule and not reserved.
    assert isinstance(out, str)
    assert re.fullmatch(IDENTITY_RULE, out, flags=re.ASCII)
    assert out not in RESERVED_IDENTITIES


# ---- relative paths -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "config.json",
        "model-00001-of-00002.safetensors",
        "tokenizer/vocab.json",
        "a/b/c/d.bin",
        ".gitattributes",  # leading dot is a normal file name
        "a/.hidden",
        "a..b/c",
        "ünïcode/файл.txt",
        "x" * MAX_PATH_BYTES,
        "with space/and,comma",
    ],
)
def test_valid_relpaths_pass(path: str) -> None:
    assert validate_relpath(path) == path


@pytest.mark.parametrize(
    ("path", "rule"),
    [
        ("", "empty"),
        ("/etc/passwd", "absolute"),
        ("/", "absolute"),
        ("..", "'..'"),
        ("../x", "'..'"),
        ("a/../../x", "'..'"),
        ("a/..", "'..'"),
        (".", "'.'"),
        ("./a", "'.'"),
        ("a//b", "empty"),
        ("a/", "empty"),
        ("a/b\x00c", "NUL"),
        ("\x00", "NUL"),
        ("a\\b", "backslash"),
        ("..\\..\\windows", "backslash"),
        ("x" * (MAX_PATH_BYTES + 1), "longer than"),
        ("é" * (MAX_PATH_BYTES // 2 + 1), "longer than"),  # the limit is in bytes, not chars
        ("a/\ud800", "UTF-8"),  # a lone surrogate that JSON can carry
    ],
)
def test_bad_relpaths_refused_naming_the_rule(path: str, rule: str) -> None:
    with pytest.raises(PathError) as ei:
        validate_relpath(path)
    msg = str(ei.value)
    assert rule in msg
    assert "\n" not in msg


@pytest.mark.parametrize("value", [None, 3, b"a/b", ["a"], {"path": "a"}])
def test_relpath_non_string_refused(value: object) -> None:
    with pytest.raises(PathError, match="must be a string"):
        validate_relpath(value)


@settings(max_examples=500)
@given(st.one_of(st.text(), st.text(alphabet="./\\a\x00é"), st.binary(), st.integers(), st.none()))
def test_relpath_property_only_path_error(value: object) -> None:
    try:
        out = validate_relpath(value)
    except PathError as e:
        assert "\n" not in str(e)
        return
    assert isinstance(out, str)
    encoded = out.encode("utf-8")  # must not raise: every accepted path is storable
    assert 0 < len(encoded) <= MAX_PATH_BYTES
    assert not out.startswith("/")
    assert "\x00" not in out and "\\" not in out
    assert all(part not in ("", ".", "..") for part in out.split("/"))
