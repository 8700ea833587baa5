"""TRL's GRPOTrainer drives bdn end to end (examples/trl_grpo.py's ``train``).

Two real bdnd processes on a ``file://`` bucket, each with bdn's transformers engine as a real
process (``python -m bdn.engines hf``). The trainer (``trl.GRPOTrainer``, CPU, a tiny randomly
initialised Llama built from a config and a tokenizer made with ``tokenizers``: nothing
downloaded) trains 5 steps; ``BdnPublishCallback`` publishes the initial weights and every step
(anchor, then deltas) and hot-loads each through one daemon; every rollout comes from an engine
through ``BdnRollouts`` (GRPO's ``rollout_func``) with the policy version the engine reported.

Asserted: every step trained on rollouts generated at that step, each no more than the configured
bound behind the trainer and none ahead of it; the versions advance; every step was published in
order (one anchor, then deltas); after training both engines serve the last step with weights
equal, tensor for tensor, to the trainer's final weights cast to bf16. Then the gate against the
same engines: a trainer ahead of every engine waits and times out, one behind them refuses
rollouts from its future (StaleRollout), a batch reused past the bound is refused at once.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from bdn.engines.hf import torch_available

_why = torch_available()
if _why:
    pytest.skip(f"TRL on bdn needs torch and transformers ({_why})", allow_module_level=True)
try:
    import trl  # noqa: F401
except ImportError as e:
    pytest.skip(f"TRL on bdn needs trl (pip install trl; in the test extra): {e}", allow_module_level=True)

import xxhash

from bdn.rl.publisher import identity_of
from bdn.rl.trl import BdnRollouts, StaleRollout
from support.api import http, wait_fleet
from support.peerproc import tail
from support.swarm import Swarm, free_port

pytestmark = pytest.mark.filterwarnings("ignore:.*gradient_checkpointing.*:FutureWarning")  # TRL 1.16 on transformers 5

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import trl_grpo

STEPS = 5
BATCH = 4  # one prompt, GRPO's group of 4 completions, per step
MAX_STALENESS = 1


class _Trainer:
    """What BdnRollouts reads of a GRPOTrainer (``state.global_step`` and three ``args``), for
    calling it outside a training loop."""

    def __init__(self, step: int, steps_per_generation: int = 1) -> None:
        self.state = SimpleNamespace(global_step=step)
        self.args = SimpleNamespace(
            steps_per_generation=steps_per_generation, gradient_accumulation_steps=1, num_iterations=1
        )


def test_grpo_trains_on_rollouts_from_engines_bdn_hot_loads(tmp_path: Path) -> None:
    bucket = f"file://{tmp_path / 'bucket'}"
    engines: list[tuple[subprocess.Popen[bytes], str, Path]] = []
    with Swarm(tmp_path / "nodes", 2, bucket) as swarm:
        try:
            for d in swarm.daemons:
                url, log = f"http://127.0.0.1:{free_port()}", d.dir / "engine.log"
                with open(log, "wb") as f:
                    p = subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "bdn.engines",
                            "hf",
                            "--bdn-url",
                            d.url,
                            "--listen",
                            url.removeprefix("http://"),
                            "--replica-id",
                            d.node_id,
                        ],
                        stdout=f,
                        stderr=subprocess.STDOUT,
                    )
                engines.append((p, url, log))
            urls = [u for _p, u, _l in engines]
            # The trainer starts while the engines import torch; BdnRollouts waits for them to serve.
            try:
                run = trl_grpo.train(
                    bucket,
                    swarm.daemons[0].url,
                    urls,
                    tmp_path / "trainer",
                    steps=STEPS,
                    max_staleness=MAX_STALENESS,
                    batch=BATCH,
                )
            except Exception as e:
                logs = "\n".join(f"--- engine {u} (exit {p.poll()}):\n{tail(lg, 3000)}" for p, u, lg in engines)
                raise AssertionError(f"training failed: {e}\n{logs}") from e

            assert trl_grpo.check(run, MAX_STALENESS, STEPS) == []
            # every step's rollouts: generated at that step, within the bound, never ahead of the trainer
            per_step: dict[int, list[int]] = {}
            for r in run.rollouts:
                assert r.last_use_step == r.step  # GRPO's defaults: one optimizer step per generation
                assert r.step - MAX_STALENESS <= r.policy_version <= r.step, r
                assert r.identity == identity_of("step", r.policy_version)
                per_step.setdefault(r.step, []).append(r.policy_version)
            assert sorted(per_step) == list(range(STEPS))
            assert all(len(v) == BATCH for v in per_step.values()), per_step
            # the versions advance: the last step's rollouts come from a policy the first step's did not
            assert min(per_step[STEPS - 1]) >= STEPS - 1 - MAX_STALENESS > max(per_step[0]) == 0
            assert [(p.identity, p.kind) for p in run.published] == (
                [("step000000", "full")] + [(identity_of("step", v), "delta") for v in range(1, STEPS + 1)]
            )
            assert all(p.hot_loaded_at is not None for p in run.published)
            losses = [h["loss"] for h in run.log_history if "loss" in h]
            assert len(losses) == STEPS

            # the fleet ends on the last step, each engine with the trainer's final weights
            last = identity_of("step", STEPS)
            reps = wait_fleet(swarm.daemons[0].url, last, timeout=120)
            assert sorted(r["replica_id"] for r in reps) == ["node0", "node1"]
            want = {k: xxhash.xxh3_128_hexdigest(v.tobytes()) for k, v in run.final_state.items()}
            for url in urls:
                status, w = http("GET", url + "/debug/weights")
                assert status == 200 and w["identity"] == last and w["policy_version"] == STEPS
                assert w["tensors"] == want, f"{url}: served weights differ from the trainer's"

            # The gate, against the same engines (they serve version STEPS now): a trainer ahead of
            # every engine waits and gives up; one behind them refuses rollouts from its future.
            ahead = BdnRollouts(urls, max_staleness=0, wait_s=1.0)
            with pytest.raises(TimeoutError, match=f"no engine serves policy version {STEPS + 2} or later"):
                ahead(["hi"], _Trainer(STEPS + 2))
            behind = BdnRollouts(urls, max_staleness=1, retries=1, max_tokens=2)
            with pytest.raises(StaleRollout, match=rf"policy versions \[{STEPS}\], outside \[1, 2\]"):
                behind(["hi"], _Trainer(2))
            reuse = BdnRollouts(urls, max_staleness=1)
            with pytest.raises(ValueError, match="trains 3 steps, more than max_staleness"):
                reuse(["hi"], _Trainer(4, steps_per_generation=3))
            for r in (ahead, behind, reuse):
                r.close()
        finally:
            for p, _u, _l in engines:
                p.terminate()
            for p, _u, _l in engines:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
