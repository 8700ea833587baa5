"""Per hot-load options an engine honours, named as the hosted RL hot-load APIs name them.

Source: docs/ENGINES.md ("Per hot-load options"); Fireworks' hot-load API (prompt cache reset by default,
since a stale prompt cache makes samples off-policy) and SGLang's ``/pause_generation`` modes.

The daemon passes them in the engine's offer (``GET /v1/engines/{id}/next``)::

    {"identity", "policy_version", "kind", "path", "lease_id",
     "prompt_cache_policy": "PRESERVE" | "RESET_ALL",     # optional, default RESET_ALL
     "inflight_policy": "wait" | "keep" | "abort",        # optional, default wait
     "inflight_wait_s": float,                             # optional, default 30 (bound of "wait")
     "changed_tensors": [name, ...],                       # optional, see bdn.engines.changed
     "changed_tensors_base": identity}                     # the snapshot that list is relative to

Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from bdn.proto.errors import ProtocolError

PROMPT_CACHE_POLICIES = ("RESET_ALL", "PRESERVE")
INFLIGHT_POLICIES = ("wait", "keep", "abort")
DEFAULT_PROMPT_CACHE_POLICY = "RESET_ALL"
DEFAULT_INFLIGHT_POLICY = "wait"
DEFAULT_INFLIGHT_WAIT_S = 30.0
MAX_INFLIGHT_WAIT_S = 3600.0

__all__ = [
    "DEFAULT_INFLIGHT_POLICY",
    "DEFAULT_INFLIGHT_WAIT_S",
    "DEFAULT_PROMPT_CACHE_POLICY",
    "INFLIGHT_POLICIES",
    "PROMPT_CACHE_POLICIES",
    "HotLoadOptions",
]


@dataclass(frozen=True)
class HotLoadOptions:
    """How one hot-load treats the prompt cache and the requests in flight.

    Attributes:
        prompt_cache_policy: ``"RESET_ALL"`` (drop every cached prefix at the swap: no sample
            after the swap reuses KV computed by the old policy) or ``"PRESERVE"`` (keep it).
        inflight_policy: ``"wait"`` (stop admitting, let running requests finish for at most
            ``inflight_wait_s`` seconds, abort what is still running, then swap), ``"keep"``
            (running requests continue across the swap; later tokens come from the new policy)
            or ``"abort"`` (running requests end at once with ``finish_reason: "abort"``).
        inflight_wait_s: the bound of ``"wait"``, seconds.
    """

    prompt_cache_policy: str = DEFAULT_PROMPT_CACHE_POLICY
    inflight_policy: str = DEFAULT_INFLIGHT_POLICY
    inflight_wait_s: float = DEFAULT_INFLIGHT_WAIT_S

    def __post_init__(self) -> None:
        if self.prompt_cache_policy not in PROMPT_CACHE_POLICIES:
            raise ProtocolError(
                f"prompt_cache_policy must be one of {', '.join(PROMPT_CACHE_POLICIES)}, "
                f"got {str(self.prompt_cache_policy)[:40]!r}"
            )
        if self.inflight_policy not in INFLIGHT_POLICIES:
            raise ProtocolError(
                f"inflight_policy must be one of {', '.join(INFLIGHT_POLICIES)}, got {str(self.inflight_policy)[:40]!r}"
            )
        w = self.inflight_wait_s
        if (
            isinstance(w, bool)
            or not isinstance(w, int | float)
            or not math.isfinite(w)
            or not 0 <= w <= MAX_INFLIGHT_WAIT_S
        ):
            raise ProtocolError(f"inflight_wait_s must be a number of seconds in [0, {MAX_INFLIGHT_WAIT_S:g}]")

    @property
    def reset_prompt_cache(self) -> bool:
        """True when the swap drops the engine's prompt (prefix/KV) cache (policy ``RESET_ALL``)."""
        return self.prompt_cache_policy == "RESET_ALL"

    @classmethod
    def from_offer(cls, offer: dict[str, Any]) -> HotLoadOptions:
        """The options of an offer; absent fields take the defaults (RESET_ALL, wait, 30 s).

        ``prompt_cache_policy`` is matched case-insensitively (``reset_all`` works), the in-flight
        policy too. Raises ProtocolError (one line, naming the field) for a bad value.
        """
        pc = offer.get("prompt_cache_policy")
        ip = offer.get("inflight_policy")
        wait = offer.get("inflight_wait_s")
        for key, val in (("prompt_cache_policy", pc), ("inflight_policy", ip)):
            if val is not None and not isinstance(val, str):
                raise ProtocolError(f"offer field {key} must be a string")
        return cls(
            prompt_cache_policy=DEFAULT_PROMPT_CACHE_POLICY if pc is None else pc.upper(),
            inflight_policy=DEFAULT_INFLIGHT_POLICY if ip is None else ip.lower(),
            inflight_wait_s=DEFAULT_INFLIGHT_WAIT_S if wait is None else wait,
        )

    def wire(self) -> dict[str, Any]:
        """The options as an ack reports them."""
        return {
            "prompt_cache_policy": self.prompt_cache_policy,
            "inflight_policy": self.inflight_policy,
            "inflight_wait_s": self.inflight_wait_s,
        }
