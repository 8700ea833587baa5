#!/usr/bin/env python3
"""TRL's GRPOTrainer driving bdn end to end: every step published, rollouts from hot-loaded engines.

    python examples/trl_grpo.py [--nodes 2] [--steps 6] [--max-staleness 1] [--keep]

A tiny LlamaForCausalLM is built from a config (random weights, a byte-level tokenizer made with
``tokenizers``: nothing is downloaded) and trained with ``trl.GRPOTrainer`` on the CPU. Two
pieces of :mod:`bdn.rl.trl` connect it to bdn:

- ``BdnPublishCallback`` (a TrainerCallback) publishes the initial weights as the anchor
  ``step000000`` and the weights after every optimizer step as a delta ``stepNNNNNN`` (policy
  version = ``global_step``) to a ``file://`` bucket, and sends one hot-load per step to one
  daemon, which fans it out to the fleet;
- ``BdnRollouts`` is GRPO's ``rollout_func``: every completion comes from an engine
  (``python -m bdn.engines hf``, bdn's transformers engine) that its bdnd hot-loaded, with the
  policy version the engine reports, and none older than ``--max-staleness`` steps behind the
  trainer.

The fleet is ``--nodes`` real bdnd processes and as many engines on loopback. The example prints,
per step, the policy versions its rollouts came from, what was published, and exits 1 if a
rollout broke the bound or the versions did not advance. ``train()`` is the same run on a fleet
someone else started (tests/test_trl.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: the model and tokenizer are made here
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is marked experimental in TRL
# TRL 1.16 calls transformers 5's deprecated gradient_checkpointing names: not this example's to fix
warnings.filterwarnings("ignore", message=".*gradient_checkpointing.*", category=FutureWarning)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "engine"))

PROMPTS = [
    "Say something about apples.",
    "A haiku about a bucket:",
    "Count to five.",
    "Name a fast animal.",
    "What is a checkpoint?",
    "Describe the sea.",
    "Tell a short story.",
    "Spell 'banana'.",
]


def make_policy(workdir: Path, *, hidden: int = 64, layers: int = 2, seed: int = 0) -> tuple[Any, Any]:
    """A randomly initialised tiny Llama (float32 for training; served in bf16) and its tokenizer,
    both made locally (examples/engine/tiny_llama.py's byte-level BPE tokenizer)."""
    import tiny_llama
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok_dir = workdir / "tokenizer"
    vocab = tiny_llama.make_tokenizer(tok_dir)
    tok = PreTrainedTokenizerFast.from_pretrained(tok_dir)
    tok.pad_token = tok.eos_token
    n_special = len(tiny_llama.SPECIALS)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=vocab - n_special,
        eos_token_id=vocab - n_special + 1,
        pad_token_id=vocab - n_special + 1,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).float()
    return model, tok


def reward_vowels(completions: list, **_kw: Any) -> list[float]:
    """The toy task: the share of vowels in the completion's text (any reward works here)."""
    out = []
    for c in completions:
        text = c[0]["content"] if isinstance(c, list) else str(c)
        out.append(sum(ch in "aeiou" for ch in text.lower()) / max(1, len(text)))
    return out


@dataclass
class Run:
    """What ``train`` returns: the rollouts (``bdn.rl.trl.RolloutRecord``), the published steps
    (``bdn.rl.publisher.PublishedStep``), TRL's log history, the seconds training took, and the
    trainer's final weights as published (name -> bf16 array)."""

    rollouts: list
    published: list
    log_history: list
    seconds: float
    final_state: dict


def train(
    bucket: str,
    daemon_url: str,
    engine_urls: list[str],
    workdir: Path,
    *,
    steps: int = 6,
    max_staleness: int = 1,
    batch: int = 8,
    num_generations: int = 4,
    max_tokens: int = 16,
    seed: int = 0,
    chunk_size: int | None = None,
) -> Run:
    """Train ``steps`` GRPO steps with bdn publishing every step and serving every rollout."""
    from datasets import Dataset
    from transformers import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from bdn.rl.publisher import StepPublisher
    from bdn.rl.trl import (
        BdnPublishCallback,
        BdnRollouts,
        checkpoint_files,
        state_arrays,
    )

    model, tok = make_policy(workdir, seed=seed)
    publisher = StepPublisher(bucket, daemon_url, extra_files=checkpoint_files(model, tok), chunk_size=chunk_size)
    rollouts = BdnRollouts(engine_urls, max_staleness=max_staleness, max_tokens=max_tokens, seed=seed)
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS]})
    args = GRPOConfig(
        output_dir=str(workdir / "out"),
        max_steps=steps,
        per_device_train_batch_size=batch,
        num_generations=num_generations,
        max_completion_length=max_tokens,
        learning_rate=3e-3,
        beta=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        seed=seed,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_vowels,
        args=args,
        train_dataset=data,
        processing_class=tok,
        rollout_func=rollouts,
        callbacks=[BdnPublishCallback(publisher)],
    )
    trainer.remove_callback(PrinterCallback)  # main() prints its own summary
    t0 = time.monotonic()
    try:
        trainer.train()
    finally:
        rollouts.close()
        publisher.close(timeout=600)
    return Run(rollouts.log, publisher.published, trainer.state.log_history, time.monotonic() - t0, state_arrays(model))


def check(run: Run, max_staleness: int, steps: int) -> list[str]:
    """What is wrong with a run (empty when nothing): every step trained on rollouts, none older
    than the bound or newer than the trainer, versions published 0..steps, rollouts' versions
    advancing (the last step's rollouts newer than the first's)."""
    bad = []
    by_step: dict[int, list[int]] = {}
    for r in run.rollouts:
        by_step.setdefault(r.step, []).append(r.policy_version)
        if not 0 <= r.last_use_step - r.policy_version <= max_staleness:
            bad.append(f"rollout of policy {r.policy_version} used at step {r.last_use_step}: bound {max_staleness}")
    if sorted(by_step) != list(range(steps)):
        bad.append(f"rollouts were generated at steps {sorted(by_step)}, expected 0..{steps - 1}")
    if [p.policy_version for p in run.published] != list(range(steps + 1)):
        bad.append(f"published versions {[p.policy_version for p in run.published]}, expected 0..{steps}")
    if by_step and min(by_step[max(by_step)]) <= max(by_step[min(by_step)]):
        bad.append(f"policy versions did not advance: {by_step}")
    return bad


# ---- the fleet, when this file is run as a program -------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _up(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except OSError:
        return False


@contextmanager
def fleet(root: Path, bucket: str, n: int) -> Iterator[tuple[str, list[str]]]:
    """``n`` bdnd + ``n`` engines (``python -m bdn.engines hf``) on loopback; yields (node0's
    local API URL, the engines' URLs); stops them all on the way out."""
    secret = root / "secret"
    secret.write_text(os.urandom(32).hex() + "\n")
    nodes = [{"id": f"node{i}", "peer": _free_port(), "local": _free_port(), "engine": _free_port()} for i in range(n)]
    procs: list[subprocess.Popen] = []
    bin_dir = Path(sys.executable).parent
    try:
        for nd in nodes:
            env = dict(
                os.environ,
                BDN_BUCKET=bucket,
                BDN_NODE_ID=nd["id"],
                BDN_PEER_LISTEN=f"127.0.0.1:{nd['peer']}",
                BDN_ADVERTISE_URL=f"http://127.0.0.1:{nd['peer']}",
                BDN_LOCAL_LISTEN=f"127.0.0.1:{nd['local']}",
                BDN_SHM_DIR=str(root / "shm" / nd["id"]),
                BDN_PARTITION_SECRET_FILE=str(secret),
                BDN_MANIFEST_POLL_S="0.2",
                BDN_PEERS=",".join(f"http://127.0.0.1:{o['peer']}" for o in nodes if o is not nd),
            )
            with open(root / f"{nd['id']}.log", "wb") as log:
                procs.append(subprocess.Popen([bin_dir / "bdnd"], env=env, stdout=log, stderr=subprocess.STDOUT))
            with open(root / f"engine-{nd['id']}.log", "wb") as elog:
                procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "bdn.engines",
                            "hf",
                            "--bdn-url",
                            f"http://127.0.0.1:{nd['local']}",
                            "--listen",
                            f"127.0.0.1:{nd['engine']}",
                            "--replica-id",
                            nd["id"],
                            "--log-level",
                            "warning",
                        ],
                        stdout=elog,
                        stderr=subprocess.STDOUT,
                    )
                )
        deadline = time.monotonic() + 240
        while not all(_up(f"http://127.0.0.1:{nd['local']}/v1/health") for nd in nodes):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise SystemExit(f"trl example: the fleet did not start (logs in {root})")
            time.sleep(0.2)
        yield f"http://127.0.0.1:{nodes[0]['local']}", [f"http://127.0.0.1:{nd['engine']}" for nd in nodes]
    finally:
        for group in (procs[1::2], procs[0::2]):  # engines first: they unregister from their daemon
            for p in group:
                p.send_signal(signal.SIGTERM)
            for p in group:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--max-staleness", type=int, default=1)
    ap.add_argument("--keep", action="store_true", help="keep the work directory (bucket, logs)")
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bdn-trl-"))
    bucket = f"file://{root / 'bucket'}"
    try:
        with fleet(root, bucket, a.nodes) as (daemon, engines):
            print(
                f"fleet: {a.nodes} bdnd + {a.nodes} engines; training {a.steps} GRPO steps "
                f"(max_staleness {a.max_staleness})",
                flush=True,
            )
            run = train(bucket, daemon, engines, root, steps=a.steps, max_staleness=a.max_staleness)
        for p in run.published:
            print(
                f"  published {p.identity} ({p.kind}, policy {p.policy_version}, {p.stored_bytes} bytes, "
                f"{p.publish_s:.2f} s)"
            )
        steps: dict[int, list] = {}
        for r in run.rollouts:
            steps.setdefault(r.step, []).append(r)
        for s, rs in sorted(steps.items()):
            print(
                f"  step {s + 1}: {len(rs)} rollouts at global_step {s}, policy versions "
                f"{sorted({r.policy_version for r in rs})}, replicas {sorted({r.replica_id for r in rs})}"
            )
        losses = [h["loss"] for h in run.log_history if "loss" in h]
        print(
            f"  trained {a.steps} steps in {run.seconds:.1f} s; loss per step {json.dumps([round(x, 4) for x in losses])}"
        )
        bad = check(run, a.max_staleness, a.steps)
        for b in bad:
            print(f"  FAIL: {b}")
        return 1 if bad else 0
    finally:
        if a.keep:
            print(f"work directory kept: {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
