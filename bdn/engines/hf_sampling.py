"""Tokens in and out of :class:`bdn.engines.hf.HFEngine`: chat prompts, text, one forward step,
the choice of the next token.

Pure functions of a tokenizer, a model and logits (torch tensors); the engine holds the state
(the served model, the prompt cache, the gate). torch and transformers are imported only when
a function here runs.
"""

from __future__ import annotations

import inspect
from typing import Any

from bdn.engines.hf_staging import torch


def encode_chat(tok: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a chat prompt (``[{"role", "content"}]``): the tokenizer's chat template if it
    has one, else a plain ``<|role|>content`` rendering; with ``tok`` None the UTF-8 bytes are the
    tokens."""
    if tok is not None and getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    text = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages) + "<|assistant|>"
    if tok is not None:
        return [int(i) for i in tok.encode(text, add_special_tokens=False)]
    return list(text.encode("utf-8"))  # no tokenizer in the snapshot: bytes are the tokens


def decode(tok: Any, ids: list[int]) -> str:
    """Text of token ids (special tokens skipped); with ``tok`` None, the bytes as UTF-8."""
    if tok is not None:
        return tok.decode(ids, skip_special_tokens=True)
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def token_text(tok: Any, i: int) -> str:
    """The text of one token id (the tokenizer's token string), for logprob answers."""
    return decode(None, [i]) if tok is None else tok.convert_ids_to_tokens(i) or ""


def eos_ids(model: Any) -> set[int]:
    """Token ids that end generation (the model's generation config's ``eos_token_id``)."""
    cfg = getattr(model, "generation_config", None) or getattr(model, "config", None)
    e = getattr(cfg, "eos_token_id", None)
    return set(e) if isinstance(e, list) else ({e} if isinstance(e, int) else set())


def forward(model: Any, ids: list[int], kv: Any, device: str) -> tuple[Any, Any]:
    """One forward pass over ``ids`` after the KV cache ``kv`` (a ``transformers.DynamicCache``,
    or None for a new one): ``(float32 logits of the last position, shape [vocab], the cache)``."""
    th = torch()
    from transformers import DynamicCache

    if kv is None:
        kv = DynamicCache()
    x = th.tensor([ids], dtype=th.long, device=device)
    if getattr(model, "_bdn_cache_kw", None) is None:
        # transformers >= 5.2x names the argument ``cache``; older ones ``past_key_values``.
        model._bdn_cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(input_ids=x, use_cache=True, **{model._bdn_cache_kw: kv})
    return out.logits[0, -1].float(), kv


def next_token(logits: Any, temperature: float, top_p: float, gen: Any) -> int:
    """The next token id from ``logits`` (shape [vocab]): the argmax at ``temperature`` 0, else a
    draw (``gen``: a ``torch.Generator``) from the softmax at ``temperature`` cut to the smallest
    set of tokens whose probability reaches ``top_p`` (nucleus sampling)."""
    th = torch()
    if temperature == 0:
        return int(th.argmax(logits))
    probs = th.softmax(logits / temperature, -1)
    if top_p < 1.0:
        sp, si = th.sort(probs, descending=True)
        keep = th.cumsum(sp, 0) - sp < top_p
        probs = th.zeros_like(probs).scatter(0, si[keep], sp[keep])
    return int(th.multinomial(probs / probs.sum(), 1, generator=gen))


def top_logprobs(logp: Any, k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely tokens of log-probabilities ``logp`` (shape [vocab]): ``[(id, logprob)]``."""
    v, i = torch().topk(logp, min(k, logp.numel()))
    return [(int(a), float(b)) for a, b in zip(i, v)]
