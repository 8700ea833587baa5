"""What a node does in the background once its engines serve a new snapshot (DESIGN.md, "Sparse
apply"): the snapshot served before it is free once the engines close it; GC then recycles it
into a tagged spare, :meth:`bdn.daemon.apply.forward.Forward.catch_up` brings that spare forward
to the served snapshot, and when no spare holds it (an anchor, a snapshot loaded without its
predecessor) :meth:`Forward.seed` copies one from it. Any snapshot on its way (not terminal)
takes the spares itself, so this gives way to it at every step.

:class:`AfterServed` is called by :meth:`bdn.daemon.snapshots.runner.Runner.on_served`; its work
runs as a task the :class:`Forward` keeps (cancelled at shutdown by ``Forward.close``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import Any, Protocol, TypeVar

from bdn.daemon.apply.forward import Forward
from bdn.daemon.process.executors import Executors
from bdn.daemon.snapshots.snapshot import TERMINAL, Jobs
from bdn.daemon.store import spares
from bdn.daemon.store.store import Store

T = TypeVar("T")

#: After the engines swap, how long a catch-up waits for the old snapshot's files to be closed,
#: and how often it looks (a lease probe per file, ``bdn.daemon.store.spares.unused``).
CATCH_UP_WAIT_S = 30.0
CATCH_UP_POLL_S = 0.05


class ServedJobs(Jobs, Protocol):
    """What the catch-up needs of the catalog: the snapshots, GC and the shm budget."""

    async def gc_off_loop(self, run: Callable[[Callable[[], None]], Awaitable[None]]) -> dict[str, list[str]]:
        """Collect what the keep rules allow, the file work given to ``run`` (a worker thread)."""

    def collectable(self) -> list[str]:
        """The ready identities :meth:`gc` would remove now."""

    def budget_left(self) -> int | None:
        """Bytes of the shm budget no snapshot or spare holds (None: no budget)."""


class AfterServed:
    """The background catch-up and seed after the engines moved to a snapshot (module doc)."""

    def __init__(self, jobs: ServedJobs, store: Store, forward: Forward, pools: Executors) -> None:
        self.jobs, self.store, self.forward, self.pools = jobs, store, forward, pools

    def start(self, identity: str) -> None:
        """Event: the engines serve ready ``identity`` now (or none is registered)."""
        self.forward.spawn(self._run(identity))

    async def _on(self, pool: Executor, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    def _busy(self) -> bool:
        return any(j.state not in TERMINAL for j in self.jobs.all())

    async def _run(self, identity: str) -> None:
        jobs = self.jobs

        def free(idents: list[str]) -> bool:
            return all(spares.unused(p) for ident in idents for p in self.store.ready_dir(ident).rglob("*.safetensors"))

        # An engine closes the snapshot it swapped away from right after its ack: until then GC
        # could not recycle those files (a lease is refused on a file in use, and it is deleted).
        # No event says a mapping is gone (munmap notifies nobody), so the lease is probed.
        for _ in range(int(CATCH_UP_WAIT_S / CATCH_UP_POLL_S)):
            if await self._on(self.pools.disk, free, jobs.collectable()):
                break
            await asyncio.sleep(CATCH_UP_POLL_S)
        if self._busy():
            return  # a snapshot is on its way: it takes the spares itself
        # right after an ack: the status GET that reports done, and the peers, are served meanwhile
        await jobs.gc_off_loop(lambda files: self._on(self.pools.disk, files))
        job = jobs.get(identity)
        if job is None or job.state != "ready" or job.manifest is None:
            return
        if job.manifest.is_delta:
            await self._on(self.pools.disk, self.store.spares.prime_tagged)
            if self._busy():
                return
            await self.forward.catch_up(job.manifest, jobs.get)
        if not self._busy():
            await self.forward.seed(
                job, lambda tag: tag.get("identity") == identity, jobs.budget_left(), background=True
            )
