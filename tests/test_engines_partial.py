"""The pure parts of partial engine loads: the offer's changed byte ranges (bdn.engines.changed) and
how bdn's vLLM worker extension (bdn.engines.vllm_worker) picks the tensors to read.

The extension's load itself runs inside vLLM (tests/test_engines_vllm_real.py); what is checked
here is what it decides before touching the model: which vLLM module a checkpoint tensor loads
into (the model's ``packed_modules_mapping``, as vLLM's Llama defines it), which tensors a module
is rebuilt from, and which requests and files it refuses.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bdn.engines.changed import parse_ranges
from bdn.engines.vllm_worker import check_ranges, check_rebuild, closure, module_key, parse_request, read_headers
from bdn.fileops import save
from bdn.proto.errors import ProtocolError

LLAMA_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
NAMES = [
    f"model.layers.{i}.{m}.weight"
    for i in range(2)
    for m in (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
        "input_layernorm",
        "post_attention_layernorm",
    )
]
NAMES += ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]


def test_checkpoint_names_map_to_vllms_stacked_modules() -> None:
    assert module_key("model.layers.0.self_attn.q_proj.weight", LLAMA_PACKED) == "model.layers.0.self_attn.qkv_proj"
    assert module_key("model.layers.1.mlp.up_proj.weight", LLAMA_PACKED) == "model.layers.1.mlp.gate_up_proj"
    assert module_key("model.layers.1.mlp.down_proj.weight", LLAMA_PACKED) == "model.layers.1.mlp.down_proj"
    assert module_key("model.embed_tokens.weight", LLAMA_PACKED) == "model.embed_tokens"
    assert module_key("lm_head.weight", {}) == "lm_head"


def test_a_changed_q_proj_rebuilds_its_qkv_module_from_q_k_and_v() -> None:
    mods, read = closure(["model.layers.1.self_attn.q_proj.weight", "model.embed_tokens.weight"], NAMES, LLAMA_PACKED)
    assert mods == ["model.embed_tokens", "model.layers.1.self_attn.qkv_proj"]
    assert read == [
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.1.self_attn.k_proj.weight",
        "model.layers.1.self_attn.v_proj.weight",
        "model.embed_tokens.weight",
    ]
    mods, read = closure(["model.layers.0.mlp.gate_proj.weight"], NAMES, LLAMA_PACKED)
    assert read == ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"]
    assert closure([], NAMES, LLAMA_PACKED) == ([], [])


def test_requests_and_headers_are_checked(tmp_path: Path) -> None:
    save(tmp_path / "a.safetensors", {"x": np.arange(6, dtype=np.float32).reshape(2, 3)})
    save(tmp_path / "b.safetensors", {"y": np.zeros(4, dtype=np.int64)})
    heads = read_headers(tmp_path)
    f, dtype, shape, start, end = heads["x"]
    assert (f.name, dtype, shape, end - start) == ("a.safetensors", "F32", [2, 3], 24)
    assert np.frombuffer(f.read_bytes()[start:end], np.float32).tolist() == [0, 1, 2, 3, 4, 5]
    assert parse_request(json.dumps({"snapshot_dir": str(tmp_path), "names": ["x"]})) == (tmp_path, ["x"], {}, True)
    ok = {"snapshot_dir": str(tmp_path), "names": ["x", "y"], "ranges": {"x": [[0, 4], [8, 24]], "y": []}}
    assert parse_request(ok) == (tmp_path, ["x", "y"], {"x": [(0, 4), (8, 24)], "y": []}, True)
    assert parse_request({**ok, "inplace": False})[3] is False
    check_ranges({"x": [(0, 4), (8, 24)]}, {"x": 24})
    with pytest.raises(ValueError, match="end at byte 25, after the tensor's 24"):
        check_ranges({"x": [(0, 25)]}, {"x": 24})

    def req(**kw: object) -> str:
        return json.dumps({"snapshot_dir": str(tmp_path), "names": ["x"], **kw})

    for bad, why in (
        ("{", "not JSON"),
        (json.dumps({"snapshot_dir": str(tmp_path / "no"), "names": []}), "not a directory"),
        (json.dumps({"snapshot_dir": str(tmp_path), "names": "x"}), "list of tensor names"),
        (req(ranges=[]), "must map"),
        (req(ranges={"z": [[0, 1]]}), "not a changed tensor"),
        (req(ranges={"x": [[4, 4]]}), "empty"),
        (req(ranges={"x": [[8, 12], [0, 4]]}), "unsorted"),
        (req(ranges={"x": [[0, 8], [4, 12]]}), "overlapping"),
        (req(ranges={"x": [[-1, 4]]}), "unsorted"),
        (req(ranges={"x": [[0, True]]}), "is not"),
        (req(ranges={"x": [[0]]}), "is not"),
        (req(inplace="no"), "true or false"),
    ):
        with pytest.raises(ValueError, match=why):
            parse_request(bad)
    with pytest.raises(TypeError, match="JSON object"):
        parse_request("[1]")
    save(tmp_path / "c.safetensors", {"x": np.zeros(1, dtype=np.float32)})
    with pytest.raises(ValueError, match="is in a.safetensors and c.safetensors"):
        read_headers(tmp_path)


def test_changed_ranges_are_validated() -> None:
    """Absolute file offsets in the offer, relative to each tensor's first byte after parsing."""
    names, bounds = {"a", "b"}, {"a": (1000, 1100), "b": (1100, 1108)}
    assert parse_ranges({"a": [[1000, 1004], [1004, 1010], [1090, 1100]], "b": []}, names, bounds) == {
        "a": [(0, 4), (4, 10), (90, 100)],
        "b": [],
    }
    for bad, why in (
        ([], "must map"),
        ({"c": [[0, 1]]}, "not in changed_tensors"),
        ({"a": [[1000, 1101]]}, "outside"),
        ({"a": [[0, 10]]}, "outside"),
        ({"a": [[1005, 1005]]}, "empty"),
        ({"a": [[1010, 1020], [1000, 1005]]}, "unsorted"),
        ({"a": [[1000, 1010], [1005, 1020]]}, "overlapping"),
        ({"a": [[1000, True]]}, "is not"),
        ({"a": [[1000]]}, "is not"),
        ({"a": "0-10"}, "must be a list"),
    ):
        with pytest.raises(ProtocolError, match=why):
            parse_ranges(bad, names, bounds)


def _raw(path: Path, header: object, data: bytes) -> None:
    """A safetensors file with ``header`` as given (not checked), padded to 8 bytes, then ``data``."""
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(len(h).to_bytes(8, "little") + h + data)


def test_a_header_entry_that_lies_about_its_bytes_is_refused_before_anything_is_read(tmp_path: Path) -> None:
    """The extension writes a changed tensor's bytes straight into its parameter's rows: an entry
    whose offsets cover more bytes than its shape (the next rows are a sibling's: k after q), that
    runs past the file, or that is inverted must be refused when the headers are read."""
    data = bytes(range(256)) * 4
    good = {"x": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}}
    for i, (entry, why) in enumerate(
        (
            ({"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 48]}, "is 48 bytes, its shape"),
            ({"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 6]}, "is 6 bytes, its shape"),
            ({"dtype": "F32", "shape": [256], "data_offsets": [0, 1024 + 4]}, "of a data area of 1024"),
            ({"dtype": "F32", "shape": [0], "data_offsets": [24, 0]}, r"at \[24, 0\)"),
            ({"dtype": "F32", "shape": [-2, -3], "data_offsets": [0, 24]}, "bad header entry"),
            ({"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24.0]}, "bad header entry"),
            ({"dtype": "F32", "shape": [2, 3], "data_offsets": [0, True]}, "bad header entry"),
            ({"dtype": "F32", "shape": "2x3", "data_offsets": [0, 24]}, "bad header entry"),
            ({"dtype": 4, "shape": [2, 3], "data_offsets": [0, 24]}, "bad header entry"),
            ({"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24, 48]}, "bad header entry"),
        )
    ):
        d = tmp_path / f"d{i}"
        d.mkdir()
        _raw(d / "model.safetensors", {**good, "y": entry}, data)
        with pytest.raises(ValueError, match=why):
            read_headers(d)
    d = tmp_path / "list"
    d.mkdir()
    _raw(d / "model.safetensors", [1, 2], data)
    with pytest.raises(ValueError, match="not a JSON object"):
        read_headers(d)
    d = tmp_path / "short"
    d.mkdir()
    (d / "model.safetensors").write_bytes((1 << 20).to_bytes(8, "little") + b"{}")
    with pytest.raises(ValueError, match="header of 1048576 bytes in a file of 10"):
        read_headers(d)
    d = tmp_path / "ok"
    d.mkdir()
    _raw(d / "model.safetensors", {**good, "u": {"dtype": "U16", "shape": [3], "data_offsets": [24, 30]}}, data)
    assert read_headers(d)["u"][1:3] == ("U16", [3])  # a dtype the extension never loads: bounds only


def test_a_module_or_dtype_the_rebuild_cannot_take_is_refused_before_any_write(tmp_path: Path) -> None:
    """The extension writes in-place tensors first and rebuilds the other modules after: a module
    the served model lacks, or a tensor of a dtype it does not read, must fail the request before
    the first write (a torch model on CPU, real safetensors files)."""
    import torch

    class Attn(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv_proj = torch.nn.Linear(4, 12, bias=False)

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.self_attn = Attn()

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList([Layer()])

    model = torch.nn.Module()
    model.model = Model()
    save(
        tmp_path / "model.safetensors",
        {
            "model.layers.0.self_attn.q_proj.weight": np.zeros((4, 4), np.float32),
            "model.layers.0.self_attn.k_proj.weight": np.zeros((4, 4), np.float32),
            "model.layers.0.self_attn.v_proj.weight": np.zeros((4, 4), np.float32),
            "model.layers.1.self_attn.q_proj.weight": np.zeros((4, 4), np.float32),
            "model.layers.0.mask": np.zeros(4, np.uint16),
        },
    )
    infos = read_headers(tmp_path)
    mods, read = closure(["model.layers.0.self_attn.q_proj.weight"], list(infos), LLAMA_PACKED)
    check_rebuild(model, infos, mods, read)  # the stacked module exists, F32 is read
    mods, read = closure(["model.layers.1.self_attn.q_proj.weight"], list(infos), LLAMA_PACKED)
    with pytest.raises(ValueError, match="no module 'model.layers.1.self_attn.qkv_proj' in the served model"):
        check_rebuild(model, infos, mods, read)
    with pytest.raises(ValueError, match="tensor 'model.layers.0.mask' has dtype U16, not one read here"):
        check_rebuild(model, infos, [], ["model.layers.0.mask"])
