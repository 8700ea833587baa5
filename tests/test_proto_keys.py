"""Tests for bdn.proto.keys: HKDF (RFC 5869), swarm keys, chunk addresses, request signatures."""

from __future__ import annotations

import hashlib
import hmac
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bdn.control.replay import Counters
from bdn.daemon.swarm.nonces import NonceCache
from bdn.proto.errors import AuthError, BdnError
from bdn.proto.keys import (
    MAX_SKEW_S,
    MIN_SECRET_CHARS,
    UNKNOWN_TARGET,
    SwarmKeys,
    WrongTarget,
    derive_keys,
    hkdf_expand,
    hkdf_extract,
    hkdf_sha256,
    sign_request,
    verify_request,
)

SECRET = "3f1c0e9a8b7d6c5e4f3a2b1c0d9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a4b3c2d1e"
OTHER_SECRET = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
NOW = 1_780_000_000.0
PATH = "/bdn/v1/0011223344556677/chunks/00112233445566778899aabbccddeeff?wait=5"
ME = "node-b"  # the daemon every request in these tests is for

# ---- RFC 5869 appendix A (HKDF-SHA256), test cases 1-3 -------------------------------------

RFC5869_CASES = [
    pytest.param(
        "0b" * 22,
        "000102030405060708090a0b0c",
        "f0f1f2f3f4f5f6f7f8f9",
        42,
        "077709362c2e32df0ddc3f0dc47bba6390b6c73bb50f9c3122ec844ad7c2b3e5",
        "3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf34007208d5b887185865",
        id="A.1-basic",
    ),
    pytest.param(
        bytes(range(0x00, 0x50)).hex(),
        bytes(range(0x60, 0xB0)).hex(),
        bytes(range(0xB0, 0x100)).hex(),
        82,
        "06a6b88c5853361a06104c9ceb35b45cef760014904671014a193f40c15fc244",
        "b11e398dc80327a1c8e7f78c596a49344f012eda2d4efad8a050cc4c19afa97c"
        "59045a99cac7827271cb41c65e590e09da3275600c2f09b8367793a9aca3db71"
        "cc30c58179ec3e87c14c01d5c1f3434f1d87",
        id="A.2-long",
    ),
    pytest.param(
        "0b" * 22,
        "",
        "",
        42,
        "19ef24a32c717b167f33a91d6f648bdf96596776afdb6377ac434c1c293ccb04",
        "8da4e775a563c18f715f802a063c5a31b8a11f5c5ee1879ec3454e5f3c738d2d9d201395faa4b61a96c8",
        id="A.3-empty-salt-info",
    ),
]


@pytest.mark.parametrize(("ikm", "salt", "info", "length", "prk", "okm"), RFC5869_CASES)
def test_hkdf_rfc5869_vectors(ikm: str, salt: str, info: str, length: int, prk: str, okm: str) -> None:
    ikm_b, salt_b, info_b = bytes.fromhex(ikm), bytes.fromhex(salt), bytes.fromhex(info)
    assert len(bytes.fromhex(okm)) == length
    assert hkdf_extract(salt_b, ikm_b).hex() == prk
    assert hkdf_expand(bytes.fromhex(prk), info_b, length).hex() == okm
    assert hkdf_sha256(ikm_b, salt_b, info_b, length).hex() == okm


@pytest.mark.parametrize("length", [0, -1, 255 * 32 + 1])
def test_hkdf_expand_length_limits(length: int) -> None:
    with pytest.raises(ValueError):
        hkdf_expand(b"k" * 32, b"", length)


def test_hkdf_expand_max_length_and_prefix_property() -> None:
    prk = hkdf_extract(b"salt", b"ikm")
    full = hkdf_expand(prk, b"info", 255 * 32)
    assert len(full) == 255 * 32
    # OKM of a shorter length is a prefix of a longer one (T(1) | T(2) | ...).
    assert hkdf_expand(prk, b"info", 33) == full[:33]


# ---- derive_keys ---------------------------------------------------------------------------


def test_derive_keys_deterministic() -> None:
    a, b = derive_keys(SECRET), derive_keys(SECRET)
    assert a == b
    assert a.swarm_id == b.swarm_id and a.auth_key == b.auth_key and a.address_key == b.address_key


def test_derive_keys_shapes() -> None:
    k = derive_keys(SECRET)
    assert re.fullmatch(r"[0-9a-f]{16}", k.swarm_id)
    assert len(k.auth_key) == 32 and len(k.address_key) == 32
    assert k.auth_key != k.address_key  # distinct HKDF info strings


def test_derive_keys_str_bytes_and_whitespace_agree() -> None:
    k = derive_keys(SECRET)
    assert derive_keys(SECRET.encode()) == k
    assert derive_keys(bytearray(SECRET.encode())) == k
    assert derive_keys(f"  {SECRET}\n") == k  # as read from a file with a trailing newline


def test_different_secrets_differ_everywhere() -> None:
    a, b = derive_keys(SECRET), derive_keys(OTHER_SECRET)
    assert a.swarm_id != b.swarm_id
    assert a.auth_key != b.auth_key
    assert a.address_key != b.address_key
    d = "00112233445566778899aabbccddeeff"
    assert a.address(d) != b.address(d)


def test_swarm_keys_repr_hides_keys() -> None:
    k = derive_keys(SECRET)
    text = repr(k)
    assert k.swarm_id in text
    assert k.auth_key.hex() not in text and repr(k.auth_key) not in text
    assert k.address_key.hex() not in text and repr(k.address_key) not in text


@pytest.mark.parametrize("secret", ["", "short", "x" * (MIN_SECRET_CHARS - 1), "   " + "y" * 15 + "\n"])
def test_short_secret_refused(secret: str) -> None:
    with pytest.raises(BdnError, match="at least 16"):
        derive_keys(secret)


def test_secret_of_exactly_min_length_accepted() -> None:
    derive_keys("z" * MIN_SECRET_CHARS)


def test_address_is_32_hex_and_hmac_of_digest() -> None:
    k = derive_keys(SECRET)
    d = "99aa06d3014798d86001c324468d497f"
    addr = k.address(d)
    assert re.fullmatch(r"[0-9a-f]{32}", addr)
    assert addr == hmac.new(k.address_key, d.encode(), hashlib.sha256).hexdigest()[:32]
    assert addr != d
    assert k.address("0" * 32) != addr


@settings(max_examples=200)
@given(st.text(alphabet="0123456789abcdef", min_size=32, max_size=32))
def test_address_property_shape(d: str) -> None:
    assert re.fullmatch(r"[0-9a-f]{32}", derive_keys(SECRET).address(d))


# ---- signatures ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keys() -> SwarmKeys:
    return derive_keys(SECRET)


def _parse(header: str) -> dict[str, str]:
    scheme, _, rest = header.partition(" ")
    assert scheme == "BDN-HMAC"
    return dict(part.split("=", 1) for part in rest.split(", "))


def _build(fields: dict[str, str]) -> str:
    return "BDN-HMAC " + ", ".join(f"{k}={fields[k]}" for k in ("node", "to", "ts", "nonce", "sig"))


def test_sign_verify_round_trip(keys: SwarmKeys) -> None:
    h = sign_request(keys, "GET", PATH, "node-a.example:7070", to=ME, now=NOW)
    assert verify_request(keys, h, "GET", PATH, NonceCache(), me=ME, now=NOW) == "node-a.example:7070"


def test_header_shape(keys: SwarmKeys) -> None:
    h = sign_request(keys, "POST", "/bdn/v1/x/members", "n1", to=ME, now=NOW)
    f = _parse(h)
    assert f["node"] == "n1"
    assert f["ts"] == str(int(NOW))
    assert re.fullmatch(r"[0-9a-f]{32}", f["nonce"])
    assert re.fullmatch(r"[0-9a-f]{64}", f["sig"])


def test_method_case_is_normalised(keys: SwarmKeys) -> None:
    h = sign_request(keys, "get", PATH, "n1", to=ME, now=NOW)
    assert verify_request(keys, h, "GET", PATH, NonceCache(), me=ME, now=NOW) == "n1"


def test_each_signature_uses_a_fresh_nonce(keys: SwarmKeys) -> None:
    nonces = {_parse(sign_request(keys, "GET", PATH, "n1", to=ME, now=NOW))["nonce"] for _ in range(50)}
    assert len(nonces) == 50


def test_skew_within_30s_accepted(keys: SwarmKeys) -> None:
    cache = NonceCache()
    for delta in (-MAX_SKEW_S, -1, 0, 1, MAX_SKEW_S):
        h = sign_request(keys, "GET", PATH, "n1", to=ME, now=NOW + delta)
        assert verify_request(keys, h, "GET", PATH, cache, me=ME, now=NOW) == "n1"


@pytest.mark.parametrize("delta", [-(MAX_SKEW_S + 1), MAX_SKEW_S + 1, -3600, 3600])
def test_skew_over_30s_refused(keys: SwarmKeys, delta: int) -> None:
    h = sign_request(keys, "GET", PATH, "n1", to=ME, now=NOW + delta)
    with pytest.raises(AuthError):
        verify_request(keys, h, "GET", PATH, NonceCache(), me=ME, now=NOW)


def test_replayed_nonce_refused(keys: SwarmKeys) -> None:
    cache = NonceCache()
    h = sign_request(keys, "GET", PATH, "n1", to=ME, now=NOW)
    verify_request(keys, h, "GET", PATH, cache, me=ME, now=NOW)
    with pytest.raises(AuthError):
        verify_request(keys, h, "GET", PATH, cache, me=ME, now=NOW + 1)
    # Still refused at the edge of the skew window, where the header itself is still fresh.
    with pytest.raises(AuthError):
        verify_request(keys, h, "GET", PATH, cache, me=ME, now=NOW + MAX_SKEW_S)


def test_rejected_request_does_not_burn_its_nonce(keys: SwarmKeys) -> None:
    # A forged request with a victim's nonce must not make the victim's real request a "replay".
    cache = NonceCache()
    good = sign_request(keys, "GET", PATH, "n1", to=ME, now=NOW)
    f = _parse(good)
    forged = _build({**f, "sig": "0" * 64})
    with pytest.raises(AuthError):
        verify_request(keys, forged, "GET", PATH, cache, me=ME, now=NOW)
    assert verify_request(keys, good, "GET", PATH, cache, me=ME, now=NOW) == "n1"


def test_replay_windows_never_fill_under_load(keys: SwarmKeys) -> None:
    """The former nonce table was full at a million nonces (~17,000 requests/s for 60 s) and then
    refused everything; the windows hold per signer, whatever the rate."""
    cache = NonceCache(window=64)
    for _ in range(20_000):
        h = sign_request(keys, "GET", PATH, "n1", to=ME, now=NOW)
        assert verify_request(keys, h, "GET", PATH, cache, me=ME, now=NOW) == "n1"
    assert len(cache) == 1 and cache.state_bytes() < 1024


def test_replay_windows_refuse_a_replay_out_of_order_once_and_too_old() -> None:
    ctr = Counters(lambda: NOW)
    first, second = ctr.next("me"), ctr.next("me")
    c = NonceCache(window=64)
    assert c.add(second, NOW, "n1", NOW) and c.add(first, NOW, "n1", NOW)  # out of order: once each
    assert not c.add(first, NOW, "n1", NOW) and not c.add(second, NOW + 1, "n1", NOW)
    for _ in range(100):
        last = ctr.next("me")
    assert c.add(last, NOW, "n1", NOW)
    assert not c.add(last[:16] + f"{3:016x}", NOW, "n1", NOW)  # behind the window
    assert c.add(ctr.next("me", 1), NOW, "n1", NOW)  # another stream: its own window
    assert not c.add("z" * 32, NOW, "n1", NOW) and c.refused == 4


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", PATH),
        ("HEAD", PATH),
        ("GET", PATH.replace("wait=5", "wait=6")),
        ("GET", PATH.split("?")[0]),  # query dropped
        ("GET", PATH + "&x=1"),
        ("GET", PATH.replace("chunks/00", "chunks/01")),
        ("GET", PATH.replace("0011223344556677", "0011223344556678")),  # other swarm id
    ],
)
def test_tampered_method_or_path_refused(keys: SwarmKeys, method: str, path: str) -> None:
    h = sign_request(keys, "GET", PATH, "n1", to=ME, now=NOW)
    with pytest.raises(AuthError):
        verify_request(keys, h, method, path, NonceCache(), me=ME, now=NOW)


def _flip_hex(s: str) -> str:
    return ("1" if s[0] == "0" else "0") + s[1:]


@pytest.mark.parametrize(
    "tamper",
    [
        pytest.param(lambda f: {**f, "node": "n2"}, id="node"),
        pytest.param(lambda f: {**f, "node": f["node"] + "x"}, id="node-suffix"),
        pytest.param(lambda f: {**f, "to": "node-c"}, id="to"),
        pytest.param(lambda f: {**f, "ts": str(int(f["ts"]) + 1)}, id="ts+1"),
        pytest.param(lambda f: {**f, "ts": str(int(f["ts"]) - 1)}, id="ts-1"),
        pytest.param(lambda f: {**f, "nonce": _flip_hex(f["nonce"])}, id="nonce"),
        pytest.param(lambda f: {**f, "sig": _flip_hex(f["sig"])}, id="sig"),
        pytest.param(lambda f: {**f, "sig": f["sig"][::-1]}, id="sig-reversed"),
    ],
)
def test_tampered_header_field_refused(keys: SwarmKeys, tamper) -> None:  # type: ignore[no-untyped-def]
    h = sign_request(keys, "GET", PATH, "n1", to=ME, now=NOW)
    bad = _build(tamper(_parse(h)))
    assert bad != h
    with pytest.raises(AuthError):
        verify_request(keys, bad, "GET", PATH, NonceCache(), me=ME, now=NOW)


def test_other_partition_refused(keys: SwarmKeys) -> None:
    other = derive_keys(OTHER_SECRET)
    h = sign_request(other, "GET", PATH, "n1", to=ME, now=NOW)
    with pytest.raises(AuthError):
        verify_request(keys, h, "GET", PATH, NonceCache(), me=ME, now=NOW)
    # ... and the other way round
    h = sign_request(keys, "GET", PATH, "n1", to=ME, now=NOW)
    with pytest.raises(AuthError):
        verify_request(other, h, "GET", PATH, NonceCache(), me=ME, now=NOW)


def test_sign_refuses_node_id_no_verifier_accepts(keys: SwarmKeys) -> None:
    for node in ("", "a b", "a,b", "-lead", "x" * 65, "nöde"):
        with pytest.raises(BdnError):
            sign_request(keys, "GET", PATH, node, to=ME, now=NOW)


@pytest.mark.parametrize(
    "header",
    [
        None,
        "",
        "Bearer abc",
        "BDN-HMAC",
        "BDN-HMAC ",
        "bdn-hmac node=n1, ts=1, nonce=" + "0" * 32 + ", sig=" + "0" * 64,
        "BDN-HMAC node=n1,ts=1,nonce=" + "0" * 32 + ",sig=" + "0" * 64,
        "BDN-HMAC ts=1, node=n1, nonce=" + "0" * 32 + ", sig=" + "0" * 64,
        "BDN-HMAC node=n1, ts=-1, nonce=" + "0" * 32 + ", sig=" + "0" * 64,
        "BDN-HMAC node=n1, ts=1, nonce=" + "0" * 31 + ", sig=" + "0" * 64,
        "BDN-HMAC node=n1, ts=1, nonce=" + "A" * 32 + ", sig=" + "0" * 64,
        "BDN-HMAC node=n1, ts=1, nonce=" + "0" * 32 + ", sig=" + "0" * 63,
        "BDN-HMAC node=n1, ts=1, nonce=" + "0" * 32 + ", sig=" + "0" * 64 + "\n",
        "BDN-HMAC node=n1, ts=1, nonce=" + "0" * 32 + ", sig=" + "0" * 64 + ", extra=1",
        "BDN-HMAC node=n1, ts=" + "9" * 13 + ", nonce=" + "0" * 32 + ", sig=" + "0" * 64,
    ],
)
def test_malformed_headers_refused(keys: SwarmKeys, header: str | None) -> None:
    with pytest.raises(AuthError):
        verify_request(keys, header, "GET", PATH, NonceCache(), me=ME, now=NOW)


def test_non_ascii_digits_in_ts_refused(keys: SwarmKeys) -> None:
    # int() reads Arabic-Indic digits; the header grammar must not, or one request has many spellings.
    h = sign_request(keys, "GET", PATH, "n1", to=ME, now=NOW)
    f = _parse(h)
    arabic = f["ts"].translate(str.maketrans("0123456789", "٠١٢٣٤٥٦٧٨٩"))
    assert int(arabic) == int(f["ts"])
    with pytest.raises(AuthError):
        verify_request(keys, _build({**f, "ts": arabic}), "GET", PATH, NonceCache(), me=ME, now=NOW)


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/bdn/v1/x/chunks/\udcff\udcfe"),  # raw bytes 0xff 0xfe as aiohttp decodes them
        ("GET", "/bdn/v1/x/chunks/\ud800"),
        ("G\udce9T", PATH),
    ],
)
def test_undecodable_request_line_is_auth_error(keys: SwarmKeys, method: str, path: str) -> None:
    h = sign_request(keys, "GET", PATH, "n1", to=ME, now=NOW)
    with pytest.raises(AuthError):
        verify_request(keys, h, method, path, NonceCache(), me=ME, now=NOW)


def test_auth_error_text_is_one_line_without_secrets(keys: SwarmKeys) -> None:
    h = sign_request(keys, "GET", PATH, "n1", to=ME, now=NOW)
    with pytest.raises(AuthError) as ei:
        verify_request(keys, _build({**_parse(h), "sig": "0" * 64}), "GET", PATH, NonceCache(), me=ME, now=NOW)
    msg = str(ei.value)
    assert "\n" not in msg
    assert _parse(h)["sig"] not in msg and keys.auth_key.hex() not in msg


_header_parts = st.sampled_from(
    [
        "BDN-HMAC",
        " ",
        "node=",
        "n1",
        ", ",
        "ts=",
        "1780000000",
        "nonce=",
        "0" * 32,
        "sig=",
        "a" * 64,
        "=",
        ",",
        "\x00",
        "é",
        "٣",
    ]
)


@settings(max_examples=400)
@given(st.one_of(st.text(), st.lists(_header_parts, max_size=14).map("".join)))
def test_property_arbitrary_headers_raise_auth_error_only(header: str) -> None:
    keys = derive_keys(SECRET)
    with pytest.raises(AuthError):
        verify_request(keys, header, "GET", PATH, NonceCache(), me=ME, now=NOW)


@settings(max_examples=100)
@given(
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE"]),
    path=st.text(min_size=1, max_size=200).filter(lambda s: "\n" not in s),
    node=st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9._:-]{0,63}\Z"),
    skew=st.integers(-MAX_SKEW_S, MAX_SKEW_S),
)
def test_property_round_trip(method: str, path: str, node: str, skew: int) -> None:
    keys = derive_keys(SECRET)
    h = sign_request(keys, method, path, node, to=ME, now=NOW + skew)
    assert verify_request(keys, h, method, path, NonceCache(), me=ME, now=NOW) == node


# ---- issue 12 item 16: a signature binds the daemon it is for --------------------------------


def test_request_signed_for_one_daemon_is_refused_by_another_without_burning_its_nonce(keys: SwarmKeys) -> None:
    h = sign_request(keys, "GET", PATH, "node-a", to="node-b", now=NOW)
    assert _parse(h)["to"] == "node-b"
    cache = NonceCache()
    with pytest.raises(WrongTarget) as e:
        verify_request(keys, h, "GET", PATH, cache, me="node-c", now=NOW)
    assert e.value.me == "node-c"
    assert verify_request(keys, h, "GET", PATH, cache, me="node-b", now=NOW) == "node-a"  # nonce still fresh
    with pytest.raises(AuthError):
        verify_request(keys, h, "GET", PATH, cache, me="node-b", now=NOW)  # and now a replay


def test_unknown_target_is_refused_by_everyone_who_names_itself(keys: SwarmKeys) -> None:
    h = sign_request(keys, "POST", "/bdn/v1/x/members", "node-a", to=UNKNOWN_TARGET, now=NOW)
    for me in ("node-b", "node-c"):
        with pytest.raises(WrongTarget) as e:
            verify_request(keys, h, "POST", "/bdn/v1/x/members", NonceCache(), me=me, now=NOW)
        assert e.value.me == me


def test_wrong_target_is_only_said_to_a_valid_signature(keys: SwarmKeys) -> None:
    other = derive_keys(OTHER_SECRET)
    h = sign_request(other, "GET", PATH, "node-a", to="node-b", now=NOW)
    with pytest.raises(AuthError) as e:
        verify_request(keys, h, "GET", PATH, NonceCache(), me="node-c", now=NOW)
    assert not isinstance(e.value, WrongTarget)


def test_the_target_is_inside_the_signed_string(keys: SwarmKeys) -> None:
    # "BDN-HMAC-2\n" METHOD "\n" path?query "\n" ts "\n" nonce "\n" node "\n" to (DESIGN.md)
    f = _parse(sign_request(keys, "GET", PATH, "node-a", to="node-b", now=NOW))
    msg = f"BDN-HMAC-2\nGET\n{PATH}\n{f['ts']}\n{f['nonce']}\nnode-a\nnode-b".encode()
    assert f["sig"] == hmac.new(keys.auth_key, msg, hashlib.sha256).hexdigest()
    # the form without a target (BDN-HMAC-1) is not accepted by this version
    old = hmac.new(
        keys.auth_key, f"BDN-HMAC-1\nGET\n{PATH}\n{f['ts']}\n{f['nonce']}\nnode-a".encode(), hashlib.sha256
    ).hexdigest()
    legacy = f"BDN-HMAC node=node-a, ts={f['ts']}, nonce={f['nonce']}, sig={old}"
    with pytest.raises(AuthError):
        verify_request(keys, legacy, "GET", PATH, NonceCache(), me="node-b", now=NOW)


def test_sign_refuses_a_target_no_verifier_has(keys: SwarmKeys) -> None:
    for to in ("", "a b", "-x", "x" * 65):
        with pytest.raises(BdnError):
            sign_request(keys, "GET", PATH, "node-a", to=to, now=NOW)
