"""The reference engine's tiny numpy GPT (examples/engine/tinygpt.py): files, forward, sampling."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from bdn.client import open_snapshot
from bdn.fileops import chunk_digests as file_digests
from bdn.fileops import read_header

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "engine"))
import tinygpt

CFG = tinygpt.TinyGPTConfig(n_layer=2, n_head=4, n_embd=32, n_positions=128)
CHUNK = 64 << 10


def make_ready(directory: Path, identity: str, policy_version: int) -> Path:
    """Turn a checkpoint directory into a READY snapshot directory, as bdnd writes it."""
    files = []
    for f in sorted(p for p in directory.rglob("*") if p.is_file()):
        rel = f.relative_to(directory).as_posix()
        files.append({"path": rel, "size": f.stat().st_size, "chunks": file_digests(f, CHUNK)})
    (directory / "READY").write_text(
        json.dumps(
            {
                "format": "bdn.ready/1",
                "identity": identity,
                "kind": "full",
                "policy_version": policy_version,
                "base_identity": None,
                "chunk_size": CHUNK,
                "files": files,
            }
        )
    )
    return directory


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    weights = tinygpt.init_weights(CFG, seed=3)
    d = tinygpt.save_checkpoint(tmp_path_factory.mktemp("ck") / "step000001", CFG, weights)
    return d, weights


@pytest.fixture(scope="module")
def model(ckpt: tuple[Path, dict[str, np.ndarray]]) -> tinygpt.Model:
    return tinygpt.load_checkpoint(ckpt[0])


def test_checkpoint_files_are_a_bf16_hf_directory(ckpt: tuple[Path, dict[str, np.ndarray]]) -> None:
    d, weights = ckpt
    assert sorted(p.name for p in d.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == "tinygpt"
    assert {k: cfg[k] for k in ("vocab_size", "n_layer", "n_head", "n_embd", "n_positions")} == {
        "vocab_size": 259,
        "n_layer": 2,
        "n_head": 4,
        "n_embd": 32,
        "n_positions": 128,
    }
    header = read_header(d / "model.safetensors")
    assert header.metadata == {"format": "pt"}
    assert set(header.tensors) == set(tinygpt.weight_shapes(CFG)) == set(weights)
    assert {t.dtype for t in header.tensors.values()} == {"BF16"}
    for name, info in header.tensors.items():
        assert info.shape == tinygpt.weight_shapes(CFG)[name]
    tok = json.loads((d / "tokenizer.json").read_text())
    assert [(t["id"], t["content"]) for t in tok["added_tokens"]] == [
        (256, "<|endoftext|>"),
        (257, "<|im_start|>"),
        (258, "<|im_end|>"),
    ]
    assert sorted(tok["model"]["vocab"].values()) == list(range(256))


def test_round_trip_keeps_the_exact_weights(ckpt: tuple[Path, dict[str, np.ndarray]], model: tinygpt.Model) -> None:
    _d, weights = ckpt
    assert model.digest == tinygpt.weights_digest(weights)
    for name, w in weights.items():
        assert model.w[name].dtype == np.float32
        np.testing.assert_array_equal(model.w[name], w.astype(np.float32))
    changed = tinygpt.optimizer_step(weights, 0.02, seed=1)
    assert tinygpt.weights_digest(changed) != model.digest
    frac = np.mean(np.concatenate([(changed[n] != weights[n]).ravel() for n in weights]))
    assert 0.005 < frac < 0.05


def test_load_from_snapshot_uses_ready_identity_and_version(
    tmp_path: Path, ckpt: tuple[Path, dict[str, np.ndarray]]
) -> None:
    _d, weights = ckpt
    d = tinygpt.save_checkpoint(tmp_path / "snap", CFG, weights)
    with open_snapshot(make_ready(d, "step000007", 7)) as snap:
        m = tinygpt.load_from_snapshot(snap)
    assert (m.identity, m.policy_version, m.digest) == ("step000007", 7, tinygpt.weights_digest(weights))
    # Computed from float32 copies: the model outlives the closed snapshot.
    assert m.generate(m.tokenizer.encode_chat([{"role": "user", "content": "x"}]), 4, 0.0)[0]


def test_greedy_is_deterministic_and_seeded_sampling_repeats(model: tinygpt.Model) -> None:
    prompt = model.tokenizer.encode_chat([{"role": "user", "content": "hello, world"}])
    a = model.generate(prompt, 24, 0.0)
    assert a == model.generate(prompt, 24, 0.0)
    assert a == model.generate(prompt, 24, 0.0, seed=99)  # the seed does not matter when greedy
    s1 = model.generate(prompt, 24, 1.0, seed=5)
    assert s1 == model.generate(prompt, 24, 1.0, seed=5)
    outs = {tuple(model.generate(prompt, 24, 1.5, seed=s)[0]) for s in range(4)}
    assert len(outs) > 1
    # Greedy picks the most likely id at every step.
    g = model.generate_detailed(prompt, 8, 0.0, top_logprobs=1)
    assert [t[0][0] for t in g.top_logprobs] == g.token_ids


def test_logprobs_are_log_probabilities_of_the_sampled_ids(model: tinygpt.Model) -> None:
    prompt = model.tokenizer.encode_chat(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo ✓"}]
    )
    g = model.generate_detailed(prompt, 16, 0.8, seed=11, top_logprobs=5)
    assert len(g.token_ids) == len(g.logprobs) == len(g.top_logprobs) > 0
    assert all(math.isfinite(lp) and lp <= 0 for lp in g.logprobs)
    # The same numbers from one uncached forward pass over prompt + completion.
    logits, _ = model.forward(prompt + g.token_ids[:-1], all_logits=True)
    z = logits.astype(np.float64)
    logp = z - z.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    assert np.allclose(np.exp(logp).sum(-1), 1.0)
    ref = [logp[len(prompt) - 1 + i, t] for i, t in enumerate(g.token_ids)]
    np.testing.assert_allclose(g.logprobs, ref, atol=1e-5)
    for top in g.top_logprobs:
        lps = [lp for _i, lp in top]
        assert lps == sorted(lps, reverse=True) and len(top) == 5


def test_generation_stops_at_the_context_end_and_on_stop_ids(model: tinygpt.Model) -> None:
    prompt = model.tokenizer.encode_chat([{"role": "user", "content": "a" * 100}])
    assert len(prompt) < CFG.n_positions
    g = model.generate_detailed(prompt, 1000, 0.0, stop_ids=frozenset())
    assert len(prompt) + len(g.token_ids) == CFG.n_positions and g.finish_reason == "length"
    first = model.generate(prompt, 1, 0.0)[0][0]
    g = model.generate_detailed(prompt, 10, 0.0, stop_ids=frozenset({first}))
    assert g.token_ids == [first] and g.finish_reason == "stop"
    assert model.generate(prompt, 0, 0.0) == ([], [])


def test_byte_tokenizer_round_trip() -> None:
    tok = tinygpt.ByteTokenizer()
    text = "naïve ✓ 🚀 <|im_end|>"
    ids = tok.encode(text)
    assert max(ids) < 256 and tok.decode(ids) == text
    chat = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert chat[0] == tok.im_start_id and chat.count(tok.im_end_id) == 1
    assert bytes(i for i in chat if i < 256) == b"user\nhi\nassistant\n"
    assert tok.token_text(0xE2) == "\\xe2" and tok.token_bytes(tok.im_end_id) == b"<|im_end|>"
    assert tok.decode([0xE2, 0x9C]) == "\ufffd"  # a cut UTF-8 sequence decodes, replaced


def test_bad_checkpoints_are_refused_with_one_line(tmp_path: Path, ckpt: tuple[Path, dict[str, np.ndarray]]) -> None:
    _d, weights = ckpt

    def fresh(name: str) -> Path:
        return tinygpt.save_checkpoint(tmp_path / name, CFG, weights)

    d = fresh("type")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    with pytest.raises(tinygpt.CheckpointError, match="model_type is 'llama'"):
        tinygpt.load_checkpoint(d)

    d = fresh("heads")
    (d / "config.json").write_text(json.dumps({**cfg, "n_head": 5}))
    with pytest.raises(tinygpt.CheckpointError, match="not a multiple of n_head"):
        tinygpt.load_checkpoint(d)

    d = fresh("huge")
    (d / "config.json").write_text(json.dumps({**cfg, "n_layer": 10**9}))
    with pytest.raises(tinygpt.CheckpointError, match="n_layer"):
        tinygpt.load_checkpoint(d)

    d = fresh("layers")  # the config asks for a third layer the weights do not have
    (d / "config.json").write_text(json.dumps({**cfg, "n_layer": 3}))
    with pytest.raises(tinygpt.CheckpointError, match=r"tensor 'transformer\.h\.2\..*' is missing"):
        tinygpt.load_checkpoint(d)

    d = fresh("tok")
    tok = json.loads((d / "tokenizer.json").read_text())
    tok["added_tokens"][2]["id"] = 9999
    (d / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(tinygpt.CheckpointError, match="outside"):
        tinygpt.load_checkpoint(d)

    d = fresh("json")
    (d / "config.json").write_text("{not json")
    with pytest.raises(tinygpt.CheckpointError, match="not valid JSON"):
        tinygpt.load_checkpoint(d)

    bad = dict(weights)
    bad["transformer.wte.weight"] = bad["transformer.wte.weight"][:10]
    with pytest.raises(tinygpt.CheckpointError, match="has shape"):
        tinygpt.save_checkpoint(tmp_path / "shape", CFG, bad)
    extra = {**weights, "stray.weight": weights["transformer.ln_f.bias"]}
    with pytest.raises(tinygpt.CheckpointError, match="unexpected tensor 'stray.weight'"):
        tinygpt.save_checkpoint(tmp_path / "extra", CFG, extra)


def test_forward_refuses_bad_ids(model: tinygpt.Model) -> None:
    with pytest.raises(ValueError, match="outside"):
        model.forward([CFG.vocab_size])
    with pytest.raises(ValueError, match="exceed the context"):
        model.forward([1] * (CFG.n_positions + 1))


def test_untied_head(tmp_path: Path) -> None:
    cfg = tinygpt.TinyGPTConfig(n_layer=1, n_head=2, n_embd=16, n_positions=32, tie_word_embeddings=False)
    w = tinygpt.init_weights(cfg, 1)
    assert w["lm_head.weight"].shape == (cfg.vocab_size, 16)
    m = tinygpt.load_checkpoint(tinygpt.save_checkpoint(tmp_path / "u", cfg, w))
    g = m.generate_detailed([1, 2, 3], 5, 0.0, stop_ids=frozenset())
    assert len(g.token_ids) == len(g.logprobs) == 5
