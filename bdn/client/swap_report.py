"""An engine's swap report in plain words: what the swap did, not its field
names. ``mode partial, tensors_copied 75`` becomes "swapped all 75 tensors in place (every one
changed)". Used by the engine driver's log line, ``bdnctl engines`` and the demo. Pure.

The report is what an engine acknowledges (``swap`` in ``POST /v1/engines/{id}/ack``;
bdn/engines/hf.py ``swap`` documents its fields): ``mode`` ``partial`` (only the changed
tensors), ``full`` (every tensor, in place), ``load`` (a new model object), ``tensors_copied``,
``tensors_total``, ``bytes_copied``, ``full_reload_reason``, ``pause_ms``. Unknown or missing
fields are left out of the sentence; a report from an engine that reloads from disk (vLLM,
SGLang: ``mode full`` without counts) reads "reloaded every weight from the snapshot".
"""

from __future__ import annotations

from typing import Any


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n / 1e3:.1f} kB"


def describe_swap(report: Any) -> str:
    """One line saying what a swap did, e.g. "swapped the 13 changed tensors of 51 in place
    (38 unchanged, 152.0 MB), paused 0.10 ms". Never raises: a report that is not a map reads
    "no swap report"."""
    if not isinstance(report, dict):
        return "no swap report"
    mode = report.get("mode")
    n, total = _int(report.get("tensors_copied")), _int(report.get("tensors_total"))
    nbytes = _int(report.get("bytes_copied"))
    size = f", {_mb(nbytes)}" if nbytes else ""
    if mode == "partial" and n is not None:
        if n == 0:
            what = "no tensor changed: nothing swapped"
        elif total is not None and n >= total:
            what = f"swapped all {total} tensors in place (every one changed{size})"
        elif total is not None:
            what = f"swapped the {n} changed tensors of {total} in place ({total - n} unchanged{size})"
        else:
            what = f"swapped {n} changed tensors in place{f' ({size[2:]})' if size else ''}"
    elif mode == "full" and n is not None:
        why = str(report.get("full_reload_reason") or "partial swaps are off")
        what = f"swapped all {n} tensors in place ({why}{size})"
    elif mode == "full":
        what = "reloaded every weight from the snapshot"
    elif mode == "load":
        why = str(report.get("full_reload_reason") or "first load")
        what = f"loaded a new model object ({why}{f', {n} tensors' if n is not None else ''})"
    else:
        what = f"swap mode {str(mode)[:40]}" if mode is not None else "swapped"
    pause = report.get("pause_ms")
    if isinstance(pause, int | float) and not isinstance(pause, bool):
        what += f", paused {pause:.2f} ms"
    return what
