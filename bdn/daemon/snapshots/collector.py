"""The shm budget and garbage collection of a node's snapshots (the catalog's, ``catalog.py``).

:class:`Collector` decides with ``retention.plan_gc`` (pure) which ready snapshots nobody needs,
takes them out of the catalog (its job table, the chunk index through ``forget``, the collected
identities) on the event loop, and moves their files into the page pool (``Store.remove``,
``Spares.trim``): on the calling thread (:meth:`Collector.gc`), or on a worker thread
(:meth:`Collector.gc_off_loop`, after an engine's ack: unlinking one 589 MB tmpfs file took
100-165 ms here, with the status GET that reports ``done`` waiting behind it). It also answers the
budget questions of a snapshot about to reserve its files (``check_budget``, ``budget_left``,
``spare_room``). :class:`RunnerJobs` is what a snapshot's runner needs of the catalog.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Protocol

from bdn.daemon.config import Config
from bdn.daemon.process.clock import Clock
from bdn.daemon.snapshots import retention
from bdn.daemon.snapshots.recent import RecentSet
from bdn.daemon.snapshots.snapshot import Jobs, SnapshotJob
from bdn.daemon.store.store import Store
from bdn.proto.errors import BdnError
from bdn.proto.manifest import Manifest

log = logging.getLogger("bdn.catalog")


class RunnerJobs(Jobs, Protocol):
    """What a runner needs of the catalog: other snapshots (``Jobs``: a delta's base), the
    budget, the page pool's room, GC (a :class:`Collector`'s methods, which the catalog exposes)."""

    def spare_room(self, m: Manifest | None) -> int:
        """Bytes the page pool may keep once ``m`` is reserved (``Store.prepare_staging``)."""

    def budget_left(self) -> int | None:
        """Bytes of the shm budget no snapshot or spare holds (None: no budget)."""

    def check_budget(self, m: Manifest) -> None:
        """Raise if ``m``'s files do not fit the shm budget after GC."""

    def forget(self, job: SnapshotJob) -> None:
        """Drop ``job`` from the catalog (a failed or cancelled download)."""

    def gc(self) -> dict[str, list[str]]:
        """Collect what the keep rules allow; returns what was removed, by reason."""

    async def gc_off_loop(self, run: Callable[[Callable[[], None]], Awaitable[None]]) -> dict[str, list[str]]:
        """:meth:`gc` with the file work given to ``run`` (a worker thread)."""

    def collectable(self) -> list[str]:
        """The ready identities :meth:`gc` would remove now."""

    async def removed(self, identity: str) -> None:
        """Return once no GC removal of ``identity``'s files is in flight."""

    @property
    def closing(self) -> bool:
        """True once the daemon is stopping."""


class Collector:
    """Budget and GC over the catalog's ``jobs`` (identity -> job, the catalog's own dict:
    changed here only on the event loop). ``forget(job)``: the catalog's (drops a job's chunks
    from the index); ``collected``: where collected identities are remembered."""

    def __init__(
        self,
        cfg: Config,
        store: Store,
        jobs: dict[str, SnapshotJob],
        pins: retention.Pins,
        clock: Clock,
        collected: RecentSet,
        forget: Callable[[SnapshotJob], None],
    ) -> None:
        self.cfg, self.store, self.jobs, self.pins, self.clock = cfg, store, jobs, pins, clock
        self.collected, self.forget = collected, forget
        self._removing: dict[str, asyncio.Future[None]] = {}  # GC file work in flight (gc_off_loop)

    def check_budget(self, m: Manifest) -> None:
        """Fail early, with the reason: snapshot ``m`` is asked for by a peer's hint alone, is not
        pinned here and is older than what GC keeps (``retention.outdated``: a new node starting
        from an anchor collected here long ago; it reads it from the bucket, rather than every owner
        it asks loading a model's worth of shm that GC then collects), or, with the numbers, ``m``
        would not fit the shm budget."""
        ready = [(j.identity, j.policy_version) for j in self.jobs.values() if j.state == "ready"]
        if (
            getattr(self.jobs.get(m.identity), "requested_by", "") == "peer"
            and m.identity not in self.pins.pinned()
            and (why := retention.outdated(m.policy_version, ready, self.cfg.keep_ready)) is not None
        ):
            raise BdnError(f"snapshot {m.identity}: {why}")
        budget = self.cfg.shm_budget_bytes
        if budget <= 0:
            return
        need = self.store.space_needed(m)

        def holders() -> dict[str, int]:
            return {
                j.identity: self.store.space_needed(j.manifest)
                for j in self.jobs.values()
                if j.manifest is not None and j.identity != m.identity and j.state != "failed"
            }

        if sum(holders().values()) + need > budget:
            self.gc()
        if (u := sum((held := holders()).values())) + need > budget:
            raise BdnError(
                f"shm budget exceeded: snapshot {m.identity!r} needs {need} bytes; budget {budget}, {u} in use by "
                f"{', '.join(sorted(held)) or 'nothing'} (leased, current, in progress or ready for less than gc_grace_s)"
            )

    def budget_left(self) -> int | None:
        """Bytes of ``shm_budget_bytes`` that no snapshot (but a failed one) and no spare holds now;
        None without a budget. A seed (``Forward.seed``) is made only within it."""
        budget = self.cfg.shm_budget_bytes
        if budget <= 0:
            return None
        used = sum(
            self.store.space_needed(j.manifest)
            for j in self.jobs.values()
            if j.manifest is not None and j.state != "failed"
        )
        return budget - used - self.store.spares.bytes()

    def spare_room(self, m: Manifest | None) -> int:
        """Bytes the page pool may keep once ``m`` is reserved (None: now): its own cap, and
        under ``shm_budget_bytes`` what the snapshots (``m`` included) leave of the budget."""
        return int(max(0, min(self.store.spares.cap(), self._budget_room(m))))

    def _budget_room(self, m: Manifest | None) -> int | float:
        """What the snapshots (``m`` included) leave of ``shm_budget_bytes`` (inf: no budget)."""
        budget = self.cfg.shm_budget_bytes
        if budget <= 0:
            return math.inf
        used = sum(
            self.store.space_needed(j.manifest)
            for j in self.jobs.values()
            if j.manifest is not None and j.state != "failed" and (m is None or j.identity != m.identity)
        )
        need = self.store.space_needed(m) if m is not None else 0
        return budget - used - need

    def _plan_gc(self) -> tuple[list[str], list[str]]:
        held = [
            retention.Held(j.identity, j.state, j.policy_version, j.created, j.updated, j.base_identity)
            for j in self.jobs.values()
        ]
        pinned, left = self.pins.now()
        return retention.plan_gc(held, pinned, self.cfg.keep_ready, self.cfg.gc_grace_s, self.clock.time(), left)

    def collectable(self) -> list[str]:
        """The ready identities :meth:`gc` would remove now (nothing removed)."""
        return self._plan_gc()[0]

    def gc(self) -> dict[str, list[str]]:
        """Remove ready snapshots nobody needs (``retention``); ``{"removed": [...], "kept": [...]}``."""
        out, files = self._collect()
        files()
        return out

    async def gc_off_loop(self, run: Callable[[Callable[[], None]], Awaitable[None]]) -> dict[str, list[str]]:
        """:meth:`gc` with its file work (renaming the files into the page pool, trimming it:
        unlinking a collected 589 MB tmpfs file took 100-165 ms here) given to ``run`` (a worker
        thread), not done on the event loop. The snapshots leave the catalog and the index
        first; a job started for one of them meanwhile waits for its files to be gone
        (:meth:`removed`)."""
        out, files = self._collect()
        if out["removed"]:
            done = asyncio.ensure_future(run(files))
            for ident in out["removed"]:
                self._removing[ident] = done
            try:
                await asyncio.shield(done)
            finally:
                for ident in out["removed"]:
                    if self._removing.get(ident) is done:
                        del self._removing[ident]
        return out

    async def removed(self, identity: str) -> None:
        """Return once no GC removal of ``identity``'s files is in flight (:meth:`gc_off_loop`)."""
        fut = self._removing.get(identity)
        if fut is not None:
            await asyncio.wait([fut])

    def _collect(self) -> tuple[dict[str, list[str]], Callable[[], None]]:
        """GC's decision and bookkeeping (on the loop), and the file work that follows."""
        remove, kept = self._plan_gc()
        for ident in remove:
            j = self.jobs.pop(ident)
            self.forget(j)
            self.collected.add(ident)
            log.info("gc: removed snapshot %s (%d bytes)", ident, j.result_bytes)
        budget_room = self._budget_room(None)  # (the jobs are the loop's: read here)

        def files() -> None:
            for ident in remove:
                self.store.remove(ident)
            if remove:  # (the pool's cap after the files above joined it)
                self.store.spares.trim(int(max(0, min(self.store.spares.cap(), budget_room))))

        return {"removed": remove, "kept": kept}, files
