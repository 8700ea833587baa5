"""TRL (Hugging Face's RL trainers) on bdn: a callback that publishes every step, and a
``rollout_func`` that takes GRPO's rollouts from engines bdn hot-loads.

Needs torch, transformers and trl (none is a dependency of the ``bdn`` package).

- :class:`BdnPublishCallback` (a ``transformers.TrainerCallback``): at ``on_train_begin`` it
  hands the initial weights (policy version ``global_step = 0``) to a
  :class:`~bdn.rl.publisher.StepPublisher`, at every ``on_step_end`` the weights after that
  step (version ``global_step``), cast to the serving dtype (bf16 by default); at
  ``on_train_end`` it waits until every step is published and hot-loaded. Only the world's
  process zero publishes, and it needs the whole state dict (no FSDP sharding here).
- :class:`BdnRollouts`: ``GRPOTrainer(..., rollout_func=BdnRollouts(...))``. For each prompt it
  asks one engine for one completion (``n = 1``; GRPO's sampler already repeats each prompt
  ``num_generations`` times), from an engine serving a policy no older than the
  :class:`~bdn.rl.staleness.StalenessBound` allows, waiting for one when none does. It returns
  the engine's prompt and completion token ids and log-probabilities, and ``policy_version``
  (the oldest policy of each rollout's tokens) as an extra field, which TRL passes on to the
  reward functions. Every rollout is also kept in ``.log`` (step, version, replica).

Rollouts used later than they were generated count: with ``steps_per_generation`` above
``gradient_accumulation_steps`` or ``num_iterations > 1``, a batch generated at step ``s`` still
trains at ``s + uses - 1``, and the bound is applied at that last use.
"""

from __future__ import annotations

import copy
import functools
import itertools
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import torch
from transformers import TrainerCallback

from bdn.rl.engines import EnginePool, Rollout
from bdn.rl.publisher import StepPublisher
from bdn.rl.staleness import StalenessBound

__all__ = ["BdnPublishCallback", "BdnRollouts", "RolloutRecord", "StaleRollout", "checkpoint_files", "state_arrays"]

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def state_arrays(model: torch.nn.Module, dtype: str = "bfloat16") -> dict[str, np.ndarray]:
    """A copy of ``model.state_dict()`` cast to ``dtype`` (``bfloat16``, ``float16``,
    ``float32``), as numpy arrays on the CPU (bf16 as ``ml_dtypes.bfloat16``), the names as the
    state dict has them (what ``save_pretrained`` writes for models without tied weights)."""
    t_dtype = _DTYPES[dtype]
    out: dict[str, np.ndarray] = {}
    for name, t in model.state_dict().items():
        c = t.detach().to("cpu", t_dtype if t.is_floating_point() else t.dtype, copy=True).contiguous()
        out[name] = c.view(torch.int16).numpy().view(ml_dtypes.bfloat16) if c.dtype == torch.bfloat16 else c.numpy()
    return out


def checkpoint_files(model: Any, tokenizer: Any = None, dtype: str = "bfloat16") -> dict[str, bytes]:
    """The checkpoint's other files, relative path -> bytes: ``config.json`` (its ``dtype`` set
    to ``dtype``, so that engines load the served weights as they are), ``generation_config.json``
    when the model has one, and what ``tokenizer.save_pretrained`` writes."""
    files: dict[str, bytes] = {}
    with tempfile.TemporaryDirectory(prefix="bdn-ckpt-files-") as t:
        cfg = copy.deepcopy(model.config)
        cfg.dtype = dtype
        cfg.save_pretrained(t)
        gen = getattr(model, "generation_config", None)
        if gen is not None:
            gen.save_pretrained(t)
        if tokenizer is not None:
            tokenizer.save_pretrained(t)
        for p in sorted(Path(t).rglob("*")):
            if p.is_file():
                files[p.relative_to(t).as_posix()] = p.read_bytes()
    return files


class BdnPublishCallback(TrainerCallback):
    """Publish the policy through ``publisher`` at the start and after every optimizer step.

    ``dtype``: what the engines serve (the trainer may train in float32). ``flush_timeout``: the
    seconds ``on_train_end`` waits for the last steps (a failure raises StepPublishFailed there,
    or at the next step's submit)."""

    def __init__(
        self, publisher: StepPublisher, *, dtype: str = "bfloat16", flush_timeout: float | None = 600.0
    ) -> None:
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
        self.publisher, self.dtype, self.flush_timeout = publisher, dtype, flush_timeout
        self._published_step: int | None = None

    def _submit(self, state: Any, model: Any) -> None:
        if not state.is_world_process_zero or model is None or self._published_step == state.global_step:
            return
        self.publisher.submit(state.global_step, state_arrays(model, self.dtype))
        self._published_step = state.global_step

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        """Publish the starting weights (version ``state.global_step``: 0, or a resumed step)."""
        self._submit(state, model)

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        """Publish the weights after optimizer step ``state.global_step``."""
        self._submit(state, model)

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        """Wait until every step is published and hot-loaded."""
        if state.is_world_process_zero:
            self.publisher.flush(self.flush_timeout)


class StaleRollout(RuntimeError):
    """An engine kept answering with a policy the staleness bound does not admit: older than it
    allows, or newer than the trainer's weights (another run's snapshot in the fleet)."""


@dataclass(frozen=True)
class RolloutRecord:
    """One rollout as a trainer used it: ``step`` (``global_step`` when generated),
    ``last_use_step`` (the last ``global_step`` it trains at), the oldest ``policy_version`` of
    its tokens, the engine's ``replica_id`` and snapshot ``identity``."""

    step: int
    last_use_step: int
    policy_version: int
    replica_id: str
    identity: str


class BdnRollouts:
    """A GRPO ``rollout_func`` over :class:`~bdn.rl.engines.EnginePool`.

    Args:
        engine_urls: the engines' base URLs.
        max_staleness: the bound (optimizer steps; see :mod:`bdn.rl.staleness`).
        max_tokens, temperature: sampling of each completion (``temperature`` 0 is greedy).
        wait_s: how long one batch waits for an engine serving an admissible policy
            (TimeoutError after it).
        retries: answers below the bound (an engine that fell back, or that another trainer's
            hot-load moved) are asked again this many times, then StaleRollout.
        seed: per-request seeds are ``seed`` plus a running count (None: the engines draw).
    """

    def __init__(
        self,
        engine_urls: Sequence[str],
        *,
        max_staleness: int = 1,
        max_tokens: int = 16,
        temperature: float = 1.0,
        wait_s: float = 300.0,
        retries: int = 3,
        seed: int | None = 0,
        timeout: float = 120.0,
    ) -> None:
        self.bound = StalenessBound(max_staleness)
        self.pool = EnginePool(engine_urls, timeout=timeout)
        self.max_tokens, self.temperature, self.wait_s, self.retries = max_tokens, temperature, wait_s, retries
        self._seeds = None if seed is None else itertools.count(seed)
        self._lock = threading.Lock()
        #: Every rollout handed to the trainer, in order.
        self.log: list[RolloutRecord] = []

    def close(self) -> None:
        """Close the engine connections."""
        self.pool.close()

    def _seed(self) -> int | None:
        if self._seeds is None:
            return None
        with self._lock:
            return next(self._seeds)

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        """Rollouts for ``prompts`` (chat message lists, or strings sent as one user message):
        ``{"prompt_ids", "completion_ids", "logprobs", "policy_version"}``, one entry per prompt.

        Raises ValueError when the trainer reuses a batch for more steps than the bound allows,
        TimeoutError, StaleRollout, EngineAnswerError."""
        step = int(trainer.state.global_step)
        args = trainer.args
        uses = max(1, args.steps_per_generation // max(1, args.gradient_accumulation_steps)) * args.num_iterations
        last = step + uses - 1
        lo = self.bound.min_version(last)
        if lo > step:
            raise ValueError(
                f"a rollout batch trains {uses} steps, more than max_staleness + 1 = "
                f"{self.bound.max_staleness + 1}: no policy can satisfy the bound"
            )
        messages = [[{"role": "user", "content": p}] if isinstance(p, str) else p for p in prompts]
        ok = self.pool.wait_serving(lo, self.wait_s)
        jobs = [functools.partial(self._one, m, ok[i % len(ok)], step, last) for i, m in enumerate(messages)]
        rollouts = self.pool.map(jobs)
        self.log += [RolloutRecord(step, last, min(r.policy_versions), r.replica_id, r.identity) for r in rollouts]
        return {
            "prompt_ids": [r.prompt_ids for r in rollouts],
            "completion_ids": [r.completion_ids for r in rollouts],
            "logprobs": [r.logprobs for r in rollouts],
            "policy_version": [min(r.policy_versions) for r in rollouts],
        }

    def _one(self, messages: Any, url: str, step: int, last: int) -> Rollout:
        """One rollout admissible at its last use ``last`` and made by no policy newer than the
        trainer's ``step``; asked again (of an engine serving an admissible policy) up to ``retries`` times."""
        lo = self.bound.min_version(last)
        for _ in range(self.retries + 1):
            r = self.pool.complete(
                url, messages, max_tokens=self.max_tokens, temperature=self.temperature, seed=self._seed()
            )
            if self.bound.admissible(last, r.policy_versions) and max(r.policy_versions) <= step:
                return r
            url = self.pool.wait_serving(lo, self.wait_s)[0]
        raise StaleRollout(
            f"engine {url} answered with policy versions {r.policy_versions}, outside [{lo}, {step}] "
            f"(max_staleness {self.bound.max_staleness} at step {last}), {self.retries + 1} times"
        )
