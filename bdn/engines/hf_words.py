"""Word-level swaps of the transformers engine: a ``bdn_planes_v1`` delta XORed into the served
CPU parameters in place, writing only the changed words (docs/ENGINES.md, "Word-level swaps").

The daemon's offer may name the target's verified stored diff files (``changed_words``:
``{"codec": "bdn_planes_v1", "base": identity, "files": {target file: diff path}}``,
``bdn/daemon/replica/changes.py``). Each diff stream is ``base XOR target`` of one tensor, coded
by the words that changed (docs/FORMATS.md, "bdn_planes_v1 streams"), so parameters that hold
exactly the base's bytes become the target's by XORing those words, the same kernel the daemon
applies to its own buffers (:func:`bdn.proto.sparse.apply_sparse_tensors`). Why the parameters
hold the base's bytes: the engine loaded them from a READY snapshot and changes them only by
swaps, each of which leaves exactly the swapped snapshot's bytes; the offer's ``base`` must be
the snapshot it serves.

- :func:`plan` (while the old policy serves): every check that needs no write. The offer's
  shape, base and codec; every safetensors file of the target has a diff; each diff file read
  into the engine's memory (the daemon may collect it after the ack) and its header and block
  tables checked against the target's header; each changed tensor a contiguous CPU parameter of
  its dtype, shape and size, no two sharing storage; the parameters' Adler-32s known (computed
  here for the ones :class:`Adlers` lacks). Anything else is a reason string: the caller stages
  instead (today's path).
- :func:`apply` (in the pause): the XOR, with every changed tensor's Adler-32 updated from the
  changed bytes and checked against the diff's metadata (RFC 1950's sums are linear in each
  byte), unchanged tensors' known Adler-32 checked against it too.
- :func:`restore` (in the pause, only after :func:`apply` failed): every tensor the diff changes
  read again from the target snapshot's verified files into its parameter, so the weights are
  the target's whatever the apply left.

:class:`KernelWarmup` loads the compiled kernel (:mod:`bdn.proto.sparse_kernel`, numba, cached
on disk) on a thread at engine start; until it is loaded the numpy path applies the same words.

Errors: :func:`plan` returns a reason (one line) for anything it refuses; :func:`apply` raises
ProtocolError / ChecksumError (a ProtocolError) / ValueError; :func:`restore` raises BdnError or
OSError.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bdn.client import Snapshot
from bdn.engines.dtypes import TORCH_DTYPES
from bdn.engines.weights import pread_into
from bdn.fileops import read_header, thread_map
from bdn.priority import BACKGROUND_NICE, lower_this_thread
from bdn.proto import arc, sparse, sparse_kernel
from bdn.proto.delta_tasks import raw_adler32
from bdn.proto.diff_file import DiffTensor, check_names
from bdn.proto.errors import BdnError
from bdn.proto.safetensors_fmt import Header

__all__ = [
    "CODEC",
    "MODES",
    "Adlers",
    "KernelWarmup",
    "WordFile",
    "WordPlan",
    "apply",
    "plan",
    "restore",
]

CODEC = "bdn_planes_v1"
#: Where a word-level swap writes: ``"inplace"`` (the parameters, in the pause) or ``"pingpong"``
#: (spare buffers kept one step behind the parameters, while serving; the pause then rebinds them
#: as a staged swap does: :mod:`bdn.engines.hf_pingpong`); ``"off"``: never (the staging path only).
MODES = ("inplace", "pingpong", "off")
#: Threads that apply one word-level swap (the pause): the daemon's ``apply_workers`` default.
WORKERS = 2
#: A diff file larger than this many times its target file, plus 1 MiB, is refused unread.
MAX_DIFF_RATIO = 2


def _torch() -> Any:
    import torch

    return torch


class KernelWarmup:
    """Loads the sparse kernel on a daemon thread (``sparse_kernel.warm``: numba's import and its
    cached compile, ~10 CPU-s when the cache is cold) from :meth:`start` on; :meth:`ready` says
    whether it is loaded."""

    def __init__(self, start: bool = True) -> None:
        self._done = threading.Event()
        self._started = False
        self.available = False
        if start:
            self.start()

    def start(self) -> None:
        """Begin loading the kernel on a thread (once; later calls do nothing)."""
        if not self._started:
            self._started = True
            threading.Thread(target=self._run, name="engine-kernel-warmup", daemon=True).start()

    def _run(self) -> None:
        try:
            self.available = sparse_kernel.warm()
        finally:
            self._done.set()

    def ready(self) -> bool:
        """True once the compiled kernel is loaded (False while loading, or without numba)."""
        return self._done.is_set() and self.available


class Adlers:
    """The Adler-32 of each served parameter's bytes, by state-dict name, for the checks of a
    word-level swap. A value is stored only if no swap began while it was computed (each swap
    calls :meth:`begin` before it writes a parameter), so a stale one is never kept."""

    def __init__(self) -> None:
        self._known: dict[str, int] = {}
        self._gen = 0
        self._lock = threading.Lock()

    def begin(self) -> None:
        """A swap is about to write parameters: computations running now are dropped."""
        with self._lock:
            self._gen += 1

    def set(self, values: Mapping[str, int]) -> None:
        """Parameters now hold bytes with these checksums (a word-level swap's result)."""
        with self._lock:
            self._known.update(values)

    def drop(self, names: Iterable[str] | None = None) -> None:
        """Forget ``names`` (None: every one), whose bytes a swap replaced."""
        with self._lock:
            if names is None:
                self._known.clear()
            else:
                for n in names:
                    self._known.pop(n, None)

    def get(self, views: Mapping[str, np.ndarray], since: int | None = None) -> dict[str, int]:
        """``{name: Adler-32}`` of every ``views`` entry (flat uint8 arrays of parameters),
        computing the unknown ones now (zlib-ng's SIMD Adler-32: ~11 GB/s here). ``since``: the
        :meth:`generation` the views were taken at (default: now); the values computed are kept
        only if no swap began since then."""
        with self._lock:
            gen, out = self._gen, {n: self._known[n] for n in views if n in self._known}
        gen = gen if since is None else since
        for name, view in views.items():
            if name not in out:
                out[name] = raw_adler32(view)
        with self._lock:
            if self._gen == gen:
                self._known.update(out)
        return out

    def generation(self) -> int:
        """How many swaps began so far (:meth:`begin`)."""
        with self._lock:
            return self._gen

    def fill(self, params: Mapping[str, Any], nice: int = BACKGROUND_NICE) -> threading.Thread:
        """Compute every contiguous CPU parameter's checksum on a daemon thread (after a load, at
        nice ``+nice``: ``bdn.priority``), so the first word-level prepare does not; returns the
        thread. Values are kept only while no swap began since this call: a sum the thread takes
        of a parameter a later swap writes (or of storage a swap replaced) is never kept."""
        since = self.generation()

        def run() -> None:
            lower_this_thread(nice)
            for name, t in list(params.items()):
                if self.generation() != since:
                    return
                v = _flat(t)
                if v is not None:
                    self.get({name: v}, since)

        th = threading.Thread(target=run, name="engine-adler-fill", daemon=True)
        th.start()
        return th


def _flat(t: Any) -> np.ndarray | None:
    """A flat writable uint8 numpy view of a contiguous CPU tensor's bytes, or None."""
    if t.device.type != "cpu" or not t.is_contiguous():
        return None
    return t.detach().reshape(-1).view(_torch().uint8).numpy()


@dataclass
class WordFile:
    """One safetensors file of the target: its header (the base's), its diff file's bytes and
    streams, and the tensors the diff changes."""

    rel: str
    header: Header
    diff: np.ndarray
    streams: Mapping[str, DiffTensor]
    changed: list[str]


@dataclass
class WordPlan:
    """A word-level swap checked and ready for the pause."""

    files: list[WordFile]
    views: dict[str, np.ndarray]  # changed tensor -> its parameter's bytes (flat uint8, writable)
    adlers: dict[str, int]  # the parameters' Adler-32s now (changed and unchanged tensors)
    fused: bool  # the compiled kernel (else the numpy path)
    bytes_to_write: int  # changed words' bytes (dense blocks whole)
    diff_bytes: int = 0  # diff bytes read
    result: dict[str, int] = field(default_factory=dict)  # after apply: every tensor's Adler-32


def plan(
    offer: Mapping[str, Any],
    serving: str | None,
    snap: Snapshot,
    params: Mapping[str, Any],
    adlers: Adlers,
    fused: bool,
) -> WordPlan | str | None:
    """The word-level swap of ``offer`` onto the served ``params``, checked (module doc); None
    when the offer names no diff files, a one-line reason when it names some that cannot be used.

    ``serving``: the identity the parameters hold; ``snap``: the target (its headers and tensor
    files); ``fused``: apply with the compiled kernel. Reads the diff files (the delta's size)
    and, for parameters ``adlers`` lacks, their bytes once.
    """
    cw = offer.get("changed_words")
    if cw is None:
        return None
    if not isinstance(cw, dict) or not isinstance(cw.get("files"), dict):
        return "offer field changed_words is not {codec, base, files}"
    if cw.get("codec") != CODEC:
        return f"codec {str(cw.get('codec'))[:40]!r} is not {CODEC}"
    if serving is None or cw.get("base") != serving:
        return f"the diffs apply to {str(cw.get('base'))[:80]!r}, this engine serves {serving!r}"
    files: dict[str, Any] = cw["files"]
    wanted = {snap.tensor_file(n) for n in snap.tensor_names()}
    if set(files) != wanted:
        return f"changed_words names {len(files)} file(s), the target has {len(wanted)} tensor file(s)"
    th = _torch()
    out: list[WordFile] = []
    views: dict[str, np.ndarray] = {}
    others: dict[str, np.ndarray] = {}
    ptrs: set[int] = set()
    total = read = 0
    try:
        for rel in sorted(files):
            path = files[rel]
            target = snap.path.joinpath(*rel.split("/"))
            if not isinstance(path, str) or not os.path.isabs(path):
                return f"changed_words: the diff of {rel[:80]!r} is not an absolute path"
            header = read_header(target)
            with open(path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                if size > MAX_DIFF_RATIO * header.file_size + (1 << 20):
                    return f"diff file {Path(path).name} has {size} bytes, over twice its target's"
                diff = np.frombuffer(fh.read(), dtype=np.uint8)
            if len(diff) != size:
                return f"diff file {Path(path).name} changed size while read"
            read += size
            _, streams = arc.read_diff_header(diff, size)
            check_names(header, streams)
            per = sparse.changed_per_tensor(diff, streams, header)
            for name, info in header.tensors.items():
                live = params.get(name)
                if name not in per:
                    v = _flat(live) if live is not None else None
                    if v is not None and len(v) == info.nbytes:
                        others[name] = v
                    continue
                dt = TORCH_DTYPES.get(info.dtype)
                if live is None:
                    return f"tensor {name[:80]!r} is not a parameter of the served model"
                if dt is None or getattr(th, dt) != live.dtype or tuple(info.shape) != tuple(live.shape):
                    return f"tensor {name[:80]!r} changed dtype or shape ({info.dtype} {list(info.shape)})"
                v = _flat(live)
                if v is None or len(v) != info.nbytes or not v.flags.writeable:
                    return f"tensor {name[:80]!r} is not a contiguous CPU parameter of {info.nbytes} bytes"
                if live.data_ptr() in ptrs:
                    return f"tensor {name[:80]!r} shares its storage with another changed tensor"
                ptrs.add(live.data_ptr())
                views[name] = v
                total += per[name]
            out.append(WordFile(rel, header, diff, streams, sorted(per)))
    except (BdnError, OSError, ValueError) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0][:300]}" if not isinstance(e, BdnError) else str(e)
    known = adlers.get({**views, **others})
    return WordPlan(out, views, known, fused, total, read)


def apply(p: WordPlan, workers: int = WORKERS) -> int:
    """XOR every file's changed words into the parameters (the pause); the bytes written. Fills
    ``p.result`` with every tensor's Adler-32 after. Raises ProtocolError / ChecksumError /
    ValueError: the parameters the diff changes then hold partial data (:func:`restore`)."""
    written = 0
    run = thread_map(workers)
    for f in p.files:
        views = {n: p.views[n] for n in f.changed}
        known = {n: p.adlers[n] for n in f.header.tensors if n in p.adlers}
        res = sparse.apply_sparse_tensors(views, f.header, f.diff, f.streams, known, map=run, fused=p.fused)
        written += res.written
        p.result.update(res.adlers)
    return written


def restore(p: WordPlan, snap: Snapshot) -> int:
    """Read every tensor the diffs change from ``snap``'s files into its parameter (after a failed
    :func:`apply`); the bytes read. Raises BdnError (a file shorter than its header says) or OSError."""
    th = _torch()
    n = 0
    for f in p.files:
        path = snap.path.joinpath(*f.rel.split("/"))
        for name in f.changed:
            info = f.header.tensors[name]
            pread_into(path, info.start, th.from_numpy(p.views[name]))
            n += info.nbytes
    return n
