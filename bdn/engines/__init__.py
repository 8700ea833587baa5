"""Adapters that let bdn hot-swap real serving engines (docs/ENGINES.md).

- ``bdn.engines.hf``: a Hugging Face transformers + torch causal LM served by bdn itself
  (``HFEngine``), with an OpenAI-compatible chat server (``bdn.engines.openai_api``).
- ``bdn.engines.sglang`` / ``bdn.engines.vllm``: drive an SGLang or vLLM server over its HTTP
  weight-update routes.
- ``bdn.engines.driver.drive``: the hot-swap cycle (offer, prepare, swap, ack with a report).
- ``bdn.engines.options.HotLoadOptions``: per hot-load prompt-cache and in-flight policies.
- ``bdn.engines.changed``: which tensors differ between two snapshots (partial swaps).

Run one: ``python -m bdn.engines hf|sglang|vllm --help``. torch/transformers are only imported
by ``bdn.engines.hf`` (and the service that uses it).
"""

from bdn.engines.options import HotLoadOptions

__all__ = ["HotLoadOptions"]
