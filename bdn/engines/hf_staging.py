"""What :class:`bdn.engines.hf.HFEngine` takes out of a bdn snapshot while the old policy serves.

Either a whole new model (:func:`load_model`: ``AutoModelForCausalLM.from_pretrained(path,
dtype="auto")``, the checkpoint's own dtype, no hub download), or copies of the named tensors
as torch tensors shaped like the served parameters (:func:`stage_tensors`, a *partial swap*),
read from the snapshot's safetensors files (format: the safetensors header's dtype, shape and
byte offsets, through :mod:`bdn.engines.changed`). :func:`same_config` says which of the two
applies. torch and transformers are imported only when a function here runs.

Errors: :class:`EngineError` (one line) for a snapshot this engine cannot load.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import numpy as np

from bdn.client import Snapshot
from bdn.engines import changed as changed_mod
from bdn.engines.dtypes import TORCH_DTYPES as _DTYPES
from bdn.engines.weights import SpareBuffers, pread_into, pread_ranges
from bdn.proto.errors import BdnError

CONFIG_NAME = "config.json"

#: Threads that read the staged tensors of one prepare at once.
STAGE_THREADS = 2

#: A tensor whose changed ranges cover at least this fraction of its bytes is read whole.
WHOLE_READ_FRACTION = 0.5


class EngineError(BdnError):
    """A snapshot the engine cannot load or a request it cannot serve (one line)."""


def torch_available() -> str | None:
    """None when torch and transformers import; else the reason (for skips and fallbacks)."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except Exception as exc:  # ImportError, or a broken build raising something else
        return f"torch/transformers not importable: {type(exc).__name__}: {exc}"
    return None


def torch() -> Any:
    """The ``torch`` module (imported on first use, so that ``bdn.engines`` imports without it)."""
    import torch as _torch

    return _torch


def same_config(a: Snapshot, b: Snapshot) -> bool:
    """Whether two snapshots have byte-identical ``config.json`` files (both missing counts as the
    same): the condition for swapping tensors into the served model instead of loading a new one."""
    return _read(a.path / CONFIG_NAME) == _read(b.path / CONFIG_NAME)


def load_model(snap: Snapshot, device: str) -> tuple[Any, Any]:
    """``(model, tokenizer or None)`` of the snapshot directory, in eval mode on ``device``.

    On CPU every parameter and buffer is copied into the engine's own memory (see the comment).
    The tokenizer is loaded when the snapshot has ``tokenizer.json`` or ``tokenizer_config.json``.
    Raises EngineError when transformers cannot load the directory (OSError, ValueError, KeyError).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(str(snap.path), dtype="auto", local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise EngineError(
            f"{snap.identity}: transformers cannot load {snap.path}: {str(exc).splitlines()[0][:300]}"
        ) from None
    model.to(device).eval()  # type: ignore[arg-type]  # transformers types to() through a decorator that loses the bound self
    if device == "cpu":
        # transformers leaves CPU parameters mapped copy-on-write from the snapshot's files in
        # shm: the first in-place swap would then pay a page fault per 4 KiB inside the pause
        # (measured: 1.5 s instead of 0.2 s for 0.6 GB), and the engine would pin the
        # snapshot's pages after GC. Copy them into the engine's own memory now, while preparing.
        with torch().no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                t.data = t.data.clone()
    tok = None
    if (snap.path / "tokenizer.json").is_file() or (snap.path / "tokenizer_config.json").is_file():
        tok = AutoTokenizer.from_pretrained(str(snap.path), local_files_only=True)
    return model, tok


def stage_tensors(
    snap: Snapshot,
    names: list[str],
    params: dict[str, Any],
    device: str,
    spares: SpareBuffers,
    ranges: dict[str, list[tuple[int, int]]] | None = None,
    threads: int = STAGE_THREADS,
) -> tuple[dict[str, Any], int] | str:
    """Copies of ``names`` out of ``snap`` as torch tensors: ``({name: tensor}, bytes read from snap)``.

    ``params`` is the served model's state dict (name -> tensor); each staged tensor has the
    dtype and shape of the served one, on ``device``. Returns a reason string instead when one
    tensor cannot be swapped in (not a parameter of the served model, or another dtype or shape);
    every tensor is checked before any byte is read.

    On CPU each tensor is read with ``os.preadv`` straight into a spare buffer of its size (the
    storage the last swap freed, already faulted in) or a new one: measured on 152 MB with both
    cores busy, 176-185 ms into a spare buffer, 277-309 ms into a new one, 305-1320 ms copying
    out of the snapshot's mapping (a page fault per 4 KiB on both sides). The tensors are read by
    ``threads`` threads at once, largest first (``os.preadv`` and ``np.copyto`` release the GIL);
    an OSError or BdnError of any read is raised after every read ended.

    ``ranges`` (the offer's ``changed_ranges``, relative to the served snapshot: see
    :mod:`bdn.engines.changed`): for a CPU tensor listed there, the staged copy starts as a copy
    of the served parameter (engine memory, no read of the snapshot) and only the listed byte
    ranges are read from ``snap``; the bytes counted are those ranges'. When the ranges cover at
    least :data:`WHOLE_READ_FRACTION` of the tensor (at 2 % of values changed, scattered, every
    4 KiB page holds a changed value), the tensor is read whole instead: one pass over its bytes,
    not a copy of the served bytes and then a read of nearly all of them again.
    """
    th = torch()
    infos = changed_mod.tensor_infos(snap)
    jobs: list[tuple[int, Callable[[], int]]] = []
    out: dict[str, Any] = {}
    for name in names:
        live = params.get(name)
        if live is None:
            return f"tensor {name[:80]!r} is not a parameter of the served model"
        info = infos[name]
        dt = _DTYPES.get(info.dtype)
        if dt is None or getattr(th, dt) != live.dtype or tuple(info.shape) != tuple(live.shape):
            return f"tensor {name[:80]!r} changed dtype or shape ({info.dtype} {list(info.shape)})"
    for name in names:
        live, info = params[name], infos[name]
        path = snap.path.joinpath(*snap.tensor_file(name).split("/"))
        spans = (ranges or {}).get(name)
        if spans is not None and sum(e - s for s, e in spans) >= WHOLE_READ_FRACTION * info.nbytes:
            spans = None  # (nearly) the whole tensor: one read, no copy of the served bytes first
        if device == "cpu":
            buf = spares.take(info.nbytes, live.dtype)
            out[name] = buf.view(live.dtype).reshape(live.shape)
            if spans is not None and live.is_contiguous():
                jobs.append((info.nbytes, functools.partial(_served_then_ranges, live, path, info.start, buf, spans)))
            else:
                jobs.append((info.nbytes, functools.partial(_whole, path, info.start, buf)))
        else:
            raw = np.array(snap.tensor(name).reshape(-1).view(np.uint8))  # the one copy out of shm
            out[name] = th.from_numpy(raw).view(live.dtype).reshape(live.shape).to(device)
            jobs.append((0, functools.partial(int, info.nbytes)))
    return out, _run(jobs, threads)


def _whole(path: Path, offset: int, buf: Any) -> int:
    pread_into(path, offset, buf)
    return int(buf.numel())


def _served_then_ranges(live: Any, path: Path, offset: int, buf: Any, spans: list[tuple[int, int]]) -> int:
    th = torch()
    np.copyto(buf.numpy(), live.detach().reshape(-1).view(th.uint8).numpy())  # the served bytes
    return pread_ranges(path, offset, buf, spans)


def _run(jobs: list[tuple[int, Callable[[], int]]], threads: int) -> int:
    """Run ``jobs`` (``(size, read)``) largest first on up to ``threads`` threads; the bytes read."""
    jobs = sorted(jobs, key=lambda j: -j[0])
    if threads <= 1 or len(jobs) <= 1:
        return sum(read() for _size, read in jobs)
    with ThreadPoolExecutor(max_workers=min(threads, len(jobs)), thread_name_prefix="bdn-stage") as pool:
        futures = [pool.submit(read) for _size, read in jobs]
        wait(futures)
    return sum(f.result() for f in futures)  # the first failure, raised once every read ended


def _read(p: Path) -> bytes | None:
    try:
        return p.read_bytes()
    except OSError:
        return None
