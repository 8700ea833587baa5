"""bdn from an RL trainer: publish each step, take rollouts from the engines bdn hot-loads, and
keep every rollout within a staleness bound of the trainer's policy.

- :mod:`bdn.rl.staleness` the bound (pure);
- :mod:`bdn.rl.publisher` ``StepPublisher``: each step's weights to the bucket and one hot-load,
  on a background thread;
- :mod:`bdn.rl.engines` ``EnginePool``: rollouts over the engines' OpenAI-compatible API, each
  with the policy versions the engine reports;
- :mod:`bdn.rl.trl` the TRL glue (``BdnPublishCallback``, ``BdnRollouts``; needs torch,
  transformers and trl, so it is not imported here).

The guide is docs/TRAINERS.md.
"""

from bdn.rl.engines import EngineAnswerError, EnginePool, Rollout
from bdn.rl.publisher import (
    PublishedStep,
    StepPublisher,
    StepPublishFailed,
    identity_of,
)
from bdn.rl.staleness import StalenessBound

__all__ = [
    "EngineAnswerError",
    "EnginePool",
    "PublishedStep",
    "Rollout",
    "StalenessBound",
    "StepPublishFailed",
    "StepPublisher",
    "identity_of",
]
