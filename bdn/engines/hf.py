"""A Hugging Face transformers + torch causal LM that bdn hot-swaps (CPU here, GPU where present).

``HFEngine`` holds one model loaded from a bdn snapshot directory
(``AutoModelForCausalLM.from_pretrained(path, dtype="auto")``: the checkpoint's own dtype, no hub
download) and generates token by token under a ``PolicyGate``. It is an adapter for
``bdn.engines.driver.drive``:

- ``prepare(snapshot, offer, options)`` runs while the old weights keep serving. With a model
  loaded and the same ``config.json``, it finds the changed tensors (``offer["changed_tensors"]``
  or by comparing the two snapshots, bdn.engines.changed) and copies only those out of the
  snapshot's shared memory into staging tensors (a *partial swap*); otherwise it loads the whole
  new model (a *full reload*).
- ``swap(prepared)`` replaces the weights as the in-flight policy says (bdn.engines.gate). With
  ``swap_method="rebind"`` (the default) each changed parameter is pointed at its staged tensor
  (``param.data = staged``, no bytes move in the pause: the staged tensor already holds the new
  weights, and the old storage is freed after the swap, so peak memory is the same as copying);
  with ``"copy"`` each staged tensor is copied into the parameter's own storage (one memcpy per
  tensor, pointer-stable: what an engine whose kernels captured the weights' addresses, e.g. CUDA
  graphs, must do). A first load swaps the model object. The prompt cache is dropped
  (``RESET_ALL``) or kept (``PRESERVE``). The report says what was done.

The prompt cache: the KV cache of every prompt (``transformers.DynamicCache``), reused for a later
prompt that starts with it; each entry remembers the policy version that computed it, and answers
report ``cached_tokens`` and that version, so a stale (off-policy) reuse is visible.

Errors: ``EngineError`` (one line) for a snapshot this engine cannot load; exceptions from torch
propagate to the driver, which acks them as the replica's error.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from bdn.client import Snapshot
from bdn.engines import changed as changed_mod
from bdn.engines.gate import Aborted, PolicyGate, Ticket
from bdn.engines.prompt_cache import PromptCache
from bdn.engines.weights import SpareBuffers, copy_into, pread_into, slots_of
from bdn.engines.options import HotLoadOptions
from bdn.proto.errors import BdnError

log = logging.getLogger("bdn.engines.hf")

__all__ = ["EngineError", "Generation", "HFEngine", "Prepared", "torch_available"]

CONFIG_NAME = "config.json"
SWAP_METHODS = ("rebind", "copy")


def torch_available() -> str | None:
    """None when torch and transformers import; else the reason (for skips and fallbacks)."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except Exception as exc:  # ImportError, or a broken build raising something else
        return f"torch/transformers not importable: {type(exc).__name__}: {exc}"
    return None


class EngineError(BdnError):
    """A snapshot the engine cannot load or a request it cannot serve (one line)."""


_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "I64": "int64",
           "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


@dataclass
class Prepared:
    """A new policy ready to swap in: ``mode`` ``"partial"`` / ``"full"`` (``tensors`` copied in place)
    or ``"load"`` (a new ``model``)."""

    snapshot: Snapshot
    options: HotLoadOptions
    mode: str
    tensors: dict[str, Any] = field(default_factory=dict)
    model: Any = None
    changed_source: str = ""
    reason: str = ""
    prepare_ms: float = 0.0
    bytes_copied: int = 0


@dataclass
class Generation:
    """One completion: token ids, each token's log-probability and top-k, and where it came from."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    finish_reason: str  # "stop" | "length" | "abort"
    policy_versions: list[int | None]
    identity: str | None
    cached_tokens: int
    cache_policy_version: int | None


def _torch():
    import torch

    return torch


class HFEngine:
    """One transformers causal LM, hot-swapped by bdn. Thread-safe.

    Args:
        device: torch device (``"cpu"``; ``"cuda"`` where present).
        partial: swap only changed tensors when possible (False: every swap copies every tensor,
            a full reload, for comparing the pause).
        swap_method: ``"rebind"`` (parameters take the staged tensors) or ``"copy"`` (staged
            tensors are copied into the parameters in place); see the module doc.
        clock: monotonic seconds, for the reported timings.

    Raises EngineError (one line) when torch/transformers do not import or ``swap_method`` is
    not one of ``SWAP_METHODS``.
    """

    def __init__(self, device: str = "cpu", partial: bool = True, clock: Any = time.monotonic,
                 swap_method: str = "rebind") -> None:
        why = torch_available()
        if why:
            raise EngineError(why)
        if swap_method not in SWAP_METHODS:
            raise EngineError(f"swap_method must be one of {', '.join(SWAP_METHODS)}, got {swap_method!r}")
        self.swap_method = swap_method
        import transformers

        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()
        self.device = device
        self.partial = partial
        self.clock = clock
        self.gate = PolicyGate(clock=clock)
        self.model: Any = None
        self.tokenizer: Any = None
        self.snapshot: Snapshot | None = None
        self.params: dict[str, Any] = {}
        self._slots: dict[str, Any] = {}  # state-dict name -> the model's Parameter / buffer object
        self._aliases: dict[str, list[str]] = {}  # name -> every state-dict name of the same object (tied)
        self.spares = SpareBuffers(enabled=device == "cpu")  # storages the last swap freed, for the next prepare
        self.prompt_cache = PromptCache()
        self.last_swap: dict[str, Any] | None = None
        self.last_swap_tensors: list[str] = []  # names copied by the last swap (all, for a full reload)
        self.swaps = 0

    # -- what is served --------------------------------------------------------------------
    @property
    def identity(self) -> str | None:
        """The identity of the snapshot being served, or None before the first load."""
        return self.snapshot.identity if self.snapshot else None

    @property
    def policy_version(self) -> int | None:
        """The policy version being served (what every sample reports), or None."""
        return self.gate.version

    def weights_digest(self) -> dict[str, str]:
        """``{tensor name: xxh3-128 hex of its bytes}`` as served now (compare with the trainer's)."""
        torch = _torch()
        out = {}
        with torch.no_grad():
            for name, t in self.params.items():
                raw = t.detach().to("cpu").contiguous().reshape(-1)
                out[name] = xxhash.xxh3_128_hexdigest(raw.view(torch.uint8).numpy().tobytes())
        return out

    # -- prepare (while serving) -----------------------------------------------------------
    def _load_full(self, snap: Snapshot) -> tuple[Any, Any]:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        try:
            model = AutoModelForCausalLM.from_pretrained(str(snap.path), dtype="auto", local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            raise EngineError(f"{snap.identity}: transformers cannot load {snap.path}: {str(exc).splitlines()[0][:300]}") from None
        model.to(self.device).eval()
        if self.device == "cpu":
            # transformers leaves CPU parameters mapped copy-on-write from the snapshot's files in
            # shm: the first in-place swap would then pay a page fault per 4 KiB inside the pause
            # (measured: 1.5 s instead of 0.2 s for 0.6 GB), and the engine would pin the
            # snapshot's pages after GC. Copy them into the engine's own memory now, while preparing.
            with _torch().no_grad():
                for t in [*model.parameters(), *model.buffers()]:
                    t.data = t.data.clone()
        tok = None
        if (snap.path / "tokenizer.json").is_file() or (snap.path / "tokenizer_config.json").is_file():
            tok = AutoTokenizer.from_pretrained(str(snap.path), local_files_only=True)
        return model, tok

    def _staged(self, snap: Snapshot, names: list[str]) -> tuple[dict[str, Any], int] | str:
        """Copies of ``names`` out of ``snap`` as torch tensors; a reason string if one cannot be swapped.

        On CPU each tensor is read with ``os.preadv`` straight into a spare buffer of its size (the
        storage the last swap freed, already faulted in) or a new one: measured on 152 MB with both
        cores busy, 176-185 ms into a spare buffer, 277-309 ms into a new one, 305-1320 ms copying
        out of the snapshot's mapping (a page fault per 4 KiB on both sides).
        """
        torch = _torch()
        infos = changed_mod.tensor_infos(snap)
        out: dict[str, Any] = {}
        total = 0
        for name in names:
            live = self.params.get(name)
            if live is None:
                return f"tensor {name[:80]!r} is not a parameter of the served model"
            info = infos[name]
            dt = _DTYPES.get(info.dtype)
            if dt is None or getattr(torch, dt) != live.dtype or tuple(info.shape) != tuple(live.shape):
                return f"tensor {name[:80]!r} changed dtype or shape ({info.dtype} {list(info.shape)})"
            if self.device == "cpu":
                buf = self.spares.take(info.nbytes, live.dtype)
                pread_into(snap.path.joinpath(*snap.tensor_file(name).split("/")), info.start, buf)
                out[name] = buf.view(live.dtype).reshape(live.shape)
            else:
                raw = np.array(snap.tensor(name).reshape(-1).view(np.uint8))  # the one copy out of shm
                out[name] = torch.from_numpy(raw).view(live.dtype).reshape(live.shape).to(self.device)
            total += info.nbytes
        return out, total

    def prepare(self, snap: Snapshot, offer: dict[str, Any], options: HotLoadOptions) -> Prepared:
        """Stage ``snap`` while the current policy serves (see the module doc).

        With a model loaded and the same ``config.json``: the changed tensors are staged
        (``mode "partial"``), or every tensor when partial swaps are off (``mode "full"``, copied in
        place like the partial one, so the two pauses compare copy sizes). Otherwise a new model
        object is built (``mode "load"``: the first load, or an architecture change).
        """
        t0 = self.clock()
        serving = self.snapshot
        prep: Prepared | None = None
        reason = ""
        if serving is not None:
            if _read(serving.path / CONFIG_NAME) != _read(snap.path / CONFIG_NAME):
                reason = "config.json changed"
            else:
                ch = changed_mod.changed_tensors(offer, serving, snap) if self.partial else None
                if ch is not None and ch.removed:
                    reason = f"{len(ch.removed)} tensor(s) removed"
                else:
                    names = ch.names if ch is not None else snap.tensor_names()
                    staged = self._staged(snap, names)
                    if isinstance(staged, str):
                        reason = staged
                    else:
                        prep = Prepared(snap, options, "partial" if ch is not None else "full", tensors=staged[0],
                                        changed_source=ch.source if ch is not None else "", bytes_copied=staged[1])
            if prep is None:
                log.info("%s: loading a new model object (%s)", snap.identity, reason)
        if prep is None:
            model, tok = self._load_full(snap)
            nbytes = sum(p.numel() * p.element_size() for p in model.state_dict().values())
            prep = Prepared(snap, options, "load", model=(model, tok), bytes_copied=nbytes, reason=reason)
        prep.prepare_ms = (self.clock() - t0) * 1000.0
        return prep

    # -- swap (the pause) ------------------------------------------------------------------
    def swap(self, prep: Prepared) -> dict[str, Any]:
        """Swap ``prep`` in under the gate; the report acked to the daemon and shown by the API.

        Report: ``{"identity", "policy_version", "mode", "tensors_copied", "bytes_copied",
        "changed_source", "prompt_cache": "reset"|"preserved", "prompt_cache_entries_dropped",
        "prepare_ms", "pause_ms", "drain_ms", "aborted", "kept", ...options}``.
        """
        torch = _torch()
        dropped = 0
        freed: list[Any] = []  # storages no longer in use once apply returned

        def apply() -> None:
            nonlocal dropped
            with torch.no_grad():
                if prep.mode in ("partial", "full") and self.swap_method == "copy":
                    for name, t in prep.tensors.items():
                        copy_into(self.params[name], t)
                    freed.extend(prep.tensors.values())
                elif prep.mode in ("partial", "full"):
                    for name, t in prep.tensors.items():
                        slot = self._slots.get(name)
                        if slot is None:  # a state-dict entry that is no parameter or buffer object
                            copy_into(self.params[name], t)
                            freed.append(t)
                            continue
                        freed.append(self.params[name])
                        slot.data = t
                        for alias in self._aliases[name]:
                            self.params[alias] = slot.detach()
                else:
                    model, tok = prep.model
                    self.model, self.tokenizer = model, tok
                    self.params = dict(model.state_dict(keep_vars=False))
                    self._slots, self._aliases = slots_of(model, self.params)
            if prep.options.reset_prompt_cache:
                dropped = self.prompt_cache.clear()
            self.snapshot = prep.snapshot

        gate_opts = prep.options
        if prep.mode == "load" and gate_opts.inflight_policy == "keep" and self.model is not None:
            # A new model object may not accept KV caches the old one computed: end them instead.
            gate_opts = dataclasses.replace(gate_opts, inflight_policy="abort")
        outcome = self.gate.swap(apply, gate_opts, prep.snapshot.policy_version)
        self.spares.keep(freed)
        self.swaps += 1
        report = {
            "identity": prep.snapshot.identity,
            "policy_version": prep.snapshot.policy_version,
            "mode": prep.mode,
            "tensors_copied": len(prep.tensors) if prep.mode != "load" else len(self.params),
            "swap_method": self.swap_method if prep.mode != "load" else "load",
            "tensors_total": len(self.params),
            "bytes_copied": prep.bytes_copied,
            "changed_source": prep.changed_source or None,
            "full_reload_reason": prep.reason or None,
            "prompt_cache": "reset" if prep.options.reset_prompt_cache else "preserved",
            "prompt_cache_entries_dropped": dropped,
            "prepare_ms": round(prep.prepare_ms, 3),
            "pause_ms": round(outcome.pause_ms, 3),
            "drain_ms": round(outcome.drain_ms, 3),
            "aborted": outcome.aborted,
            "kept": outcome.kept,
            **prep.options.wire(),
            "inflight_policy_applied": gate_opts.inflight_policy,
        }
        self.last_swap = report
        self.last_swap_tensors = list(prep.tensors) if prep.mode != "load" else list(self.params)
        return report

    # -- generation ------------------------------------------------------------------------
    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a chat prompt: the tokenizer's chat template if the snapshot has one,
        else a plain ``<|role|>content`` rendering; without a tokenizer the UTF-8 bytes are the tokens."""
        tok = self.tokenizer
        if tok is not None and getattr(tok, "chat_template", None):
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return [int(i) for i in ids]
        text = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages) + "<|assistant|>"
        if tok is not None:
            return [int(i) for i in tok.encode(text, add_special_tokens=False)]
        return list(text.encode("utf-8"))  # no tokenizer in the snapshot: bytes are the tokens

    def decode(self, ids: list[int]) -> str:
        """Text of token ids (special tokens skipped); without a tokenizer, the bytes as UTF-8."""
        if self.tokenizer is not None:
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def token_text(self, i: int) -> str:
        """The text of one token id (the tokenizer's token string), for logprob answers."""
        return self.decode([i]) if self.tokenizer is None else self.tokenizer.convert_ids_to_tokens(i) or ""

    @property
    def max_model_len(self) -> int:
        """The model's context length in tokens (``max_position_embeddings``, default 2048)."""
        cfg = getattr(self.model, "config", None)
        return int(getattr(cfg, "max_position_embeddings", 2048) or 2048)

    def eos_ids(self) -> set[int]:
        """Token ids that end generation (the generation config's ``eos_token_id``)."""
        cfg = getattr(self.model, "generation_config", None) or getattr(self.model, "config", None)
        e = getattr(cfg, "eos_token_id", None)
        return set(e) if isinstance(e, list) else ({e} if isinstance(e, int) else set())

    def _forward(self, ids: list[int], kv: Any) -> tuple[Any, Any]:
        torch = _torch()
        from transformers import DynamicCache

        if kv is None:
            kv = DynamicCache()
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        model = self.model
        if getattr(model, "_bdn_cache_kw", None) is None:
            import inspect

            # transformers >= 5.2x names the argument ``cache``; older ones ``past_key_values``.
            model._bdn_cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        out = model(input_ids=x, use_cache=True, **{model._bdn_cache_kw: kv})
        return out.logits[0, -1].float(), kv

    def generate(self, ticket: Ticket, prompt: list[int], max_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, seed: int | None = None, top_logprobs: int = 0,
                 stop_ids: set[int] | None = None) -> Generation:
        """Generate under an admitted ``ticket`` (``with engine.gate.admit() as ticket``).

        ``temperature`` 0 is greedy. Log-probabilities are the model's before temperature and
        top-p. An abort by a hot-load ends it with ``finish_reason "abort"``.

        ``prompt``: token ids; at most ``max_tokens`` tokens are generated, stopping at the first
        of ``stop_ids`` (default: :meth:`eos_ids`, the model's ``eos_token_id``), which is kept
        in the output. Raises EngineError when no model is loaded yet.
        """
        torch = _torch()
        gen = torch.Generator().manual_seed(seed if seed is not None else int(time.time_ns() % (1 << 63)))
        stop_ids = self.eos_ids() if stop_ids is None else stop_ids
        out_ids: list[int] = []
        lps: list[float] = []
        tops: list[list[tuple[int, float]]] = []
        finish = "length"
        cached, cache_version = 0, None
        identity = None
        kv = None
        try:
            with torch.no_grad():
                with self.gate.step(ticket) as version:
                    if self.model is None:
                        raise EngineError("no model is loaded yet")
                    identity = self.identity
                    hit = self.prompt_cache.lookup(prompt)
                    if hit is not None:
                        kv, cached, cache_version = hit
                    logits, kv = self._forward(prompt[cached:], kv)
                    self.prompt_cache.put(tuple(prompt), copy.deepcopy(kv), version)
                for _ in range(max_tokens):
                    logp = torch.log_softmax(logits, -1)
                    if temperature == 0:
                        tid = int(torch.argmax(logits))
                    else:
                        probs = torch.softmax(logits / temperature, -1)
                        if top_p < 1.0:
                            sp, si = torch.sort(probs, descending=True)
                            keep = torch.cumsum(sp, 0) - sp < top_p
                            probs = torch.zeros_like(probs).scatter(0, si[keep], sp[keep])
                        tid = int(torch.multinomial(probs / probs.sum(), 1, generator=gen))
                    out_ids.append(tid)
                    lps.append(float(logp[tid]))
                    if top_logprobs:
                        v, i = torch.topk(logp, min(top_logprobs, logp.numel()))
                        tops.append([(int(a), float(b)) for a, b in zip(i, v)])
                    if tid in stop_ids:
                        finish = "stop"
                        break
                    if len(out_ids) == max_tokens:
                        break
                    with self.gate.step(ticket):
                        identity = self.identity
                        logits, kv = self._forward([tid], kv)
        except Aborted:
            finish = "abort"
        return Generation(prompt, out_ids, lps, tops, finish, list(ticket.versions), identity, cached, cache_version)


def _read(p: Path) -> bytes | None:
    try:
        return p.read_bytes()
    except OSError:
        return None

