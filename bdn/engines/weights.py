"""How the transformers engine moves weights: staging reads, the pause's copy or rebind, spare buffers.

- ``pread_into``: a tensor's bytes from a snapshot file straight into a CPU buffer (``os.preadv``).
- ``SpareBuffers``: the storages a swap freed, handed to the next prepare as staging buffers
  (already faulted in; at most one swap's bytes are kept); after a model is loaded, buffers of
  its parameters' sizes faulted in on a thread, so the first partial prepare needs no fresh pages.
- ``slots_of``: every state-dict name's Parameter or buffer object and its tied aliases, for a
  swap that rebinds parameters to staged tensors.
- ``copy_into``: the in-place copy of a swap that must keep the parameters' addresses.

Why own code: these are the engine's hot path (the pause, the prepare) and each is a few lines
over numpy/torch/os; measurements are in the docstrings.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np

from bdn.engines.preads import ShortFile, pread_spans
from bdn.priority import BACKGROUND_NICE, lower_this_thread
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
        self._lock = threading.Lock()  # (a prefill thread adds to ``_free``)

    def take(self, nbytes: int, dtype: Any) -> Any:
        """A flat uint8 CPU tensor of ``nbytes``: a spare one if the last swap left one, else new."""
        torch = _torch()
        with self._lock:
            spares = self._free.get(nbytes)
            if spares:
                return spares.pop()
        return torch.empty(nbytes // torch.empty((), dtype=dtype).element_size(), dtype=dtype).view(torch.uint8)

    def nbytes(self) -> int:
        """Bytes of the buffers held now (a prefill still running adds to it)."""
        with self._lock:
            return sum(int(t.numel()) for ts in self._free.values() for t in ts)

    def keep(self, tensors: list[Any]) -> None:
        """After a swap: the storages nobody uses any more become the next prepare's buffers (the
        previous spares are freed), so at most the bytes of one swap are kept aside."""
        torch = _torch()
        free: dict[int, list[Any]] = {}
        if self.enabled:
            for t in tensors:
                if t.device.type == "cpu" and t.is_contiguous():
                    flat = t.reshape(-1).view(torch.uint8)
                    free.setdefault(flat.numel(), []).append(flat)
        with self._lock:
            self._free = free

    def prefill(self, tensors: list[Any], nice: int = BACKGROUND_NICE) -> threading.Thread | None:
        """After a model is loaded (no swap freed anything yet): one buffer of each distinct CPU
        tensor's byte size in ``tensors``, allocated and faulted in (written once) on a thread
        (returned; None when disabled), for the first prepare to take. A fresh page costs a fault
        and zeroing when first written (~0.5-1 CPU-s a GiB on this class of VM): paid here, not in
        that prepare. The next :meth:`keep` replaces them; a buffer made after it is dropped.
        Memory: one model of buffers from the load on, as every later swap keeps anyway. The
        thread runs at nice ``+nice`` (``bdn.priority``)."""
        if not self.enabled:
            return None
        with self._lock:
            target = self._free
        seen: set[int] = set()
        sizes: list[int] = []
        for t in tensors:
            if t.device.type == "cpu" and t.is_contiguous() and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                sizes.append(t.numel() * t.element_size())

        def run() -> None:
            lower_this_thread(nice)
            torch = _torch()
            for n in sorted(sizes, reverse=True):
                buf = torch.empty(n, dtype=torch.uint8)
                buf.fill_(0)  # fault every page in now
                with self._lock:
                    if self._free is not target:  # a swap's keep came first: these are not wanted
                        return
                    target.setdefault(n, []).append(buf)

        th = threading.Thread(target=run, name="engine-spares-prefill", daemon=True)
        th.start()
        return th


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
