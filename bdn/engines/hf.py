"""A Hugging Face transformers + torch causal LM that bdn hot-swaps (CPU here, GPU where present).

``HFEngine`` holds one model loaded from a bdn snapshot directory
(``AutoModelForCausalLM.from_pretrained(path, dtype="auto")``: the checkpoint's own dtype, no hub
download) and generates token by token under a ``PolicyGate``. It is an adapter for
``bdn.engines.driver.drive``:

- ``prepare(snapshot, offer, options)`` runs while the old weights keep serving. With a model
  loaded on the CPU, the same ``config.json`` and an offer naming the delta's verified diff files
  on the served snapshot (``changed_words``), it checks a *word-level swap*
  (:mod:`bdn.engines.hf_words`: the swap then XORs only the changed words into the parameters,
  in place, in the pause; with ``words="pingpong"`` they are XORed now into spare buffers kept
  one step behind, :mod:`bdn.engines.hf_pingpong`, and the pause rebinds). Otherwise, with a model loaded and the same ``config.json``, it finds
  the changed tensors (``offer["changed_tensors"]``
  or by comparing the two snapshots, bdn.engines.changed) and copies only those out of the
  snapshot's shared memory into staging tensors (a *partial swap*); otherwise it loads the whole
  new model (a *full reload*).
- ``swap(prepared)`` replaces the weights as the in-flight policy says (bdn.engines.gate). With
  ``swap_method="rebind"`` (the default) each changed parameter is pointed at its staged tensor
  (``param.data = staged``, no bytes move in the pause: the staged tensor already holds the new
  weights, and the old storage is freed after the swap, so peak memory is the same as copying);
  with ``"copy"`` each staged tensor is copied into the parameter's own storage (one memcpy per
  tensor, pointer-stable: what an engine whose kernels captured the weights' addresses, e.g. CUDA
  graphs, must do). An in-place word-level swap writes the changed words into the parameters' own
  storage (pointer-stable, one copy of the model; a failure reads the changed tensors from the
  target snapshot instead, one log line); a ping-pong one rebinds, and the buffers swapped out
  become the spares (brought forward by the delta on a thread). A first load swaps the model object. The prompt cache is dropped
  (``RESET_ALL``) or kept (``PRESERVE``). The report says what was done.

The prompt cache: the KV cache of every prompt (``transformers.DynamicCache``), reused for a later
prompt that starts with it; each entry remembers the policy version that computed it, and answers
report ``cached_tokens`` and that version, so a stale (off-policy) reuse is visible.

What is read out of a snapshot (the whole model, or the staged tensors) is
:mod:`bdn.engines.hf_staging`'s; tokens, text and the choice of the next token are
:mod:`bdn.engines.hf_sampling`'s. This module holds the served state and the order of the steps.

Errors: ``EngineError`` (one line) for a snapshot this engine cannot load; exceptions from torch
propagate to the driver, which acks them as the replica's error.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import xxhash

from bdn.client import Snapshot
from bdn.engines import changed as changed_mod
from bdn.engines import hf_pingpong, hf_words
from bdn.engines import hf_sampling as sampling
from bdn.engines.gate import Aborted, PolicyGate, Ticket
from bdn.engines.hf_staging import EngineError, load_model, same_config, stage_tensors, torch, torch_available
from bdn.engines.options import HotLoadOptions
from bdn.engines.prompt_cache import PromptCache
from bdn.engines.weights import SpareBuffers, copy_into, slots_of
from bdn.priority import BACKGROUND_NICE
from bdn.proto.errors import BdnError

log = logging.getLogger("bdn.engines.hf")

__all__ = ["EngineError", "Generation", "HFEngine", "Prepared", "torch_available"]

SWAP_METHODS = ("rebind", "copy")


@dataclass
class Prepared:
    """A new policy ready to swap in: ``mode`` ``"partial"`` / ``"full"`` (``tensors`` copied in place,
    or with ``words`` the changed words XORed in place) or ``"load"`` (a new ``model``)."""

    snapshot: Snapshot
    options: HotLoadOptions
    mode: str
    tensors: dict[str, Any] = field(default_factory=dict)
    model: Any = None
    changed_source: str = ""
    reason: str = ""
    prepare_ms: float = 0.0
    prepare_cpu_ms: float = 0.0  # this process's CPU time (every thread) while preparing
    bytes_copied: int = 0
    ranges: int = 0  # tensors of which only the offer's changed byte ranges were read
    words: hf_words.WordPlan | None = None  # a word-level swap (bdn.engines.hf_words)
    words_fallback: str = ""  # why the offer's changed_words were not (or not wholly) used
    pingpong: hf_pingpong.Step | None = None  # a ping-pong swap: what its prepare wrote


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


class HFEngine:
    """One transformers causal LM, hot-swapped by bdn. Thread-safe.

    Args:
        device: torch device (``"cpu"``; ``"cuda"`` where present).
        partial: swap only changed tensors when possible (False: every swap copies every tensor,
            a full reload, for comparing the pause).
        swap_method: ``"rebind"`` (parameters take the staged tensors) or ``"copy"`` (staged
            tensors are copied into the parameters in place); see the module doc.
        clock: monotonic seconds, for the reported timings.
        words: where a word-level swap writes (``bdn.engines.hf_words.MODES``): ``"pingpong"``
            (spare buffers kept one step behind, while serving, the pause a rebind:
            :mod:`bdn.engines.hf_pingpong`; the default), ``"inplace"`` (the parameters, in the
            pause; the default with ``swap_method="copy"``, which must keep the parameters'
            addresses) or ``"off"``.
        background_nice: nice increment (0..19) of the engine's background threads (the ping-pong
            catch-up after a swap, checksums and spare buffers after a load; ``bdn.priority``),
            so that they give the cores to serving and to the next ack; 0 = the engine's own.

    Raises EngineError (one line) when torch/transformers do not import or ``swap_method`` is
    not one of ``SWAP_METHODS``, or ``words`` not one of ``hf_words.MODES``.
    """

    def __init__(
        self,
        device: str = "cpu",
        partial: bool = True,
        clock: Any = time.monotonic,
        swap_method: str = "rebind",
        words: str | None = None,
        background_nice: int = BACKGROUND_NICE,
    ) -> None:
        why = torch_available()
        if why:
            raise EngineError(why)
        if swap_method not in SWAP_METHODS:
            raise EngineError(f"swap_method must be one of {', '.join(SWAP_METHODS)}, got {swap_method!r}")
        self.swap_method = swap_method
        if words is None:  # (a rebind keeps the parameters' addresses only in place)
            words = "inplace" if swap_method == "copy" else "pingpong"
        if words not in hf_words.MODES:
            raise EngineError(f"words must be one of {', '.join(hf_words.MODES)}, got {words!r}")
        self.words = words
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
        self.adlers = hf_words.Adlers()  # the served parameters' Adler-32s (word-level swaps check them)
        self.background_nice = background_nice
        self.pingpong = hf_pingpong.PingPong(
            background_nice=background_nice
        )  # ``words="pingpong"``: the spare buffers one step behind
        # the sparse kernel: loaded on a thread from the first offer of changed words on (numba's
        # import holds the GIL for a while: not while the engine starts and loads its first model)
        self.kernel = hf_words.KernelWarmup(start=False)

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
        th = torch()
        out = {}
        with th.no_grad():
            for name, t in self.params.items():
                raw = t.detach().to("cpu").contiguous().reshape(-1)
                out[name] = xxhash.xxh3_128_hexdigest(raw.view(th.uint8).numpy().tobytes())
        return out

    def weight_bytes(self) -> dict[str, int]:
        """Bytes of weight memory the engine holds now: ``parameters`` (the served state dict, each
        storage once), ``pingpong`` (the spare buffers of ``words="pingpong"``), ``staging`` (the
        buffers kept for the next staged swap, ``SpareBuffers``)."""
        seen: set[int] = set()
        served = 0
        for t in self.params.values():
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                served += t.numel() * t.element_size()
        return {"parameters": served, "pingpong": self.pingpong.nbytes(), "staging": self.spares.nbytes()}

    # -- prepare (while serving) -----------------------------------------------------------
    def prepare(self, snap: Snapshot, offer: dict[str, Any], options: HotLoadOptions) -> Prepared:
        """Stage ``snap`` while the current policy serves (see the module doc).

        With a model loaded and the same ``config.json``: a word-level swap when the offer's
        ``changed_words`` pass every check (``mode "partial"``, ``changed_source "words"``; a
        refused one is logged in one line and reported as ``words_fallback``), else the changed
        tensors are staged (``mode "partial"``), or every tensor when partial swaps are off (``mode "full"``, copied in
        place like the partial one, so the two pauses compare copy sizes). Otherwise a new model
        object is built (``mode "load"``: the first load, or an architecture change).
        """
        t0, cpu0 = self.clock(), time.process_time()
        serving = self.snapshot
        prep: Prepared | None = None
        reason = words_fallback = ""
        if serving is not None:
            if not same_config(serving, snap):
                reason = "config.json changed"
            elif self.partial and self.device == "cpu" and self.words != "off" and "changed_words" in offer:
                prep, words_fallback = self._prepare_words(snap, offer, options)
            if prep is None and self.words == "pingpong":  # staged or loaded: the spare buffers fall behind
                self._drop_pingpong()
            if prep is None and not reason:
                ch = changed_mod.changed_tensors(offer, serving, snap) if self.partial else None
                if ch is not None and ch.removed:
                    reason = f"{len(ch.removed)} tensor(s) removed"
                else:
                    names = ch.names if ch is not None else snap.tensor_names()
                    staged = stage_tensors(
                        snap, names, self.params, self.device, self.spares, ch.ranges if ch is not None else None
                    )
                    if isinstance(staged, str):
                        reason = staged
                    else:
                        prep = Prepared(
                            snap,
                            options,
                            "partial" if ch is not None else "full",
                            tensors=staged[0],
                            changed_source=ch.source if ch is not None else "",
                            bytes_copied=staged[1],
                            ranges=len(ch.ranges or {}) if ch is not None else 0,
                            words_fallback=words_fallback,
                        )
            if prep is None:
                log.info("%s: loading a new model object (%s)", snap.identity, reason)
        if prep is None:
            model, tok = load_model(snap, self.device)
            if self.model is None:  # the first load: the first prepare's buffers are faulted in now
                self.spares.keep([])
                th = self.spares.prefill(list(model.state_dict().values()), self.background_nice)
                if th is not None:
                    th.join()
            nbytes = sum(p.numel() * p.element_size() for p in model.state_dict().values())
            prep = Prepared(snap, options, "load", model=(model, tok), bytes_copied=nbytes, reason=reason)
        prep.prepare_ms = (self.clock() - t0) * 1000.0
        prep.prepare_cpu_ms = (time.process_time() - cpu0) * 1000.0
        return prep

    def _prepare_words(
        self, snap: Snapshot, offer: dict[str, Any], options: HotLoadOptions
    ) -> tuple[Prepared | None, str]:
        """A word-level swap of ``offer`` (``hf_words.plan``; in ``"pingpong"`` mode the words are
        applied to the spare buffers now), or ``(None, why not)`` after one log line."""
        serving = self.snapshot
        self.kernel.start()  # (that prepare applies with numpy unless it is loaded already)
        wp = (
            hf_words.plan(offer, serving.identity, snap, self.params, self.adlers, self.kernel.ready())
            if serving is not None
            else None
        )
        why = wp if isinstance(wp, str) else "" if wp is not None else "nothing is served"
        if isinstance(wp, hf_words.WordPlan) and serving is not None and self.words == "pingpong":
            try:
                staged, step = self.pingpong.prepare(wp, serving.identity, self.params, self.spares.take)
            except (BdnError, ValueError) as e:
                why = f"applying the words to the spare buffers failed: {_line(e)}"
                log.warning(
                    "%s: ping-pong swap not used (%s): the spare buffers are forgotten, staging the changed tensors",
                    snap.identity,
                    why,
                )
                self._drop_pingpong()
                return None, why
            return Prepared(
                snap,
                options,
                "partial",
                tensors=staged,
                changed_source="words-pingpong",
                words=wp,
                bytes_copied=step.copied + step.background + step.caught_up + step.written,
                pingpong=step,
            ), ""
        if isinstance(wp, hf_words.WordPlan):
            return Prepared(
                snap, options, "partial", changed_source="words", words=wp, bytes_copied=wp.bytes_to_write
            ), ""
        log.info("%s: word-level swap not used (%s): staging the changed tensors", snap.identity, why)
        return None, why

    def _drop_pingpong(self) -> None:
        """Forget the ping-pong spare buffers; they become the staging path's buffers."""
        bufs = self.pingpong.drop()
        if bufs:
            self.spares.keep(bufs)

    # -- swap (the pause) ------------------------------------------------------------------
    def swap(self, prep: Prepared) -> dict[str, Any]:
        """Swap ``prep`` in under the gate; the report acked to the daemon and shown by the API.

        Report: ``{"identity", "policy_version", "mode", "tensors_copied", "bytes_copied",
        "changed_source", "prompt_cache": "reset"|"preserved", "prompt_cache_entries_dropped",
        "prepare_ms", "prepare_cpu_ms", "pause_ms", "drain_ms", "aborted", "kept", ...options}``
        (``prepare_cpu_ms``: the CPU time of the whole engine process, every thread, while it
        prepared: on a busy machine ``prepare_ms`` is mostly waiting for a core).
        """
        th = torch()
        dropped = 0
        freed: list[Any] = []  # storages no longer in use once apply returned
        rebound: dict[str, Any] = {}  # name -> the storage it served before a rebind
        old_identity = self.identity
        first = self.model is None  # (the first load's prepare faulted its buffers in already)

        def apply() -> None:
            nonlocal dropped
            self.adlers.begin()
            with th.no_grad():
                if prep.words is not None and not prep.tensors:
                    self._apply_words(prep)
                elif prep.mode in ("partial", "full") and self.swap_method == "copy":
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
                        rebound[name] = self.params[name]
                        slot.data = t
                        for alias in self._aliases[name]:
                            self.params[alias] = slot.detach()
                else:
                    model, tok = prep.model
                    self.model, self.tokenizer = model, tok
                    self.params = dict(model.state_dict(keep_vars=False))
                    self._slots, self._aliases = slots_of(model, self.params)
            if prep.words is not None and prep.tensors:  # "pingpong": the spare buffers' sums, checked
                self.adlers.set(prep.words.result)
            elif prep.words is None:
                self.adlers.drop(None if prep.mode == "load" else list(prep.tensors))
            if prep.options.reset_prompt_cache:
                dropped = self.prompt_cache.clear()
            self.snapshot = prep.snapshot

        gate_opts = prep.options
        if prep.mode == "load" and gate_opts.inflight_policy == "keep" and self.model is not None:
            # A new model object may not accept KV caches the old one computed: end them instead.
            gate_opts = dataclasses.replace(gate_opts, inflight_policy="abort")
        outcome = self.gate.swap(apply, gate_opts, prep.snapshot.policy_version)
        pp = prep.pingpong
        if pp is not None and prep.words is not None and old_identity is not None:
            # the storages swapped out hold the old snapshot: the spare buffers from now on
            flat = {n: t.reshape(-1).view(th.uint8) for n, t in rebound.items()}
            self.pingpong.commit(flat, prep.words.adlers, old_identity, prep.snapshot.identity, prep.words)
            self.spares.keep([])
            self.pingpong.catch_up(self.kernel.ready)
        elif prep.mode != "load" or not first:
            self.spares.keep(freed)
        if prep.mode == "load" and not first:  # a reload: its buffers are faulted in while it serves
            self.spares.prefill(list(self.params.values()), self.background_nice)
        if prep.mode == "load" and self.device == "cpu":  # the checksums a word-level swap checks
            self.adlers.fill(self.params, self.background_nice)
        self.swaps += 1
        report = {
            "identity": prep.snapshot.identity,
            "policy_version": prep.snapshot.policy_version,
            "mode": prep.mode,
            "tensors_copied": len(prep.words.views)
            if prep.words is not None
            else len(prep.tensors)
            if prep.mode != "load"
            else len(self.params),
            "swap_method": "load"
            if prep.mode == "load"
            else "words-in-place"
            if prep.words is not None and not prep.tensors
            else self.swap_method,
            "tensors_total": len(self.params),
            "bytes_copied": prep.bytes_copied,
            "tensors_by_ranges": prep.ranges,
            "changed_source": prep.changed_source or None,
            "words_fallback": prep.words_fallback or None,
            "words_kernel": ("compiled" if prep.words.fused else "numpy") if prep.words is not None else None,
            "pingpong": dataclasses.asdict(pp) if pp is not None else None,
            "full_reload_reason": prep.reason or None,
            "prompt_cache": "reset" if prep.options.reset_prompt_cache else "preserved",
            "prompt_cache_entries_dropped": dropped,
            "prepare_ms": round(prep.prepare_ms, 3),
            "prepare_cpu_ms": round(prep.prepare_cpu_ms, 3),
            "pause_ms": round(outcome.pause_ms, 3),
            "drain_ms": round(outcome.drain_ms, 3),
            "aborted": outcome.aborted,
            "kept": outcome.kept,
            **prep.options.wire(),
            "inflight_policy_applied": gate_opts.inflight_policy,
        }
        self.last_swap = report
        self.last_swap_tensors = (
            list(prep.words.views)
            if prep.words is not None
            else list(prep.tensors)
            if prep.mode != "load"
            else list(self.params)
        )
        return report

    def _apply_words(self, prep: Prepared) -> None:
        """The pause of a word-level swap: XOR the changed words in place; on any failure read the
        changed tensors from the target snapshot instead (one log line; ``words_fallback`` says
        why), so the parameters hold the target's bytes either way."""
        wp = prep.words
        assert wp is not None
        try:
            prep.bytes_copied = hf_words.apply(wp)
        except Exception as e:  # whatever stopped it, the changed parameters may hold partial data
            why = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
            log.warning(
                "%s: word-level swap failed (%s): the %d changed tensors are read from the snapshot instead",
                prep.snapshot.identity,
                why,
                len(wp.views),
            )
            prep.words_fallback = f"applying the words failed: {why}"  # (one line: the log's)
            prep.changed_source = "words-restored"
            # every known sum goes, not only the changed tensors': a wrong one (of an unchanged
            # tensor too) would fail every later word-level swap the same way; recomputed from
            # the parameters' bytes in the next prepare
            self.adlers.drop(None)
            try:
                prep.bytes_copied = hf_words.restore(wp, prep.snapshot)
            except Exception as e2:
                self._unload()
                raise EngineError(
                    f"{prep.snapshot.identity}: word-level swap failed ({why}) and reading the changed tensors "
                    f"back failed too ({str(e2).splitlines()[0][:200] if str(e2) else type(e2).__name__}): "
                    "the model is unloaded, the next snapshot offered is loaded whole"
                ) from None
            return
        self.adlers.set(wp.result)

    def _unload(self) -> None:
        """Drop the served model (in the pause, as the gate's writer): its parameters hold bytes of
        no snapshot. Requests get 503 (``model`` None) and the next prepare loads a model whole."""
        self.model = self.tokenizer = self.snapshot = None
        self.params, self._slots, self._aliases = {}, {}, {}
        self.adlers.drop(None)
        self.prompt_cache.clear()
        self.gate.version = None

    # -- generation ------------------------------------------------------------------------
    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a chat prompt (:func:`bdn.engines.hf_sampling.encode_chat` with the served
        snapshot's tokenizer)."""
        return sampling.encode_chat(self.tokenizer, messages)

    def decode(self, ids: list[int]) -> str:
        """Text of token ids (special tokens skipped); without a tokenizer, the bytes as UTF-8."""
        return sampling.decode(self.tokenizer, ids)

    def token_text(self, i: int) -> str:
        """The text of one token id (the tokenizer's token string), for logprob answers."""
        return sampling.token_text(self.tokenizer, i)

    @property
    def max_model_len(self) -> int:
        """The model's context length in tokens (``max_position_embeddings``, default 2048)."""
        cfg = getattr(self.model, "config", None)
        return int(getattr(cfg, "max_position_embeddings", 2048) or 2048)

    def eos_ids(self) -> set[int]:
        """Token ids that end generation (the generation config's ``eos_token_id``)."""
        return sampling.eos_ids(self.model)

    def generate(
        self,
        ticket: Ticket,
        prompt: list[int],
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        top_logprobs: int = 0,
        stop_ids: set[int] | None = None,
    ) -> Generation:
        """Generate under an admitted ``ticket`` (``with engine.gate.admit() as ticket``).

        ``temperature`` 0 is greedy. Log-probabilities are the model's before temperature and
        top-p. An abort by a hot-load ends it with ``finish_reason "abort"``.

        ``prompt``: token ids; at most ``max_tokens`` tokens are generated, stopping at the first
        of ``stop_ids`` (default: :meth:`eos_ids`, the model's ``eos_token_id``), which is kept
        in the output. Raises EngineError when no model is loaded yet.
        """
        th = torch()
        gen = th.Generator().manual_seed(seed if seed is not None else int(time.time_ns() % (1 << 63)))
        stop_ids = self.eos_ids() if stop_ids is None else stop_ids
        out_ids: list[int] = []
        lps: list[float] = []
        tops: list[list[tuple[int, float]]] = []
        finish = "length"
        cached, cache_version = 0, None
        identity = None
        kv = None
        try:
            with th.no_grad():
                with self.gate.step(ticket) as version:
                    if self.model is None:
                        raise EngineError("no model is loaded yet")
                    identity = self.identity
                    hit = self.prompt_cache.lookup(prompt)
                    if hit is not None:
                        kv, cached, cache_version = hit
                    logits, kv = sampling.forward(self.model, prompt[cached:], kv, self.device)
                    self.prompt_cache.put(tuple(prompt), copy.deepcopy(kv), version)
                for _ in range(max_tokens):
                    logp = th.log_softmax(logits, -1)
                    tid = sampling.next_token(logits, temperature, top_p, gen)
                    out_ids.append(tid)
                    lps.append(float(logp[tid]))
                    if top_logprobs:
                        tops.append(sampling.top_logprobs(logp, top_logprobs))
                    if tid in stop_ids:
                        finish = "stop"
                        break
                    if len(out_ids) == max_tokens:
                        break
                    with self.gate.step(ticket):
                        identity = self.identity
                        logits, kv = sampling.forward(self.model, [tid], kv, self.device)
        except Aborted:
            finish = "abort"
        return Generation(prompt, out_ids, lps, tops, finish, list(ticket.versions), identity, cached, cache_version)


def _line(e: BaseException) -> str:
    """An exception's first line (at most 300 characters), or its type's name."""
    return str(e).splitlines()[0][:300] if str(e) else type(e).__name__
