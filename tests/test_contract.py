"""The hosted hot-load contract's pure rules (``bdn.daemon.replica.contract``) and the target's
wire form with a base: no sockets, no clock."""

from __future__ import annotations

import pytest

from bdn.daemon.errors import Conflict, Unsupported
from bdn.daemon.replica import contract
from bdn.daemon.replica.hotload import parse_request
from bdn.daemon.replica.target import Target


def test_checksum_format_accepts_both_spellings() -> None:
    assert contract.checksum_format("alder32") == "alder32"
    assert contract.checksum_format("adler32") == "alder32"
    assert contract.checksum_format("ADLER32") == "alder32"
    assert contract.checksum_format(None) is None
    with pytest.raises(Unsupported, match="alder32"):
        contract.checksum_format("crc32")


def test_parse_request_takes_adler32_and_no_compression_format() -> None:
    ident, meta = parse_request(
        b'{"identity": "step000002", "incremental_snapshot_metadata":'
        b' {"previous_snapshot_identity": "step000001", "checksum_format": "adler32"}}'
    )
    assert ident == "step000002" and "compression_format" not in meta  # type: ignore[operator]


def test_request_key_identifies_the_same_hot_load() -> None:
    a = contract.request_key(
        "s2", {"previous_snapshot_identity": "s1", "checksum_format": "adler32", "compression_format": "ARC_V2"}
    )
    b = contract.request_key(
        "s2", {"previous_snapshot_identity": "s1", "checksum_format": "alder32", "compression_format": "arc_v2"}
    )
    assert a == b
    assert contract.request_key("s2", None) == contract.request_key("s2", {})
    assert contract.request_key("s2", None) != a
    assert contract.request_key("s3", None) != contract.request_key("s2", None)


def test_previous_names_served_or_loading_snapshot() -> None:
    contract.check_previous(None, "s1", "s2")
    contract.check_previous("s1", None, None)  # nothing served yet
    contract.check_previous("s1", "s1", "s1")
    contract.check_previous("s2", "s1", "s2")  # the next delta posted while s2 still loads
    with pytest.raises(Conflict, match="'s7' is not the snapshot being served \\('s1' is\\) nor the one being loaded"):
        contract.check_previous("s7", "s1", "s2")


def test_chain_length_and_cap() -> None:
    bases = {f"s{i}": f"s{i - 1}" for i in range(2, 70)} | {"s1": None}
    assert contract.chain_length("s1", bases.get, 64) == 0
    assert contract.chain_length("s65", bases.get, 64) == 64
    with pytest.raises(Conflict, match="more than 64 deltas .* a full snapshot is required"):
        contract.chain_length("s66", bases.get, 64)
    with pytest.raises(Conflict, match="loops"):
        contract.chain_length("a", {"a": "b", "b": "a"}.get, 64)


def test_superseded_load_kept_only_when_the_new_chain_needs_it() -> None:
    bases = {"s3": "s2", "s2": "s1", "s1": None}
    chain = contract.base_chain("s3", bases.get)
    assert chain == ["s3", "s2", "s1"]
    assert contract.keep_superseded("s2", chain) and contract.keep_superseded("s1", chain)
    assert not contract.keep_superseded("x9", chain)
    assert contract.base_chain(None, bases.get) == []
    assert contract.base_chain("a", {"a": "b", "b": "a"}.get) == ["a", "b"]  # no loop


def test_config_mismatch_names_the_field() -> None:
    base = {"architectures": ["Llama"], "hidden_size": 4096, "torch_dtype": "bfloat16"}
    assert contract.config_mismatch(base, dict(base, torch_dtype="float16")) is None
    assert contract.config_mismatch(base, dict(base, hidden_size=8192)) == (
        "Config value mismatch for hidden_size: base 4096, target 8192"
    )
    assert contract.config_mismatch(base, dict(base, vocab_size=1)).startswith("Config value mismatch for vocab_size")
    nested = {"text_config": {"num_hidden_layers": 32}}
    assert contract.config_mismatch(nested, {"text_config": {"num_hidden_layers": 40}}).startswith(
        "Config value mismatch for text_config.num_hidden_layers"
    )
    with pytest.raises(Conflict, match="not JSON"):
        contract.parse_config(b"{", "s2/config.json")
    with pytest.raises(Conflict, match="not a JSON object"):
        contract.parse_config(b"[]", "s2/config.json")
    with pytest.raises(Conflict, match="over the"):
        contract.parse_config(b" " * (contract.MAX_CONFIG_BYTES + 1), "s2/config.json")


def test_target_wire_carries_the_base() -> None:
    t = Target("s2", 10, "node0", "r1", "s1")
    assert Target.from_wire(t.wire(), 10) == t
    plain = Target("s2", 10, "node0", "r1")
    assert "base" not in plain.wire() and Target.from_wire(plain.wire(), 10) == plain
    assert Target.from_wire(dict(t.wire(), base="../x"), 10) is None
