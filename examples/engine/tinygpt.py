#!/usr/bin/env python3
"""A tiny GPT-style causal language model in numpy, stored as a Hugging Face-style directory.

It is the model of bdn's reference serving process (examples/engine/server.py): small enough to
initialise, publish and serve on a laptop in a second, yet a real decoder-only transformer whose
weights travel through bdn exactly as a large checkpoint's do (bf16 safetensors, deltas, hot-load).

Architecture (GPT-2, Radford et al. 2019, and Hugging Face ``GPT2LMHeadModel``'s tensor names and
layouts; linear weights are stored ``[in, out]`` as GPT-2's ``Conv1D`` stores them):

    x = wte[ids] + wpe[positions]
    for each of n_layer blocks:   x += attn(ln_1(x));  x += mlp(ln_2(x))      (pre-LayerNorm)
        attn: causal multi-head self-attention, fused c_attn [D, 3D] -> q, k, v; c_proj [D, D]
        mlp:  c_fc [D, 4D], GELU (tanh approximation), c_proj [4D, D]
    logits = ln_f(x) @ wte.T   (tied)   or   ln_f(x) @ lm_head.T

Directory (what ``save_checkpoint`` writes and the daemon rebuilds in shared memory):

- ``config.json``: ``{"model_type": "tinygpt", "vocab_size", "n_layer", "n_head", "n_embd",
  "n_positions", "tie_word_embeddings", "layer_norm_epsilon", "architectures": ["TinyGPT"]}``
- ``model.safetensors``: every tensor in bf16 (``ml_dtypes.bfloat16``), ``__metadata__``
  ``{"format": "pt"}``, written by ``bdn.fileops.save``.
- ``tokenizer.json``: a Hugging Face ``tokenizers`` document of a byte-level tokenizer: ids 0..255
  are the bytes of UTF-8 text (a BPE model without merges behind the ByteLevel pre-tokenizer, so
  the ``tokenizers`` library encodes text to the same ids), then the special tokens
  ``<|endoftext|>`` (256), ``<|im_start|>`` (257), ``<|im_end|>`` (258).
- ``tokenizer_config.json``: the special tokens and a ChatML ``chat_template``.

Chat prompts use ChatML: ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message, then
``<|im_start|>assistant\\n``; generation stops at ``<|im_end|>`` or ``<|endoftext|>``.

Everything read from a checkpoint directory (it may come from a bucket) is validated; failures
raise ``CheckpointError`` (a ``bdn.proto.errors.ProtocolError``) with one line naming the problem.

Also a small CLI for trainers and demos::

    python examples/engine/tinygpt.py init DIR [--seed 0] [--n-layer 2] [--n-embd 64] ...
    python examples/engine/tinygpt.py step SRC DST [--frac 0.02] [--seed 1]   # simulated RL step
    python examples/engine/tinygpt.py digest DIR
"""

from __future__ import annotations

import argparse
import json
import math
import mmap
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import ml_dtypes
import numpy as np
import xxhash

from bdn.proto.errors import ProtocolError
from bdn.fileops import read_header, save
from bdn.proto.safetensors_fmt import safetensors_dtype, tensor_view

MODEL_TYPE = "tinygpt"
BF16 = np.dtype(ml_dtypes.bfloat16)
N_BYTES = 256
EOS, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (EOS, IM_START, IM_END)
CHAT_ROLES = ("system", "user", "assistant", "tool")
WEIGHTS_FILE = "model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
MAX_TOKENIZER_BYTES = 16 << 20
# Float dtypes a checkpoint may store; all are computed in float32.
LOADABLE_DTYPES = ("BF16", "F16", "F32")
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class CheckpointError(ProtocolError):
    """A tinygpt checkpoint directory (config, tokenizer or weights) broke the format."""


# -- config ------------------------------------------------------------------------------------

_LIMITS: dict[str, tuple[int, int]] = {
    "vocab_size": (N_BYTES + len(SPECIAL_TOKENS), 1 << 20),
    "n_layer": (1, 256),
    "n_head": (1, 1024),
    "n_embd": (1, 1 << 16),
    "n_positions": (1, 1 << 20),
}


@dataclass(frozen=True)
class TinyGPTConfig:
    """Hyper-parameters; the defaults make a ~150k-parameter model (0.3 MB in bf16)."""

    vocab_size: int = N_BYTES + len(SPECIAL_TOKENS)
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    n_positions: int = 512
    tie_word_embeddings: bool = True
    layer_norm_epsilon: float = 1e-5

    def __post_init__(self) -> None:
        for key, (lo, hi) in _LIMITS.items():
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
                raise CheckpointError(f"config {key} = {value!r} must be an integer in [{lo}, {hi}]")
        if self.n_embd % self.n_head:
            raise CheckpointError(f"config n_embd {self.n_embd} is not a multiple of n_head {self.n_head}")
        if not isinstance(self.tie_word_embeddings, bool):
            raise CheckpointError("config tie_word_embeddings must be true or false")
        eps = self.layer_norm_epsilon
        if not isinstance(eps, int | float) or isinstance(eps, bool) or not 0 < eps < 1:
            raise CheckpointError(f"config layer_norm_epsilon = {eps!r} must be a number in (0, 1)")

    def to_json(self) -> dict[str, Any]:
        """The ``config.json`` object (Hugging Face style: ``model_type`` and ``architectures``)."""
        return {"model_type": MODEL_TYPE, "architectures": ["TinyGPT"], **asdict(self)}

    @classmethod
    def from_json(cls, obj: Any, where: str = "config.json") -> TinyGPTConfig:
        """Validate a parsed ``config.json``; CheckpointError (one line, prefixed ``where``) if bad."""
        if not isinstance(obj, dict):
            raise CheckpointError(f"{where}: expected a JSON object")
        if obj.get("model_type") != MODEL_TYPE:
            raise CheckpointError(
                f"{where}: model_type is {str(obj.get('model_type'))[:60]!r}, expected {MODEL_TYPE!r}"
            )
        fields = {k: obj[k] for k in asdict(cls()) if k in obj}
        missing = [k for k in _LIMITS if k not in obj]
        if missing:
            raise CheckpointError(f"{where}: missing {', '.join(missing)}")
        try:
            return cls(**fields)
        except CheckpointError as exc:
            raise CheckpointError(f"{where}: {exc}") from None

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


def weight_shapes(config: TinyGPTConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name of a checkpoint and its shape (GPT-2 / ``GPT2LMHeadModel`` names)."""
    d, v = config.n_embd, config.vocab_size
    shapes: dict[str, tuple[int, ...]] = {
        "transformer.wte.weight": (v, d),
        "transformer.wpe.weight": (config.n_positions, d),
    }
    for i in range(config.n_layer):
        p = f"transformer.h.{i}."
        shapes.update(
            {
                p + "ln_1.weight": (d,),
                p + "ln_1.bias": (d,),
                p + "attn.c_attn.weight": (d, 3 * d),
                p + "attn.c_attn.bias": (3 * d,),
                p + "attn.c_proj.weight": (d, d),
                p + "attn.c_proj.bias": (d,),
                p + "ln_2.weight": (d,),
                p + "ln_2.bias": (d,),
                p + "mlp.c_fc.weight": (d, 4 * d),
                p + "mlp.c_fc.bias": (4 * d,),
                p + "mlp.c_proj.weight": (4 * d, d),
                p + "mlp.c_proj.bias": (d,),
            }
        )
    shapes["transformer.ln_f.weight"] = (d,)
    shapes["transformer.ln_f.bias"] = (d,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, d)
    return shapes


def init_weights(config: TinyGPTConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Fresh weights as bf16 arrays, GPT-2's initialisation.

    Normal(0, 0.02) for embeddings and linear weights, the residual projections (``c_proj``)
    scaled by 1/sqrt(2 * n_layer), zero biases, LayerNorm gains of one. Deterministic in ``seed``.
    """
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for name, shape in weight_shapes(config).items():
        if name.endswith(".bias"):
            w = np.zeros(shape, np.float32)
        elif ".ln_" in name or name.startswith("transformer.ln_f"):
            w = np.ones(shape, np.float32)
        else:
            std = 0.02 / math.sqrt(2 * config.n_layer) if name.endswith("c_proj.weight") else 0.02
            w = rng.normal(0.0, std, shape).astype(np.float32)
        out[name] = w.astype(BF16)
    return out


def check_weights(config: TinyGPTConfig, weights: Mapping[str, np.ndarray], where: str = "weights") -> None:
    """Names, shapes and dtypes of ``weights`` must be exactly what ``config`` asks for."""
    expect = weight_shapes(config)
    extra = sorted(set(weights) - set(expect))
    if extra:
        raise CheckpointError(f"{where}: unexpected tensor {extra[0]!r} for this config")
    for name, shape in expect.items():
        if name not in weights:
            raise CheckpointError(f"{where}: tensor {name!r} is missing")
        arr = weights[name]
        if tuple(arr.shape) != shape:
            raise CheckpointError(f"{where}: tensor {name!r} has shape {list(arr.shape)}, config needs {list(shape)}")
        st = safetensors_dtype(arr) if arr.dtype != BF16 else "BF16"
        if st not in LOADABLE_DTYPES:
            raise CheckpointError(f"{where}: tensor {name!r} is {st}, expected one of {', '.join(LOADABLE_DTYPES)}")


def weights_digest(weights: Mapping[str, np.ndarray]) -> str:
    """XXH3-128 (32 hex chars) over every tensor's name, dtype, shape and raw bytes, names sorted.

    Per tensor: ``"<name>\\0<safetensors dtype>\\0<d0,d1,...>\\0"`` (UTF-8) then the C-order
    little-endian bytes. The trainer computes it on the state dict it publishes and the engine on
    the tensors it loaded (before casting to float32): equal digests mean the engine serves
    exactly the trainer's weights.
    """
    h = xxhash.xxh3_128()
    for name in sorted(weights):
        arr = np.ascontiguousarray(weights[name])
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        shape = ",".join(str(d) for d in arr.shape)
        h.update(f"{name}\0{safetensors_dtype(arr)}\0{shape}\0".encode())
        h.update(memoryview(arr.reshape(-1).view(np.uint8)))
    return h.hexdigest()


# -- tokenizer ---------------------------------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (``tokenizers`` ByteLevel uses it)."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def tokenizer_json() -> dict[str, Any]:
    """The ``tokenizer.json`` document (Hugging Face ``tokenizers`` serialisation format)."""
    b2u = _bytes_to_unicode()
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": N_BYTES + i,
                "content": tok,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i, tok in enumerate(SPECIAL_TOKENS)
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "vocab": {b2u[b]: b for b in range(256)},
            "merges": [],
        },
    }


def tokenizer_config_json() -> dict[str, Any]:
    """``tokenizer_config.json``: special tokens and the ChatML chat template."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": EOS,
        "model_max_length": None,
        "chat_template": CHAT_TEMPLATE,
    }


class ByteTokenizer:
    """Byte-level tokenizer: ids 0..255 are UTF-8 bytes, then the special tokens.

    Args:
        specials: ``{token text: id}`` of the special tokens (from ``tokenizer.json``).
    """

    def __init__(self, specials: Mapping[str, int] | None = None) -> None:
        self.specials = dict(specials or {tok: N_BYTES + i for i, tok in enumerate(SPECIAL_TOKENS)})
        self.special_text = {i: t for t, i in self.specials.items()}
        self.eos_id = self.specials[EOS]
        self.im_start_id = self.specials[IM_START]
        self.im_end_id = self.specials[IM_END]
        self.stop_ids = frozenset((self.eos_id, self.im_end_id))

    def encode(self, text: str) -> list[int]:
        """UTF-8 bytes of ``text`` as ids (special-token text is NOT turned into special ids)."""
        return list(text.encode("utf-8"))

    def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """ChatML prompt ids for ``[{"role", "content"}]``, ending with the assistant header."""
        ids: list[int] = []
        for m in messages:
            ids.append(self.im_start_id)
            ids += self.encode(f"{m['role']}\n{m['content']}")
            ids.append(self.im_end_id)
            ids += self.encode("\n")
        ids.append(self.im_start_id)
        ids += self.encode("assistant\n")
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``: bytes as UTF-8 (invalid sequences become U+FFFD), specials dropped."""
        return bytes(i for i in ids if 0 <= i < N_BYTES).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a special token: its UTF-8 text)."""
        if 0 <= token_id < N_BYTES:
            return bytes((token_id,))
        return self.special_text.get(token_id, f"<|id_{token_id}|>").encode()

    def token_text(self, token_id: int) -> str:
        """One token as a string; a byte that is not valid UTF-8 alone shows as ``\\xNN``."""
        return self.token_bytes(token_id).decode("utf-8", errors="backslashreplace")


def parse_tokenizer(obj: Any, vocab_size: int, where: str = "tokenizer.json") -> ByteTokenizer:
    """Validate a parsed ``tokenizer.json`` as this byte-level tokenizer; returns it."""
    if not isinstance(obj, dict) or not isinstance(obj.get("model"), dict):
        raise CheckpointError(f"{where}: expected a tokenizers document with a 'model' object")
    vocab = obj["model"].get("vocab")
    b2u = _bytes_to_unicode()
    if not isinstance(vocab, dict) or any(vocab.get(b2u[b]) != b for b in range(256)):
        raise CheckpointError(f"{where}: not a byte-level vocabulary (ids 0..255 must be the bytes)")
    added = obj.get("added_tokens")
    if not isinstance(added, list):
        raise CheckpointError(f"{where}: 'added_tokens' must be a list")
    specials: dict[str, int] = {}
    for entry in added:
        if not isinstance(entry, dict) or not isinstance(entry.get("content"), str):
            raise CheckpointError(f"{where}: added_tokens entries must be objects with a 'content'")
        tid = entry.get("id")
        if not isinstance(tid, int) or isinstance(tid, bool) or not N_BYTES <= tid < vocab_size:
            raise CheckpointError(
                f"{where}: added token {entry['content'][:40]!r} has id {tid!r} outside [256, {vocab_size})"
            )
        specials[entry["content"]] = tid
    missing = [t for t in SPECIAL_TOKENS if t not in specials]
    if missing:
        raise CheckpointError(f"{where}: special token {missing[0]} is missing")
    return ByteTokenizer(specials)


# -- checkpoint directory ----------------------------------------------------------------------


def save_checkpoint(
    directory: str | os.PathLike[str], config: TinyGPTConfig, weights: Mapping[str, np.ndarray]
) -> Path:
    """Write ``weights`` (bf16 arrays, as ``init_weights`` makes) as a checkpoint directory.

    Files: config.json, model.safetensors (bf16), tokenizer.json, tokenizer_config.json. The
    weights are cast to bf16 if they are another float dtype. Returns the directory.
    Raises CheckpointError if the weights do not match the config.
    """
    check_weights(config, weights)
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    bf16 = {n: (a if a.dtype == BF16 else np.asarray(a, np.float32).astype(BF16)) for n, a in weights.items()}
    save(d / WEIGHTS_FILE, bf16, {"format": "pt"})
    (d / "config.json").write_text(json.dumps(config.to_json(), indent=2) + "\n")
    (d / "tokenizer.json").write_text(json.dumps(tokenizer_json(), ensure_ascii=False, indent=1) + "\n")
    (d / "tokenizer_config.json").write_text(json.dumps(tokenizer_config_json(), indent=2) + "\n")
    return d


class TensorSource(Protocol):
    """What ``load`` reads from: a ``bdn.client.Snapshot`` or a plain directory (``DirTensors``)."""

    path: Path

    def tensor(self, name: str) -> np.ndarray: ...

    def tensor_names(self) -> list[str]: ...


class DirTensors:
    """Zero-copy read-only views of ``model.safetensors`` in a plain checkpoint directory."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.path = Path(directory)
        file = self.path / WEIGHTS_FILE
        try:
            self._header = read_header(file)
            with open(file, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as exc:
            raise CheckpointError(f"cannot read {file}: {exc.strerror or exc}") from None
        except ProtocolError as exc:
            raise CheckpointError(f"{file}: {exc}") from None

    def tensor(self, name: str) -> np.ndarray:
        return tensor_view(self._map, self._header.tensors[name])

    def tensor_names(self) -> list[str]:
        return list(self._header.tensors)


def _read_json(path: Path, limit: int) -> Any:
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except FileNotFoundError:
        raise CheckpointError(f"{path.name} is missing from {path.parent}") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise CheckpointError(f"{path.name} is larger than {limit} bytes")
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path.name}: not valid JSON ({exc})") from None


def read_config(directory: str | os.PathLike[str]) -> TinyGPTConfig:
    """The validated ``config.json`` of a checkpoint directory."""
    return TinyGPTConfig.from_json(_read_json(Path(directory) / "config.json", MAX_CONFIG_BYTES))


def load(source: TensorSource, identity: str | None = None, policy_version: int | None = None) -> Model:
    """Build a ``Model`` from a checkpoint's config, tokenizer and tensors.

    Tensors are read through ``source`` (zero-copy views for a Snapshot), hashed with
    ``weights_digest`` as stored, and cast to float32 for compute (the only copy made).
    Raises CheckpointError naming the missing, extra or misshapen tensor or the bad file.
    """
    config = read_config(source.path)
    tokenizer = parse_tokenizer(_read_json(source.path / "tokenizer.json", MAX_TOKENIZER_BYTES), config.vocab_size)
    names = set(source.tensor_names())
    expect = weight_shapes(config)
    views: dict[str, np.ndarray] = {}
    for name in expect:
        if name not in names:
            raise CheckpointError(f"{source.path}: tensor {name!r} is missing")
        try:
            views[name] = source.tensor(name)
        except ProtocolError as exc:
            raise CheckpointError(f"{source.path}: tensor {name!r}: {exc}") from None
    extra = sorted(names - set(expect))
    if extra:
        raise CheckpointError(f"{source.path}: unexpected tensor {extra[0]!r} for this config")
    check_weights(config, views, str(source.path))
    digest = weights_digest(views)
    weights = {n: np.asarray(v, dtype=np.float32) for n, v in views.items()}
    del views  # the float32 copies are all the model keeps: the snapshot may be closed now
    return Model(config, weights, tokenizer, identity=identity, policy_version=policy_version, digest=digest)


def load_from_snapshot(snapshot: Any) -> Model:
    """A ``Model`` from an open ``bdn.client.Snapshot`` (identity and policy version from READY)."""
    return load(snapshot, identity=snapshot.identity, policy_version=snapshot.policy_version)


def load_checkpoint(directory: str | os.PathLike[str]) -> Model:
    """A ``Model`` from a plain checkpoint directory (no READY marker; identity unknown)."""
    return load(DirTensors(directory))


# -- the model ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Generation:
    """One completion.

    Attributes:
        token_ids: generated ids (the stop token included when one ended it).
        logprobs: natural-log probability of each generated id under the model's distribution
            before temperature and top-p (vLLM's default ``raw_logprobs``), one per id.
        top_logprobs: per position, the ``k`` most likely ``(id, logprob)`` pairs (empty if k=0).
        finish_reason: ``"stop"`` (a stop token) or ``"length"`` (max_tokens or the context end).
    """

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    finish_reason: str


def _layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def _gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


class Model:
    """A loaded tinygpt: float32 weights, tokenizer, and what it was loaded from.

    Attributes:
        config, tokenizer: as loaded.
        identity, policy_version: of the snapshot it came from (None for a plain directory).
        digest: ``weights_digest`` of the tensors as stored.
    Thread-safe: ``generate`` keeps all state in locals, so many requests may run at once.
    """

    def __init__(
        self,
        config: TinyGPTConfig,
        weights: dict[str, np.ndarray],
        tokenizer: ByteTokenizer,
        *,
        identity: str | None = None,
        policy_version: int | None = None,
        digest: str = "",
    ) -> None:
        self.config = config
        self.w = weights
        self.tokenizer = tokenizer
        self.identity = identity
        self.policy_version = policy_version
        self.digest = digest
        self._head = weights["transformer.wte.weight" if config.tie_word_embeddings else "lm_head.weight"]

    @property
    def max_model_len(self) -> int:
        return self.config.n_positions

    def forward(
        self, ids: Sequence[int], cache: list[tuple[np.ndarray, np.ndarray]] | None = None, all_logits: bool = False
    ) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
        """Run new tokens ``ids`` after the ``cache`` of earlier ones.

        Args:
            ids: token ids to append (at positions ``len(cache) .. len(cache)+len(ids)-1``).
            cache: per layer ``(K, V)``, each ``[n_head, T_past, head_dim]`` float32; None = empty.
            all_logits: return logits for every new position, not only the last.

        Returns:
            logits ``[len(ids), vocab]`` (or ``[1, vocab]``) float32, and the extended cache.
        Raises ValueError for an id outside the vocabulary or past ``n_positions``.
        """
        c = self.config
        arr = np.asarray(ids, dtype=np.int64)
        past = 0 if not cache else cache[0][0].shape[1]
        t = arr.shape[0]
        if t == 0:
            raise ValueError("forward needs at least one token")
        if arr.min() < 0 or arr.max() >= c.vocab_size:
            raise ValueError(f"token id outside [0, {c.vocab_size})")
        if past + t > c.n_positions:
            raise ValueError(f"{past + t} tokens exceed the context of {c.n_positions}")
        w, eps, nh, hd = self.w, c.layer_norm_epsilon, c.n_head, c.head_dim
        x = w["transformer.wte.weight"][arr] + w["transformer.wpe.weight"][past : past + t]
        # Query i (absolute position past+i) may attend keys 0..past+i.
        mask = np.triu(np.ones((t, past + t), dtype=bool), k=past + 1)
        new_cache: list[tuple[np.ndarray, np.ndarray]] = []
        for layer in range(c.n_layer):
            p = f"transformer.h.{layer}."
            h = _layer_norm(x, w[p + "ln_1.weight"], w[p + "ln_1.bias"], eps)
            qkv = h @ w[p + "attn.c_attn.weight"] + w[p + "attn.c_attn.bias"]
            q, k, v = (m.reshape(t, nh, hd).transpose(1, 0, 2) for m in np.split(qkv, 3, axis=-1))
            if cache:
                k = np.concatenate([cache[layer][0], k], axis=1)
                v = np.concatenate([cache[layer][1], v], axis=1)
            new_cache.append((k, v))
            att = (q @ k.transpose(0, 2, 1)) / math.sqrt(hd)
            att = np.where(mask, -np.inf, att)
            att = np.exp(att - att.max(-1, keepdims=True))
            att /= att.sum(-1, keepdims=True)
            y = (att @ v).transpose(1, 0, 2).reshape(t, c.n_embd)
            x = x + y @ w[p + "attn.c_proj.weight"] + w[p + "attn.c_proj.bias"]
            h = _layer_norm(x, w[p + "ln_2.weight"], w[p + "ln_2.bias"], eps)
            h = _gelu(h @ w[p + "mlp.c_fc.weight"] + w[p + "mlp.c_fc.bias"])
            x = x + h @ w[p + "mlp.c_proj.weight"] + w[p + "mlp.c_proj.bias"]
        if not all_logits:
            x = x[-1:]
        x = _layer_norm(x, w["transformer.ln_f.weight"], w["transformer.ln_f.bias"], eps)
        return (x @ self._head.T).astype(np.float32, copy=False), new_cache

    def generate_detailed(
        self,
        token_ids: Sequence[int],
        max_tokens: int,
        temperature: float = 1.0,
        seed: int | None = None,
        *,
        top_p: float = 1.0,
        top_logprobs: int = 0,
        stop_ids: frozenset[int] | None = None,
    ) -> Generation:
        """Sample up to ``max_tokens`` ids after the prompt ``token_ids``.

        ``temperature`` 0 is greedy (deterministic); otherwise sampling from softmax(logits / T)
        restricted to the smallest set of ids whose probability reaches ``top_p``, with a
        ``numpy.random.default_rng(seed)`` (same seed, same prompt, same weights: same output).
        Stops after a stop id (default: the tokenizer's ``<|im_end|>``, ``<|endoftext|>``), after
        ``max_tokens``, or at the end of the context.
        """
        if not token_ids:
            raise ValueError("the prompt must hold at least one token")
        if max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        if not (temperature >= 0 and math.isfinite(temperature)):
            raise ValueError("temperature must be a finite number >= 0")
        if not 0 < top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        stops = self.tokenizer.stop_ids if stop_ids is None else stop_ids
        rng = np.random.default_rng(seed)
        out: list[int] = []
        lps: list[float] = []
        tops: list[list[tuple[int, float]]] = []
        finish = "length"
        logits, cache = self.forward(token_ids)
        budget = min(max_tokens, self.config.n_positions - len(token_ids))
        for step in range(budget):
            z = logits[-1].astype(np.float64)
            logp = _log_softmax(z)
            if temperature == 0:
                nxt = int(np.argmax(z))
            else:
                probs = np.exp(_log_softmax(z / temperature))
                if top_p < 1:
                    order = np.argsort(-probs, kind="stable")
                    keep = order[: int(np.searchsorted(np.cumsum(probs[order]), top_p) + 1)]
                    masked = np.zeros_like(probs)
                    masked[keep] = probs[keep]
                    probs = masked / masked.sum()
                nxt = int(rng.choice(probs.shape[0], p=probs))
            out.append(nxt)
            lps.append(float(logp[nxt]))
            if top_logprobs:
                best = np.argsort(-logp, kind="stable")[:top_logprobs]
                tops.append([(int(i), float(logp[i])) for i in best])
            if nxt in stops:
                finish = "stop"
                break
            if step + 1 < budget:
                logits, cache = self.forward([nxt], cache)
        return Generation(out, lps, tops, finish)

    def generate(
        self, token_ids: Sequence[int], max_tokens: int, temperature: float = 1.0, seed: int | None = None
    ) -> tuple[list[int], list[float]]:
        """``(generated ids, their log-probabilities)``; see ``generate_detailed``."""
        g = self.generate_detailed(token_ids, max_tokens, temperature, seed)
        return g.token_ids, g.logprobs


# -- CLI ---------------------------------------------------------------------------------------


def optimizer_step(weights: Mapping[str, np.ndarray], frac: float = 0.02, seed: int = 1) -> dict[str, np.ndarray]:
    """A simulated RL optimizer step: about ``frac`` of the bf16 values change a little."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for name, arr in weights.items():
        w = np.asarray(arr, dtype=np.float32).copy()
        mask = rng.random(w.shape) < frac
        w[mask] += rng.normal(0, 1, int(mask.sum())).astype(np.float32) * (np.abs(w[mask]) * 0.1 + 1e-2)
        out[name] = w.astype(BF16)
    return out


def _main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tinygpt.py", description="Make tinygpt checkpoints.")
    sub = p.add_subparsers(dest="cmd", required=True)
    init = sub.add_parser("init", help="write freshly initialised weights to DIR")
    init.add_argument("dir")
    init.add_argument("--seed", type=int, default=0)
    for key in ("n_layer", "n_head", "n_embd", "n_positions"):
        init.add_argument("--" + key.replace("_", "-"), type=int, default=getattr(TinyGPTConfig(), key))
    st = sub.add_parser("step", help="copy SRC to DST with a simulated optimizer step")
    st.add_argument("src")
    st.add_argument("dst")
    st.add_argument("--frac", type=float, default=0.02)
    st.add_argument("--seed", type=int, default=1)
    dg = sub.add_parser("digest", help="print the weights digest of DIR")
    dg.add_argument("dir")
    a = p.parse_args(argv)
    try:
        if a.cmd == "init":
            cfg = TinyGPTConfig(n_layer=a.n_layer, n_head=a.n_head, n_embd=a.n_embd, n_positions=a.n_positions)
            w = init_weights(cfg, a.seed)
            save_checkpoint(a.dir, cfg, w)
            print(f"{a.dir}: tinygpt {sum(x.size for x in w.values())} parameters, digest {weights_digest(w)}")
        elif a.cmd == "step":
            src = DirTensors(a.src)
            cfg = read_config(a.src)
            w = optimizer_step({n: src.tensor(n) for n in src.tensor_names()}, a.frac, a.seed)
            save_checkpoint(a.dst, cfg, w)
            print(f"{a.dst}: digest {weights_digest(w)}")
        else:
            print(load_checkpoint(a.dir).digest)
    except CheckpointError as exc:
        print(f"tinygpt.py: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main())
