"""Drive an SGLang server's weight-update routes from bdn's hot-loads.

Routes and bodies as SGLang defines them (python/sglang/srt/entrypoints/http_server.py and
``managers/io_struct.py``, sgl-project/sglang main, v0.5.x; read there, not run here — see
docs/ENGINES.md):

1. ``POST /pause_generation {"mode": "retract" | "in_place" | "abort"}``: bdn's in-flight policy
   ``wait`` -> ``retract`` (running requests go back to the waiting queue and are recomputed with
   the new weights after the update: nothing is lost; SGLang has no drain-then-pause mode),
   ``keep`` -> ``in_place`` (they stay, with their KV cache), ``abort`` -> ``abort``. Never abort
   by default.
2. ``POST /update_weights_from_disk {"model_path": <bdn's snapshot dir>, "abort_all_requests":
   false, "weight_version": "<policy version>", "flush_cache": <RESET_ALL>}`` -> 200 ``{"success",
   "message", "num_paused_requests"}`` (400 with ``success: false``).
3. ``POST /flush_cache`` when the prompt-cache policy is ``RESET_ALL`` (400 when requests still
   run, e.g. after ``in_place``: reported as ``prompt_cache: "flush_failed"``, not an error).
4. ``POST /update_weight_version {"new_version": "<policy version>", "abort_all_requests": false}``
   (its default would abort every request in flight).
5. ``POST /continue_generation {}`` — always, also when a step above failed.

SGLang loads every tensor of ``model_path``: a swap is a full reload of the weights in place
(``mode: "full"``); the report says how many tensors changed, for the record.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from bdn.client import Snapshot
from bdn.engines.options import HotLoadOptions
from bdn.engines.remote import EngineHTTP, RemoteEngineError

log = logging.getLogger("bdn.engines.sglang")

__all__ = ["PAUSE_MODES", "SGLangAdapter"]

PAUSE_MODES = {"wait": "retract", "keep": "in_place", "abort": "abort"}


@dataclass
class _Prepared:
    snapshot: Snapshot
    options: HotLoadOptions
    changed: int | None


class SGLangAdapter:
    """An adapter for ``bdn.engines.driver.drive`` over one SGLang server.

    Args:
        base_url: the SGLang server (``--host/--port`` of ``sglang.launch_server``).
        api_key: SGLang's ``--api-key`` (or admin key), sent as a bearer token.
        timeout_s: per route; ``update_weights_from_disk`` of a large model takes minutes.
        clock: monotonic seconds.
    """

    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 900.0,
                 clock: Any = time.monotonic) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self.http = EngineHTTP(base_url, timeout_s, headers)
        self.clock = clock
        self.serving: Snapshot | None = None
        self.last_swap: dict[str, Any] | None = None

    def prepare(self, snap: Snapshot, offer: dict[str, Any], options: HotLoadOptions) -> _Prepared:
        """Nothing to stage (SGLang reads the directory itself); counts the changed tensors when listed."""
        names = offer.get("changed_tensors")
        return _Prepared(snap, options, len(names) if isinstance(names, list) else None)

    def swap(self, prep: _Prepared) -> dict[str, Any]:
        """Pause, update from ``prep.snapshot.path``, flush per policy, set the version, continue.

        Raises RemoteEngineError (one line) when the update fails; generation is continued first.
        """
        snap, opts = prep.snapshot, prep.options
        version = str(snap.policy_version)
        mode = PAUSE_MODES[opts.inflight_policy]
        report: dict[str, Any] = {"identity": snap.identity, "policy_version": snap.policy_version, "mode": "full",
                                  "engine": "sglang", "pause_mode": mode, **opts.wire()}
        t0 = self.clock()
        self.http.call("POST", "/pause_generation", {"mode": mode})
        try:
            ans = self.http.call("POST", "/update_weights_from_disk", {
                "model_path": str(snap.path), "abort_all_requests": False, "weight_version": version,
                "flush_cache": opts.reset_prompt_cache})
            if not isinstance(ans, dict) or ans.get("success") is not True:
                raise RemoteEngineError(f"update_weights_from_disk did not succeed: {str(ans)[:300]}")
            report["num_paused_requests"] = ans.get("num_paused_requests")
            if opts.reset_prompt_cache:
                try:
                    self.http.call("POST", "/flush_cache")
                    report["prompt_cache"] = "reset"
                except RemoteEngineError as exc:
                    log.warning("flush_cache after %s: %s", snap.identity, exc)
                    report["prompt_cache"] = "flush_failed"
            else:
                report["prompt_cache"] = "preserved"
            self.http.call("POST", "/update_weight_version", {"new_version": version, "abort_all_requests": False})
        finally:
            self.http.call("POST", "/continue_generation", {})
        report["pause_ms"] = round((self.clock() - t0) * 1000.0, 3)
        report["tensors_changed"] = prep.changed
        self.serving = snap
        self.last_swap = report
        return report

    def close(self) -> None:
        """Close the HTTP client to the SGLang server (the server itself keeps running)."""
        self.http.close()
