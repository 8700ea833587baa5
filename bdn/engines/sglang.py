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

**Subset loads.** SGLang loads, in place, every tensor of the safetensors files in
``model_path`` and nothing else (``ModelRunner.update_weights_from_disk``,
``python/sglang/srt/model_executor/model_runner.py``: ``loader._get_weights_iterator`` over the
directory's files, then ``load_weights_and_postprocess``; with a ``model.safetensors.index.json``
only the files it names). So when it serves a snapshot already, ``config.json`` is unchanged and
the changed tensors are known (the offer's list relative to the served snapshot, else
:func:`bdn.engines.changed.compare`), the adapter makes a *subset view* of the target while the
old policy serves: a directory under ``subset_root`` holding symlinks to the snapshot's
non-weight files (config, tokenizer; no index, no READY) and one ``model.safetensors`` with only
the changed tensors (written from the snapshot's shared memory: the changed bytes once, never the
model), and points ``update_weights_from_disk`` at it (``mode: "partial"``). A view is removed
once the next swap has succeeded (SGLang remembers the last ``model_path``). Otherwise, and when
the subset update fails, the full snapshot directory is loaded (``mode: "full"``, one log line
why). This is right where SGLang's ``process_weights_after_loading`` is the same whatever was
loaded (unquantized weights: it runs over every module after any load); for a quantized model
start the adapter with ``partial=False`` (``--full-reload``).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bdn.client import Snapshot
from bdn.engines import changed as changed_mod
from bdn.engines.hf_staging import same_config
from bdn.engines.options import HotLoadOptions
from bdn.engines.remote import EngineHTTP, RemoteEngineError
from bdn.fileops import save_raw

log = logging.getLogger("bdn.engines.sglang")

__all__ = ["PAUSE_MODES", "SGLangAdapter", "write_subset"]

PAUSE_MODES = {"wait": "retract", "keep": "in_place", "abort": "abort"}
SKIP_IN_SUBSET = ("READY", "model.safetensors.index.json")


@dataclass
class _Prepared:
    snapshot: Snapshot
    options: HotLoadOptions
    changed: int | None
    subset: Path | None = None  # the subset view to load; None: the whole snapshot
    names: list[str] | None = None
    reason: str = ""
    subset_bytes: int = 0
    prepare_ms: float = 0.0


def write_subset(snap: Snapshot, names: list[str], out: Path) -> int:
    """Make ``out`` (a new directory) a subset view of ``snap`` holding only ``names``.

    ``out`` gets a symlink to each regular non-weight file of the snapshot (``config.json``,
    tokenizer files, ...; not ``*.safetensors``, the index or ``READY``) and one
    ``model.safetensors`` with the named tensors (dtype, shape and bytes as in the snapshot,
    read through its read-only mapping). Returns the tensor bytes written. Raises OSError when
    ``out`` exists or cannot be written, ProtocolError for a tensor that cannot be viewed.
    """
    infos = changed_mod.tensor_infos(snap)
    out.mkdir(parents=False)
    for f in snap.path.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in SKIP_IN_SUBSET:
            os.symlink(f, out / f.name)
    tensors = {n: (infos[n].dtype, tuple(infos[n].shape), snap.tensor(n)) for n in names}
    save_raw(out / "model.safetensors", tensors)
    return sum(infos[n].nbytes for n in names)


class SGLangAdapter:
    """An adapter for ``bdn.engines.driver.drive`` over one SGLang server.

    Args:
        base_url: the SGLang server (``--host/--port`` of ``sglang.launch_server``).
        api_key: SGLang's ``--api-key`` (or admin key), sent as a bearer token.
        timeout_s: per route; ``update_weights_from_disk`` of a large model takes minutes.
        clock: monotonic seconds.
        partial: load a subset view of only the changed tensors when possible (module doc).
        subset_root: where subset views are written (default: a new directory in ``/dev/shm``,
            else the temporary directory; removed by :meth:`close`). SGLang must be able to read it.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        timeout_s: float = 900.0,
        clock: Any = time.monotonic,
        partial: bool = True,
        subset_root: str | Path | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self.http = EngineHTTP(base_url, timeout_s, headers)
        self.clock = clock
        self.partial = partial
        self._root = Path(subset_root) if subset_root is not None else None
        self._own_root = subset_root is None
        self._views: list[Path] = []  # subset views written, oldest first
        self._seq = 0
        self.serving: Snapshot | None = None
        self.last_swap: dict[str, Any] | None = None

    def _subset_root(self) -> Path:
        if self._root is None:
            shm = Path("/dev/shm")
            where = str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None
            self._root = Path(tempfile.mkdtemp(prefix="bdn-sglang-subsets-", dir=where))
        return self._root

    def prepare(self, snap: Snapshot, offer: dict[str, Any], options: HotLoadOptions) -> _Prepared:
        """Write the subset view of ``snap``'s changed tensors (module doc), or plan a full load.

        Runs while the old policy serves. Raises ProtocolError (one line) for a malformed
        ``changed_tensors`` / ``changed_ranges`` in the offer, OSError when the view cannot be
        written.
        """
        t0 = self.clock()
        listed = offer.get("changed_tensors")
        prep = _Prepared(snap, options, len(listed) if isinstance(listed, list) else None)
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
            else:
                prep.names, prep.changed = ch.names, len(ch.names)
                if ch.names:
                    self._seq += 1
                    view = self._subset_root() / f"{snap.identity}.{os.getpid()}.{self._seq}"
                    self._views.append(view)
                    prep.subset_bytes = write_subset(snap, ch.names, view)
                    prep.subset = view
        if prep.names is None:
            log.info("%s: full update_weights_from_disk (%s)", snap.identity, prep.reason)
        prep.prepare_ms = (self.clock() - t0) * 1000.0
        return prep

    def _update(self, path: Path, version: str, opts: HotLoadOptions) -> dict[str, Any]:
        ans = self.http.call(
            "POST",
            "/update_weights_from_disk",
            {
                "model_path": str(path),
                "abort_all_requests": False,
                "weight_version": version,
                "flush_cache": opts.reset_prompt_cache,
            },
        )
        if not isinstance(ans, dict) or ans.get("success") is not True:
            raise RemoteEngineError(f"update_weights_from_disk did not succeed: {str(ans)[:300]}")
        return ans

    def _load(self, prep: _Prepared, version: str, report: dict[str, Any]) -> None:
        snap, opts = prep.snapshot, prep.options
        if prep.names is not None:
            try:
                if prep.subset is not None:
                    report["num_paused_requests"] = self._update(prep.subset, version, opts).get("num_paused_requests")
                report.update(
                    mode="partial", subset_path=str(prep.subset) if prep.subset else None, bytes_read=prep.subset_bytes
                )
                return
            except RemoteEngineError as exc:
                prep.reason = f"subset update failed: {str(exc)[:200]}"
                log.warning("%s: %s; loading the whole snapshot", snap.identity, prep.reason)
        report["num_paused_requests"] = self._update(snap.path, version, opts).get("num_paused_requests")
        report.update(mode="full", full_reload_reason=prep.reason or None)

    def _drop_views(self, keep: Path | None) -> None:
        for view in [v for v in self._views if v != keep]:
            shutil.rmtree(view, ignore_errors=True)
            self._views.remove(view)

    def swap(self, prep: _Prepared) -> dict[str, Any]:
        """Pause, update from the subset view or ``prep.snapshot.path``, flush per policy, set the
        version, continue.

        Raises RemoteEngineError (one line) when the update fails; generation is continued first.
        """
        snap, opts = prep.snapshot, prep.options
        version = str(snap.policy_version)
        mode = PAUSE_MODES[opts.inflight_policy]
        report: dict[str, Any] = {
            "identity": snap.identity,
            "policy_version": snap.policy_version,
            "mode": "full",
            "engine": "sglang",
            "pause_mode": mode,
            "prepare_ms": round(prep.prepare_ms, 3),
            **opts.wire(),
        }
        t0 = self.clock()
        self.http.call("POST", "/pause_generation", {"mode": mode})
        try:
            self._load(prep, version, report)
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
        self._drop_views(prep.subset if report["mode"] == "partial" else None)
        self.serving = snap
        self.last_swap = report
        return report

    def close(self) -> None:
        """Close the HTTP client to the SGLang server (the server itself keeps running) and remove
        the subset views (their directory too when the adapter made it)."""
        self.http.close()
        self._drop_views(None)
        if self._own_root and self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
