"""The transformers engine's ping-pong spare (``--words pingpong``): a second buffer for each
changed parameter, kept one step behind the served one and brought forward by the changed words
of the deltas it missed, while the old policy serves, so that the pause only rebinds
(docs/ENGINES.md, "Word-level swaps"; the daemon's own two buffers, DESIGN.md "Sparse apply",
applied in the engine's memory).

State: :attr:`PingPong.bufs` (state-dict name -> a flat uint8 CPU tensor of that parameter's
size) all hold the bytes of snapshot :attr:`PingPong.holds`, each with its Adler-32; a parameter
without a spare buffer has none yet (it is copied from the served parameter when a delta first
changes it). After a swap from N to N+1 the spare buffers hold N and the delta N -> N+1 is kept
(its diff bytes, read by :func:`bdn.engines.hf_words.plan`): :meth:`PingPong.catch_up` XORs its
words into the spare buffers it changes on a thread right after the swap (work: that delta's
changed words), so they hold N+1 again before the next offer. For delta N+1 -> N+2,
:meth:`PingPong.prepare` waits for that, copies the served parameters that have no spare buffer,
XORs the new delta's words into the spare buffers and returns them for the pause to rebind; the
served buffers it replaces become the spare buffers (:meth:`PingPong.commit`). Work per step:
the changed words of two deltas (and, for a parameter no delta changed before, one copy of it).
Every apply checks each written tensor's Adler-32 against the diff's and each known unchanged
one (:func:`bdn.proto.sparse.apply_sparse_tensors`), as the in-place swap does.

Why the spare buffers hold :attr:`PingPong.holds`: each was either copied from a served
parameter known to hold a READY snapshot's bytes (its Adler-32 known), or was the served
parameter until a swap, and since then was written only by checked applies of the deltas in
order. Anything else (an apply that fails, a swap not made with them, a delta that does not
follow on) forgets them (:meth:`PingPong.drop`): the next delta copies again.

Memory: a second copy of every parameter a delta has changed since the last load (at 2 % of
values scattered over every matrix: the whole model, twice the parameters in the engine) and one
delta's diff bytes.

Errors: :meth:`PingPong.prepare` raises ProtocolError / ChecksumError (both BdnError) or
ValueError, after which the state is forgotten (the caller drops it and stages instead).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from bdn.engines.hf_words import WORKERS, WordFile, WordPlan
from bdn.engines.hf_words import apply as apply_words
from bdn.fileops import thread_map
from bdn.priority import BACKGROUND_NICE, boost_lowered, lower_this_thread
from bdn.proto import sparse
from bdn.proto.errors import BdnError, ChecksumError
from bdn.proto.safetensors_fmt import Header

log = logging.getLogger("bdn.engines.hf")

__all__ = ["Kept", "PingPong", "Step"]


@dataclass
class Kept:
    """A delta the spare buffers still miss: ``base`` -> ``target`` (identities), its files
    (diff bytes in memory, headers, streams) and whether to apply it with the compiled kernel."""

    base: str
    target: str
    files: list[WordFile]
    fused: bool


@dataclass
class Step:
    """What :meth:`PingPong.prepare` did (bytes): ``copied`` from served parameters into new spare
    buffers; ``background`` words of the kept delta the thread after the last swap wrote (or
    ``caught_up`` when prepare had to apply them itself); ``written`` this delta's words;
    ``waited_ms`` for that thread."""

    copied: int = 0
    background: int = 0
    caught_up: int = 0
    written: int = 0
    waited_ms: float = 0.0


class PingPong:
    """The spare buffers and the delta they miss (module doc). Thread-safe: :meth:`catch_up` runs
    on its own thread; :meth:`prepare` and :meth:`drop` wait for it.

    Args:
        workers: threads of one apply (the pause's ``hf_words.WORKERS``).
        background_nice: nice increment of the catch-up thread and its workers (``bdn.priority``:
            the ack and the next requests come first; 0 = the engine's own priority).
    """

    def __init__(self, workers: int = WORKERS, background_nice: int = BACKGROUND_NICE) -> None:
        self.background_nice = background_nice
        self.bufs: dict[str, Any] = {}  # name -> flat uint8 CPU tensor holding ``holds``
        self.adlers: dict[str, int] = {}  # name -> Adler-32 of bufs[name]
        self.holds: str | None = None  # the snapshot every spare buffer holds (None: forget them)
        self.kept: Kept | None = None  # the delta holds -> served, not yet applied to them
        self.workers = workers
        self._lock = threading.Lock()  # held by whoever writes the buffers (catch-up, prepare)
        self._thread: threading.Thread | None = None
        self.caught_up_bytes = 0  # words the last catch-up thread wrote (for reports)
        # False from a prepare that returned until its commit: a pause may have made a spare
        # buffer a served parameter, so drop() must not hand them out
        self._reusable = True

    def nbytes(self) -> int:
        """Bytes of the spare buffers (memory the ping-pong adds to the parameters)."""
        return sum(int(b.numel()) for b in self.bufs.values())

    def drop(self) -> list[Any]:
        """Forget every spare buffer (after waiting for a catch-up); returns them (flat uint8 CPU
        tensors) for the caller's pool, none of them a served parameter (an empty list after a
        prepare that no commit followed: they are let go instead)."""
        self._join()
        with self._lock:
            out = list(self.bufs.values()) if self._reusable else []
            self._forget()
            self._reusable = True
        return out

    def _forget(self) -> None:
        self.bufs, self.adlers, self.holds, self.kept = {}, {}, None, None

    def wait(self) -> None:
        """Return once the catch-up thread started by :meth:`catch_up` (if any) has ended."""
        self._join()

    def _join(self) -> float:
        th = self._thread
        if th is None:
            return 0.0
        t0 = time.monotonic()
        if th.is_alive():  # waited for: no longer background work (a lowered thread on busy cores)
            boost_lowered()
        th.join()
        self._thread = None
        return (time.monotonic() - t0) * 1000.0

    # -- while serving ---------------------------------------------------------------------
    def prepare(
        self, wp: WordPlan, serving: str, params: Mapping[str, Any], take: Callable[[int, Any], Any]
    ) -> tuple[dict[str, Any], Step]:
        """Bring the spare buffers of ``wp``'s changed tensors to the target of ``wp`` (a checked
        word plan on the served ``params``, which hold ``serving``); returns ``({name: spare
        buffer shaped like its parameter}, Step)`` for the pause to rebind. ``take(nbytes,
        dtype)`` gives a flat uint8 CPU tensor for a parameter without a spare buffer
        (``SpareBuffers.take``). ``wp.views`` are pointed at the spare buffers and ``wp.result``
        holds every tensor's Adler-32 after. Raises as the module doc says; the spare buffers then
        hold no known snapshot (:meth:`drop` them); the served parameters are never written."""
        step = Step(waited_ms=self._join())
        step.background, self.caught_up_bytes = self.caught_up_bytes, 0
        with self._lock:
            try:
                out = self._prepare(wp, serving, params, take, step)
                self._reusable = False
                return out, step
            except (BdnError, ValueError):
                self.holds = self.kept = None  # (the caller drops the buffers)
                raise

    def _prepare(
        self, wp: WordPlan, serving: str, params: Mapping[str, Any], take: Callable[[int, Any], Any], step: Step
    ) -> dict[str, Any]:
        if self.holds != serving:
            k = self.kept
            if self.holds is None or k is None or k.base != self.holds or k.target != serving:
                self._forget()  # (nothing held, or not one delta behind: copy again below)
            else:
                step.caught_up = self._apply_kept(k, serving)
        self.holds = None  # written below: forgotten unless commit() follows
        for name, view in wp.views.items():
            if name in self.bufs:
                if self.adlers[name] != wp.adlers.get(name):
                    raise ChecksumError(
                        f"the spare buffer of tensor {name[:80]!r} holds Adler-32 {self.adlers[name]}, "
                        f"the served parameter {wp.adlers.get(name)}"
                    )
                continue
            live = params[name]
            buf = take(len(view), live.dtype)
            np.copyto(buf.numpy(), view)
            self.bufs[name] = buf
            self.adlers[name] = wp.adlers[name]
            step.copied += len(view)
        out: dict[str, Any] = {}
        for name in wp.views:
            live, buf = params[name], self.bufs[name]
            wp.views[name] = buf.numpy()
            out[name] = buf.view(live.dtype).reshape(live.shape)
        self.kept = None
        step.written = apply_words(wp, self.workers)
        for name in wp.views:
            self.adlers[name] = wp.result[name]
        return out

    def commit(self, rebound: Mapping[str, Any], before: Mapping[str, int], old: str, new: str, wp: WordPlan) -> None:
        """After the pause rebound the parameters of ``rebound`` (name -> the flat uint8 CPU tensor
        each served before, Adler-32 ``before[name]``) to what :meth:`prepare` returned: those
        become the spare buffers, holding ``old`` (the snapshot swapped out), and ``wp``'s delta
        ``old`` -> ``new`` is kept for :meth:`catch_up`. A prepared tensor not in ``rebound``
        (copied into its parameter, not rebound) loses its spare buffer."""
        with self._lock:
            for name in wp.views:
                if name in rebound:
                    self.bufs[name] = rebound[name]
                    self.adlers[name] = before[name]
                else:
                    self.bufs.pop(name, None)
                    self.adlers.pop(name, None)
            self.holds = old
            self.kept = Kept(old, new, wp.files, wp.fused)
            self._reusable = True

    def catch_up(self, fused: Callable[[], bool] | None = None) -> threading.Thread | None:
        """Apply the kept delta to the spare buffers on a daemon thread (returned; None when
        nothing is kept); a failure forgets them, with one log line."""
        self._join()
        if self.kept is None or self.holds is None:
            return None

        def run() -> None:
            lower_this_thread(self.background_nice)  # (its apply's worker threads inherit it)
            with self._lock:
                k = self.kept
                if k is None or self.holds != k.base:
                    return
                if fused is not None:
                    k.fused = fused()
                try:
                    self.caught_up_bytes = self._apply_kept(k, k.target)
                except (BdnError, ValueError) as e:
                    log.warning(
                        "ping-pong: bringing the spare buffers from %s to %s failed (%s): forgotten, the "
                        "next delta copies them again",
                        k.base,
                        k.target,
                        str(e).splitlines()[0][:300] if str(e) else type(e).__name__,
                    )
                    self._forget()

        self._thread = threading.Thread(target=run, name="engine-pingpong-catch-up", daemon=True)
        self._thread.start()
        return self._thread

    def _apply_kept(self, k: Kept, target: str) -> int:
        """XOR ``k``'s words into the spare buffers it changes (lock held); they then hold
        ``target``. Raises as :func:`bdn.proto.sparse.apply_sparse_tensors`."""
        written = 0
        run = thread_map(self.workers)
        for f in k.files:
            names = [n for n in f.header.tensors if n in self.bufs]
            if not names:
                continue
            sub = Header(f.header.data_start, f.header.metadata, {n: f.header.tensors[n] for n in names})
            views = {n: self.bufs[n].numpy() for n in names}
            known = {n: self.adlers[n] for n in names}
            res = sparse.apply_sparse_tensors(
                views, sub, f.diff, {n: f.streams[n] for n in names}, known, map=run, fused=k.fused
            )
            written += res.written
            self.adlers.update({n: res.adlers[n] for n in names})
        self.holds, self.kept = target, None
        return written
