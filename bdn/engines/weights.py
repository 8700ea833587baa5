"""How the transformers engine moves weights: staging reads, the pause's copy or rebind, spare buffers.

- ``pread_into``: a tensor's bytes from a snapshot file straight into a CPU buffer (``os.preadv``).
- ``SpareBuffers``: the storages a swap freed, handed to the next prepare as staging buffers
  (already faulted in; at most one swap's bytes are kept).
- ``slots_of``: every state-dict name's Parameter or buffer object and its tied aliases, for a
  swap that rebinds parameters to staged tensors.
- ``copy_into``: the in-place copy of a swap that must keep the parameters' addresses.

Why own code: these are the engine's hot path (the pause, the prepare) and each is a few lines
over numpy/torch/os; measurements are in the docstrings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from bdn.engines.preads import ShortFile, pread_spans
from bdn.proto.errors import BdnError

__all__ = ["SpareBuffers", "copy_into", "pread_into", "pread_ranges", "slots_of"]


def _torch():
    import torch

    return torch


class SpareBuffers:
    """Free CPU buffers by size: ``take`` one for a staged tensor, ``keep`` what a swap freed.

    Args:
        enabled: False (a GPU engine) keeps nothing and always allocates.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._free: dict[int, list[Any]] = {}  # nbytes -> flat uint8 tensors

    def take(self, nbytes: int, dtype: Any) -> Any:
        """A flat uint8 CPU tensor of ``nbytes``: a spare one if the last swap left one, else new."""
        torch = _torch()
        spares = self._free.get(nbytes)
        if spares:
            return spares.pop()
        return torch.empty(nbytes // torch.empty((), dtype=dtype).element_size(), dtype=dtype).view(torch.uint8)

    def keep(self, tensors: list[Any]) -> None:
        """After a swap: the storages nobody uses any more become the next prepare's buffers (the
        previous spares are freed), so at most the bytes of one swap are kept aside."""
        torch = _torch()
        self._free = {}
        if not self.enabled:
            return
        for t in tensors:
            if t.device.type == "cpu" and t.is_contiguous():
                flat = t.reshape(-1).view(torch.uint8)
                self._free.setdefault(flat.numel(), []).append(flat)


def slots_of(model: Any, params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """Every state-dict name's Parameter or buffer object, and the names sharing each (tied weights)."""
    objs = dict(model.named_parameters(remove_duplicate=False))
    objs.update(model.named_buffers(remove_duplicate=False))
    slots = {name: objs[name] for name in params if name in objs}
    by_obj: dict[int, list[str]] = {}
    for name, obj in slots.items():
        by_obj.setdefault(id(obj), []).append(name)
    return slots, {name: by_obj[id(obj)] for name, obj in slots.items()}


def pread_into(path: Path, offset: int, buf: Any) -> None:
    """Fill the flat uint8 CPU tensor ``buf`` with ``path``'s bytes from ``offset`` (``os.preadv``,
    64 MiB per call). Raises BdnError (one line) when the file ends first."""
    pread_ranges(path, offset, buf, [(0, buf.numel())])


def pread_ranges(path: Path, offset: int, buf: Any, spans: list[tuple[int, int]]) -> int:
    """Fill ``buf[start:end]`` for each ``(start, end)`` of ``spans`` with ``path``'s bytes from
    ``offset + start`` (one open file, ``os.preadv`` per range, :mod:`bdn.engines.preads`); the
    rest of ``buf`` (a flat uint8 CPU tensor) is left as it is. Returns the bytes read. Raises
    BdnError (one line) when the file ends first."""
    view = memoryview(buf.numpy())
    try:
        return pread_spans(path, offset, view, spans)
    except ShortFile as e:
        raise BdnError(str(e)) from None
    finally:
        view.release()


def copy_into(live: Any, staged: Any) -> None:
    """``live[...] = staged`` in place (same dtype and shape): the one copy in the pause.

    On CPU, one ``memcpy`` of the bytes through numpy (``np.copyto`` on uint8 views, GIL released)
    instead of ``Tensor.copy_``: torch's copy kernel splits every tensor over its intra-op threads,
    and with the cores busy (the daemon, other processes) their barrier waits made the pause
    2-3x a plain memcpy (measured: 152 MB, load 17: ``copy_`` 424 ms median, one thread 139 ms,
    ``np.copyto`` 150 ms). Elsewhere (a GPU) ``copy_`` is the device copy.
    """
    if live.device.type == "cpu" and staged.device.type == "cpu" and live.is_contiguous() and staged.is_contiguous():
        torch = _torch()
        np.copyto(live.view(-1).view(torch.uint8).numpy(), staged.reshape(-1).view(torch.uint8).numpy())
    else:
        live.copy_(staged)
