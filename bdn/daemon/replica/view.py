"""The replica's view: target, current (serving) snapshot, engines and their leases.

A **replica** is this daemon plus the engines registered with it. Replica stages (as
``bdn.proto.states.REPLICA_STAGES``): ``queued, downloading, applying, verifying`` (the
snapshot on this node), ``ready`` (verified, engine not yet told), ``loading`` (an engine took
it and prepares it), ``done`` (every engine acknowledged the swap; with no engine registered,
the daemon alone is the replica and is done when the snapshot is ready), ``error`` (failed,
with the reason). The target changes only through :meth:`ReplicaView.adopt`.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass
from typing import Any

from bdn.daemon.clock import Clock
from bdn.daemon.errors import Conflict
from bdn.daemon.foreign_source import Hint, Hints
from bdn.daemon.replica import contract
from bdn.daemon.replica.ports import SnapshotRecord, Snapshots
from bdn.daemon.replica.target import Target, later, supersedes
from bdn.proto.errors import BdnError
from bdn.proto.states import TERMINAL

log = logging.getLogger("bdn.hotload")


@dataclass
class Engine:
    """An engine registered with this daemon: what it was offered and acknowledged, its leases."""
    engine_id: str
    name: str
    offered: str | None = None  # identity handed out by /next, not yet acknowledged
    acked: str | None = None
    error: str | None = None
    pause_ms: float | None = None
    lease_id: str | None = None  # lease on ``acked`` (or the offered one until then)
    offered_lease: str | None = None
    last_seen: float = 0.0


class ReplicaView:
    """This replica's target, served snapshot, engines and leases; snapshots through ``Snapshots``."""

    def __init__(self, node_id: str, snapshots: Snapshots, clock: Clock, hints: Hints | None = None) -> None:
        self.node_id = node_id
        self.snapshots = snapshots
        self.clock = clock
        self.hints = hints if hints is not None else Hints()
        self.target: Target | None = None
        self.current: str | None = None
        self.current_policy_version: int | None = None
        self.superseded: list[dict[str, str]] = []
        self.engines: dict[str, Engine] = {}
        self.leases: dict[str, tuple[str, str]] = {}  # lease id -> (identity, holder)
        self.changed = asyncio.Condition()
        self.version = 0

    # ---- change notification ---------------------------------------------------------------
    async def poke(self) -> None:
        self.version += 1
        async with self.changed:
            self.changed.notify_all()

    async def wait_change(self, since: int, timeout: float) -> None:
        if self.version != since or timeout <= 0:
            return
        async with self.changed:
            try:
                await asyncio.wait_for(self.changed.wait_for(lambda: self.version != since), timeout)
            except asyncio.TimeoutError:
                pass

    # ---- events ----------------------------------------------------------------------------
    async def adopt(self, target: Target, source: str, retry_failed: bool = False) -> bool:
        """Event: a target seen (request, fan-out, membership). It becomes this replica's target
        unless a later one is already set; True if it did. ``retry_failed``: the same request
        posted again (a trainer's re-POST, or its fan-out): a failed load of it starts again
        (membership rounds, which repeat the target every round, do not pass it)."""
        cur = self.target
        sup = supersedes(target, cur)
        if sup is not None:
            self._supersede(*sup)
        if not later(target, cur):
            if retry_failed and cur is not None and cur.request_id == target.request_id:
                job = self.snapshots.get(cur.identity)
                if job is not None and job.state == "failed":
                    log.info("hot-load %s: the same request again; its failed load starts again", cur.identity)
                    self.snapshots.prefetch(cur.identity, requested_by=f"hot-load {cur.request_id}")
                    await self.poke()
            return False
        self.target = target
        log.info("hot-load: target is now %s (from %s, request %s)", target.identity, source, target.request_id)
        if target.base is not None and self.hints.get(target.identity).base_identity is None:
            self.hints.set(target.identity, Hint(target.base))
        if cur is not None and cur.identity != target.identity:
            await self._cancel_superseded(cur.identity, target)
        try:
            job = self.snapshots.prefetch(target.identity, requested_by=f"hot-load {target.request_id}")
            if job.state == "ready":
                self.on_snapshot_ready(target.identity)
        except BdnError as e:
            log.error("hot-load %s: %s", target.identity, e)
        await self.poke()
        return True

    def _base_of(self, identity: str) -> str | None:
        job = self.snapshots.get(identity)
        if job is not None and job.kind is not None:
            return job.base_identity if job.kind == "delta" else None
        if self.target is not None and self.target.identity == identity and self.target.base is not None:
            return self.target.base
        return self.hints.get(identity).base_identity

    async def _cancel_superseded(self, old: str, new: Target) -> None:
        """The load of ``old`` stops (its bandwidth freed) unless ``new``'s chain needs it, it is
        served, or it is already ready or failed."""
        if old == self.current or contract.keep_superseded(old, contract.base_chain(new.identity, self._base_of)):
            return
        job = self.snapshots.get(old)
        if job is None or job.state in TERMINAL:
            return
        log.info("hot-load: the load of %s is cancelled: superseded by %s", old, new.identity)
        await self.snapshots.cancel(old, f"cancelled: superseded by {new.identity}")

    def set_startup_target(self, identity: str) -> None:
        """STARTUP_SNAPSHOT names ``identity``: it is the target (seq 0) unless one is set."""
        if self.target is None:
            self.target = Target(identity, 0, "startup", "startup")

    def _supersede(self, old: str, new: str) -> None:
        self.superseded.append({"identity": old, "by": new})
        del self.superseded[:-16]
        log.info("hot-load: %s superseded by %s", old, new)

    async def on_job_changed(self, job: SnapshotRecord) -> None:
        """Event: a snapshot on this node changed (the catalog calls this)."""
        if job.state == "ready":
            self.on_snapshot_ready(job.identity)
        await self.poke()

    def on_snapshot_ready(self, identity: str) -> None:
        """With no engine registered, the daemon serves what is ready."""
        if not self.engines and self.target is not None and self.target.identity == identity:
            job = self.snapshots.get(identity)
            self.current = identity
            self.current_policy_version = job.policy_version if job else None

    def pinned(self) -> set[str]:
        """Identities GC must keep: leased, current, target."""
        keep = self.leased()
        if self.current:
            keep.add(self.current)
        if self.target:
            keep.add(self.target.identity)
        return keep

    # ---- the replica record ----------------------------------------------------------------
    def replica(self) -> dict[str, Any]:
        """This replica as ``GET /hot_load/v1/models/hot_load`` lists it."""
        t = self.target
        stage, reason, progress = "queued", "", 0.0
        ident = t.identity if t else self.current
        job = self.snapshots.get(ident) if ident else None
        if t is None and job is None:
            stage = "done" if self.current else "queued"
        elif job is None:
            stage = "queued"
        elif job.state == "failed":
            stage, reason = "error", job.reason
        elif job.state != "ready":
            stage = job.state
            progress = (job.bytes_done / job.bytes_total) if job.bytes_total else 0.0
            if job.reason:
                reason = job.reason
        else:
            progress = 1.0
            stage, reason = self._engine_stage(ident)  # type: ignore[arg-type]
        pauses = [e.pause_ms for e in self.engines.values() if e.acked == self.current and e.pause_ms is not None]
        return {
            "replica_id": self.node_id,
            "current_snapshot_identity": self.current,
            "policy_version": self.current_policy_version,
            "readiness": self.current is not None,
            "loading_state": {"stage": stage, "identity": ident, "progress": round(progress, 4), "reason": reason},
            "engines": len(self.engines),
            "last_swap_pause_ms": max(pauses) if pauses else None,
            "superseded": list(self.superseded),
            "request_id": t.request_id if t else None,
        }

    def _engine_stage(self, ident: str) -> tuple[str, str]:
        """``(stage, reason)`` of a replica whose target ``ident`` is ready on this node."""
        if not self.engines:
            return "done", ""
        errs = [e.error for e in self.engines.values() if e.offered == ident and e.error]
        if errs:
            return "error", errs[0]
        if all(e.acked == ident for e in self.engines.values()):
            return "done", ""
        if any(e.offered == ident for e in self.engines.values()):
            return "loading", ""
        return "ready", ""

    # ---- engines and leases --------------------------------------------------------------
    def lease(self, identity: str, holder: str) -> str:
        """Keep ready snapshot ``identity`` out of GC for ``holder``; the lease id. Conflict if not ready."""
        job = self.snapshots.get(identity)
        if job is None or job.state != "ready":
            raise Conflict(f"snapshot {identity!r} is not ready on this node")
        lid = secrets.token_hex(8)
        self.leases[lid] = (identity, holder[:128])
        return lid

    def release(self, lease_id: str | None) -> bool:
        """Drop a lease; False if there was none."""
        return lease_id is not None and self.leases.pop(lease_id, None) is not None

    def leased(self) -> set[str]:
        """Identities that hold at least one lease."""
        return {ident for ident, _ in self.leases.values()}

    def register_engine(self, name: str) -> Engine:
        """A new engine entry (the replica now waits for its acknowledgements)."""
        e = Engine(secrets.token_hex(8), name[:128] or "engine", last_seen=self.clock.monotonic())
        self.engines[e.engine_id] = e
        log.info("engine %s (%s) registered", e.engine_id, e.name)
        return e

    def engine(self, engine_id: str) -> Engine | None:
        return self.engines.get(engine_id)

    def unregister_engine(self, engine_id: str) -> bool:
        """Forget an engine and release its leases; False if unknown."""
        e = self.engines.pop(engine_id, None)
        if e is None:
            return False
        self.release(e.lease_id)
        self.release(e.offered_lease)
        job = self.snapshots.get(self.target.identity) if self.target is not None else None
        if job is not None and job.state == "ready":
            # the one engine still to acknowledge may be the one that left (with none left, the
            # daemon is the replica and serves what is ready)
            self._serve_if_all_acked(job.identity)
        return True

    def _serve_if_all_acked(self, identity: str) -> None:
        """``identity`` is current once every registered engine acknowledged it."""
        if all(e.acked == identity for e in self.engines.values()):
            job = self.snapshots.get(identity)
            self.current = identity
            self.current_policy_version = job.policy_version if job else None

    def _offerable(self, after: str | None) -> str | None:
        ident = self.target.identity if self.target else None
        if ident is None:
            return None
        job = self.snapshots.get(ident)
        if job is None or job.state != "ready" or ident == after:
            return None
        return ident

    async def next_for(self, engine: Engine, after: str | None, timeout: float) -> dict[str, Any] | None:
        """Long-poll: the target snapshot once it is READY here and differs from ``after``."""
        deadline = self.clock.monotonic() + timeout
        while True:
            engine.last_seen = self.clock.monotonic()
            ident = self._offerable(after)
            if ident is not None:
                job = self.snapshots.get(ident)
                assert job is not None
                if engine.offered != ident:
                    self.release(engine.offered_lease)
                    engine.offered_lease = self.lease(ident, f"engine {engine.engine_id}")
                    engine.offered, engine.error = ident, None
                    await self.poke()
                return {
                    "identity": ident,
                    "policy_version": job.policy_version,
                    "kind": job.kind,
                    "path": str(self.snapshots.ready_dir(ident)),
                    "lease_id": engine.offered_lease,
                }
            left = deadline - self.clock.monotonic()
            if left <= 0:
                return None
            await self.wait_change(self.version, min(left, 5.0))

    async def ack(self, engine: Engine, identity: str, pause_ms: float | None, error: str | None) -> None:
        """An engine swapped to ``identity`` (``pause_ms`` measured by it) or failed with ``error``.

        Raises:
            Conflict: ``identity`` was never offered to (nor acknowledged by) this engine.
        """
        if engine.offered != identity and engine.acked != identity:
            raise Conflict(f"engine was not offered {identity!r} (offered {engine.offered!r})")
        if error:
            engine.error = error.splitlines()[0][:500]
            log.error("engine %s failed to load %s: %s", engine.engine_id, identity, engine.error)
        else:
            if engine.offered == identity and engine.offered_lease:
                self.release(engine.lease_id)
                engine.lease_id, engine.offered_lease = engine.offered_lease, None
            engine.acked, engine.pause_ms, engine.error = identity, pause_ms, None
            self._serve_if_all_acked(identity)
            log.info("engine %s serves %s (pause %.1f ms)", engine.engine_id, identity, pause_ms or 0.0)
        await self.poke()
