"""A tiny Llama checkpoint made locally (no hub download): config, weights and a byte-level tokenizer.

    python examples/engine/tiny_llama.py OUT_DIR [--hidden 128 --layers 2 --seed 0]

``make_tiny_llama(out_dir, ...)`` writes a Hugging Face directory that transformers, vLLM and
SGLang load: ``config.json`` (``LlamaForCausalLM``, bf16), ``model.safetensors`` (from
``save_pretrained``), ``generation_config.json``, and a byte-level BPE ``tokenizer.json`` with a
chat template. ``optimizer_step(state, frac, seed)`` is a simulated RL step: it changes ``frac`` of
the values of a few tensors (the others stay bit-identical, as after a sparse update), so deltas
are small and a partial swap has something to skip.

Needs torch, transformers and tokenizers.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIALS = ["<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]


def make_tokenizer(out: Path) -> int:
    """Write a byte-level BPE tokenizer (256 bytes + specials, no merges); returns its vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for s in SPECIALS:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", additional_special_tokens=SPECIALS[2:]
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return len(vocab)


def make_tiny_llama(
    out: str | Path, *, hidden: int = 128, layers: int = 2, heads: int = 2, seed: int = 0, max_positions: int = 512
):
    """Write the checkpoint to ``out``; returns ``(model, state_dict)`` (bf16 torch tensors)."""
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    transformers.utils.logging.disable_progress_bar()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = make_tokenizer(out)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        bos_token_id=vocab - len(SPECIALS),
        eos_token_id=vocab - len(SPECIALS) + 1,
        dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():  # a random init samples near-uniformly; widen it so answers differ by policy
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else None
    model.save_pretrained(out)
    return model, {k: v.detach().clone() for k, v in model.state_dict().items()}


def optimizer_step(state: dict, frac: float = 0.02, seed: int = 1, tensors: int = 3) -> dict:
    """A new state: ``tensors`` of the 2-D tensors get ``frac`` of their values perturbed, the rest stay."""
    import torch

    g = torch.Generator().manual_seed(seed)
    new = {k: v.clone() for k, v in state.items()}
    names = [k for k, v in state.items() if v.dim() == 2]
    pick = torch.randperm(len(names), generator=g)[:tensors].tolist()
    for i in pick:
        t = new[names[i]]
        flat = t.view(-1)
        n = max(1, int(flat.numel() * frac))
        idx = torch.randperm(flat.numel(), generator=g)[:n]
        flat[idx] = (flat[idx].float() + torch.randn(n, generator=g) * 0.5).to(t.dtype)
    return new


def save_state(out: str | Path, like: str | Path, state: dict) -> Path:
    """Write ``state`` as a checkpoint directory with the non-weight files of ``like``."""
    import shutil

    from safetensors.torch import save_file

    out, like = Path(out), Path(like)
    out.mkdir(parents=True, exist_ok=True)
    for f in like.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copyfile(f, out / f.name)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    make_tiny_llama(a.out, hidden=a.hidden, layers=a.layers, seed=a.seed)
    print(json.dumps({"dir": a.out}))
