"""The replica's view: target, current (serving) snapshot, engines and their leases.

A **replica** is this daemon plus the engines registered with it. Replica stages (as
``bdn.proto.states.REPLICA_STAGES``): ``queued, downloading, applying, verifying`` (the
snapshot on this node), ``ready`` (verified, engine not yet told), ``loading`` (an engine took
it and prepares it), ``done`` (every engine acknowledged the swap; with no engine registered,
the daemon alone is the replica and is done once it serves the ready snapshot), ``error`` (failed,
with the reason). The target changes only through :meth:`ReplicaView.adopt`.

Engines (DESIGN.md, "Engine link and leases"): each offer carries the target's engine options and
the tensors that changed against the snapshot that engine serves (``replica/changes.py``); an
engine not seen for ``engine_stale_s`` is stale (the replica's stage and ``engines`` count leave it
out, a replica with only stale engines is in ``error`` saying so), one not seen for
``engine_ttl_s`` is dropped (``replica/engines.py``) and the replica's stage recomputed without it. ``on_current(identity)`` is called whenever the served snapshot changes
(the ``current`` link, ``bdn/daemon/store/current.py``).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable
from typing import Any

from bdn.daemon.errors import Conflict
from bdn.daemon.observe import versioned
from bdn.daemon.process.clock import Clock
from bdn.daemon.replica import claims, contract
from bdn.daemon.replica import engines as engine_rules
from bdn.daemon.replica.changes import ChangedTensorsCache, DeltaSource, changed_words, delta_source
from bdn.daemon.replica.engines import Engine
from bdn.daemon.replica.options import DEFAULT_OPTIONS
from bdn.daemon.replica.ports import SnapshotRecord, Snapshots
from bdn.daemon.replica.target import Target, later, supersedes
from bdn.daemon.snapshots.foreign_source import Hint, Hints
from bdn.daemon.store.current import LINK_NAME
from bdn.proto.errors import BdnError
from bdn.proto.fleet_schema import replica_row
from bdn.proto.states import TERMINAL

log = logging.getLogger("bdn.hotload")
NO_TARGET = "no hot-load target yet: no STARTUP_SNAPSHOT loaded, no hot-load received"
MAX_ENGINES = 256  # engines one daemon keeps registered at once


class ReplicaView:
    """This replica's target, served snapshot, engines and leases; snapshots through ``Snapshots``."""

    def __init__(
        self,
        node_id: str,
        snapshots: Snapshots,
        clock: Clock,
        hints: Hints | None = None,
        engine_ttl_s: float = 30.0,
        changes: ChangedTensorsCache | None = None,
        engine_stale_s: float = 0.0,
        on_current: Callable[[str], None] | None = None,
        on_engines: Callable[[list[Engine], Target | None], None] | None = None,
    ) -> None:
        self.node_id = node_id
        self.snapshots = snapshots
        self.clock = clock
        self.hints = hints if hints is not None else Hints()
        self.engine_ttl_s = engine_ttl_s
        self.engine_stale_s = engine_stale_s  # 0: engines are never stale, only dropped
        self.changes = changes or ChangedTensorsCache(snapshots.ready_dir)
        self.claims = claims.Claims(snapshots)  # targets' policy versions checked against manifests
        self.on_current = on_current
        self.on_engines = on_engines  # called with the engine table and target at each change (registry.py)
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
        """Record a change of the replica (``version`` + 1), hand the engine table and the target
        to ``on_engines`` (kept across a restart) and wake ``wait_change`` callers."""
        self.version += 1
        self._saved()
        async with self.changed:
            self.changed.notify_all()

    async def wait_change(self, since: int, timeout: float) -> None:
        """Return once ``version`` differs from ``since`` or ``timeout`` seconds passed."""
        await versioned.wait_change(self.changed, lambda: self.version, since, timeout)

    # ---- events ----------------------------------------------------------------------------
    async def adopt(self, target: Target, source: str, retry_failed: bool = False) -> bool:
        """Event: a target seen (request, fan-out, membership). It becomes this replica's target
        unless a later one is already set; True if it did. ``retry_failed``: the same request
        posted again (a trainer's re-POST, or its fan-out): a failed load of it starts again
        (membership rounds, which repeat the target every round, do not pass it)."""
        if (why := self.claims.contradiction(target)) is not None:  # refuted: docs/TRUST.md
            log.debug("%s (from %s): ignored", why, source)
            return False
        cur = self.target
        sup = supersedes(target, cur)
        # STARTUP_SNAPSHOT's target replaced by the first hot-load is not a hot-load that lost
        if sup is not None and not (cur is not None and cur.origin == "startup" and sup[0] == cur.identity):
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
            job = self.snapshots.prefetch(
                target.identity, requested_by=f"hot-load {target.request_id}", wait_publish=False
            )  # accepted = published (else 404): fail at once
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
        """Event: a snapshot on this node changed (the catalog calls this). A delta target whose
        stored layer is complete (``applying``) starts the changed-tensor list for the engines that
        serve its base, so the offer at READY does not wait for it."""
        self.target = self.claims.corrected(self.target, job.identity)
        if job.state == "ready":
            self.on_snapshot_ready(job.identity)
        elif job.state == "applying" and self.target is not None and self.target.identity == job.identity:
            delta = self._delta_source(job.identity)
            if delta is not None and any(e.acked == delta.base for e in self._live()):
                self.changes.start(delta.base, job.identity, delta)
        await self.poke()

    def _delta_source(self, identity: str) -> DeltaSource | None:
        job = self.snapshots.get(identity)
        stored_dir, m = getattr(self.snapshots, "stored_dir", None), getattr(job, "manifest", None)  # fakes lack them
        return delta_source(m, stored_dir(identity)) if m is not None and stored_dir is not None else None

    def on_snapshot_ready(self, identity: str) -> None:
        """With no engine registered, the daemon serves what is ready."""
        if not self.engines and self.target is not None and self.target.identity == identity:
            self._set_current(identity)

    def _live(self) -> list[Engine]:
        """The registered engines that are not stale."""
        return [e for e in self.engines.values() if not e.stale]

    def _all_acked(self, identity: str) -> bool:
        """Every live engine acknowledged ``identity`` (true with none registered; false when
        every registered engine is stale: nobody took it)."""
        live = self._live()
        return (not self.engines or bool(live)) and all(e.acked == identity for e in live)

    def _set_current(self, identity: str) -> None:
        """The replica now serves ``identity`` (every engine acknowledged it, or there is none)."""
        job = self.snapshots.get(identity)
        changed = identity != self.current
        self.current = identity
        self.current_policy_version = job.policy_version if job else None
        if changed and self.on_current is not None:
            try:
                self.on_current(identity)
            except OSError as e:  # the link is a convenience; serving goes on without it
                log.error("cannot point the current link at %s: %s", identity, e)

    def _recompute_current(self) -> None:
        """After an engine left or went stale: the replica serves the target once every remaining
        live engine acknowledged it (or none remains and it is ready here)."""
        t = self.target
        if t is None:
            return
        job = self.snapshots.get(t.identity)
        if job is None or job.state != "ready":
            return
        if self._all_acked(t.identity):
            self._set_current(t.identity)

    def pinned(self) -> set[str]:
        """Identities GC must keep: leased, current, target."""
        keep = self.leased() | ({self.current} if self.current else set())
        return keep | ({self.target.identity} if self.target else set())

    # ---- the replica record ----------------------------------------------------------------
    def replica(self) -> dict[str, Any]:
        """This replica as ``GET /hot_load/v1/models/hot_load`` lists it (every key of
        ``bdn.proto.fleet_schema.REPLICA_ROW``)."""
        t = self.target
        stage, reason, progress = "queued", "", 0.0
        ident = t.identity if t else self.current
        job = self.snapshots.get(ident) if ident else None
        if t is None and job is None:  # (ident is None unless something is served)
            stage, reason = ("done", "") if self.current else ("queued", NO_TARGET)
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
            assert ident is not None  # a job was found: ident is set
            stage, reason = engine_rules.engine_stage(
                list(self.engines.values()),
                ident,
                self.current,
                self.clock.monotonic(),
                self.engine_stale_s,
                self.engine_ttl_s,
            )
        pauses = [e.pause_ms for e in self.engines.values() if e.acked == self.current and e.pause_ms is not None]
        reports = [e for e in self.engines.values() if e.acked == self.current and e.swap is not None]
        last = max(reports, key=lambda e: e.pause_ms or 0.0) if reports else None
        options = t.options if t is not None else DEFAULT_OPTIONS
        return replica_row(
            self.node_id,
            {"stage": stage, "identity": ident, "progress": round(progress, 4), "reason": reason},
            current_snapshot_identity=self.current,
            policy_version=self.current_policy_version,
            readiness=self.current is not None,
            engines=len(self._live()),
            last_swap_pause_ms=max(pauses) if pauses else None,
            superseded=list(self.superseded),
            request_id=t.request_id if t else None,
            **options.wire(),
            last_swap=dict(last.swap, engine_id=last.engine_id) if last is not None and last.swap else None,
            reported_at=round(self.clock.time(), 3),
        )

    def current_record(self) -> dict[str, Any] | None:
        """``{"identity", "policy_version", "path", "link"}`` of the snapshot this replica serves
        (``path`` its READY directory, ``link`` the ``current`` symlink naming it), or None."""
        if self.current is None:
            return None
        path = self.snapshots.ready_dir(self.current)
        return {
            "identity": self.current,
            "policy_version": self.current_policy_version,
            "path": str(path),
            "link": str(path.parent / LINK_NAME),
        }

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

    def register_engine(
        self, name: str, serving: str | None = None, engine_id: str | None = None, offered: str | None = None
    ) -> Engine:
        """A new engine entry (the replica now waits for its acknowledgements).

        ``serving``: the snapshot the engine says it serves already (it registers again after it
        was dropped, or after this daemon restarted without its table, ``registry.py``). When that
        snapshot is ready here the engine starts as having acknowledged it, as by an ack: a lease
        keeps it, the replica counts it, the next offer's changed tensors and words are relative to
        it. Otherwise it is ignored (one line) and the engine is offered the target as on a first
        load. ``engine_id``, ``offered``: the id to give it and the snapshot it was offered and has
        not answered yet (a registration restored at start, ``registry.py``), else a new id.

        Raises:
            Conflict: ``MAX_ENGINES`` engines are registered already (the local API is
                unauthenticated: a loop of registrations must not grow the table without bound).
        """
        if len(self.engines) >= MAX_ENGINES:
            raise Conflict(
                f"{MAX_ENGINES} engines are registered on this daemon already; "
                "unregister one (bdnctl engines --remove ID) or let dead ones expire (engine_ttl_s)"
            )
        now = self.clock.monotonic()
        e = Engine(engine_id or secrets.token_hex(8), name[:128] or "engine", last_seen=now, registered=now)
        self.engines[e.engine_id] = e
        job = self.snapshots.get(serving) if serving else None
        if serving and job is not None and job.state == "ready":
            e.acked, e.lease_id = serving, self.lease(serving, f"engine {e.engine_id}")
            if self._all_acked(serving):
                self._set_current(serving)
        if offered and offered != e.acked and getattr(self.snapshots.get(offered), "state", "") == "ready":
            e.offered, e.offered_lease = offered, self.lease(offered, f"engine {e.engine_id}")
        log.info("engine %s (%s) registered%s", e.engine_id, e.name, engine_rules.serving_note(serving, e.acked))
        return e

    def _saved(self) -> None:
        if self.on_engines is not None:
            self.on_engines(list(self.engines.values()), self.target)

    def engine(self, engine_id: str) -> Engine | None:
        """The registered engine ``engine_id``, or None."""
        return self.engines.get(engine_id)

    def unregister_engine(self, engine_id: str) -> bool:
        """Forget an engine, release its leases and recompute the replica without it; False if unknown."""
        e = self.engines.pop(engine_id, None)
        if e is None:
            return False
        self.release(e.lease_id)
        self.release(e.offered_lease)
        self._recompute_current()
        self.version += 1  # pollers and the fleet view see the change at their next look
        return True

    async def heartbeat(self, engine: Engine) -> None:
        """Event: the engine says it is alive while it is not polling (it prepares or swaps)."""
        if self._seen(engine):
            await self.poke()

    def _seen(self, engine: Engine) -> bool:
        """The engine was heard from now (poll, heartbeat, ack). A stale one is live again at once
        (the replica recomputed; True: the caller pokes), not at the next liveness tick: until
        then the replica would report an engine that just spoke as stopped (stage ``error``)."""
        engine.last_seen = self.clock.monotonic()
        if not engine.stale:
            return False
        engine.stale = False
        log.info("engine %s (%s) heard from again: live", engine.engine_id, engine.name)
        self._recompute_current()
        return True

    def describe_engines(self) -> list[dict[str, Any]]:
        """Every registered engine as ``GET /v1/engines`` lists it, in registration order."""
        now = self.clock.monotonic()
        return [e.describe(now, self.engine_ttl_s) for e in self.engines.values()]

    async def expire_engines(self) -> list[str]:
        """Event (periodic, the liveness tick): mark the engines not seen for ``engine_stale_s``
        stale (and the ones heard from since live again), drop the ones not seen for
        ``engine_ttl_s``, recompute the replica; the ids dropped."""
        now = self.clock.monotonic()
        went, back = engine_rules.stale_changes(self.engines.values(), now, self.engine_stale_s)
        for engine_id in went:
            e = self.engines[engine_id]
            e.stale = True
            log.warning(
                "engine %s (%s) not seen for over %g s: stale, the replica no longer waits for it (dropped after %g s)",
                engine_id,
                e.name,
                self.engine_stale_s,
                self.engine_ttl_s,
            )
        for engine_id in back:
            e = self.engines[engine_id]
            e.stale = False
            log.info("engine %s (%s) heard from again: live", engine_id, e.name)
        gone = engine_rules.expired(self.engines.values(), now, self.engine_ttl_s)
        for engine_id in gone:
            e = self.engines[engine_id]
            log.warning(
                "engine %s (%s) not seen for over %g s: dropped, its leases released",
                engine_id,
                e.name,
                self.engine_ttl_s,
            )
            self.unregister_engine(engine_id)
        if went or back:
            self._recompute_current()
        if went or back or gone:
            await self.poke()
        return gone

    async def expiry_loop(self) -> None:
        """Run :meth:`expire_engines` every ``poll_step(engine_ttl_s, engine_stale_s)`` seconds, forever."""
        if self.engine_ttl_s <= 0 and self.engine_stale_s <= 0:
            return
        while True:
            await asyncio.sleep(engine_rules.poll_step(self.engine_ttl_s, self.engine_stale_s))
            await self.expire_engines()

    def _offerable(self, engine: Engine, after: str | None) -> str | None:
        ident = self.target.identity if self.target else None
        if ident is None:
            return None
        job = self.snapshots.get(ident)
        if job is None or job.state != "ready":
            return None
        return None if ident == after and not engine_rules.offer_again(engine, ident, job.ready_count) else ident

    async def next_for(
        self,
        engine: Engine,
        after: str | None,
        timeout: float,
        connected: Callable[[], bool] = lambda: True,
        serving: str | None = None,
    ) -> dict[str, Any] | None:
        """Long-poll: the target snapshot once it is READY here and differs from ``after``.
        ``serving`` (what the engine says it serves): the offered snapshot there counts as
        acknowledged (an ack lost while this daemon restarted).

        The offer: ``{"identity", "policy_version", "kind", "path", "lease_id",
        "prompt_cache_policy", "inflight_policy", "inflight_wait_s", "engine_ttl_s",
        "changed_tensors"?, "changed_tensors_base"?, "changed_ranges"?, "changed_words"?}`` (docs/ENGINES.md); the changed tensors are
        relative to the snapshot this engine acknowledged last, and absent on its first load or
        when they cannot be told (``replica/changes.py``). None after ``timeout`` s, when the
        poller's connection is gone (``connected()`` false) or the engine was dropped.
        """
        if serving and engine.offered == serving != engine.acked:
            await self.ack(engine, serving, None, None)
        deadline = self.clock.monotonic() + timeout
        step = engine_rules.poll_step(self.engine_ttl_s, self.engine_stale_s)
        while True:
            if not connected() or self.engines.get(engine.engine_id) is not engine:
                return None
            if self._seen(engine):
                await self.poke()
            ident = self._offerable(engine, after)
            if ident is not None:
                job = self.snapshots.get(ident)
                assert job is not None
                if engine.offered != ident:
                    self.release(engine.offered_lease)
                    engine.offered_lease = self.lease(ident, f"engine {engine.engine_id}")
                    engine.offered, engine.error = ident, None
                    await self.poke()
                elif engine.error is not None:  # offered again (``offer_again``): loading, not failed
                    engine.error = None
                    await self.poke()
                offer: dict[str, Any] = {
                    "identity": ident,
                    "policy_version": job.policy_version,
                    "kind": job.kind,
                    "path": str(self.snapshots.ready_dir(ident)),
                    "lease_id": engine.offered_lease,
                    **(self.target.options if self.target else DEFAULT_OPTIONS).wire(),
                    "engine_ttl_s": self.engine_ttl_s,
                    "engine_stale_s": self.engine_stale_s,
                }
                base = engine.acked
                base_job = self.snapshots.get(base) if base else None
                if base and base != ident and base_job is not None and base_job.state == "ready":
                    names = await self.changes.between(base, ident, delta := self._delta_source(ident))
                    if names is not None:
                        offer.update(
                            changed_tensors=names, changed_tensors_base=base, **self.changes.ranges_of(base, ident)
                        )
                        offer.update(changed_words(delta, base, job))
                if self._seen(engine):
                    await self.poke()
                return offer
            left = deadline - self.clock.monotonic()
            if left <= 0:
                return None
            await self.wait_change(self.version, min(left, step))

    async def ack(
        self,
        engine: Engine,
        identity: str,
        pause_ms: float | None,
        error: str | None,
        report: dict[str, Any] | None = None,
        prompt_cache_policy: str | None = None,
        inflight_policy: str | None = None,
    ) -> None:
        """An engine swapped to ``identity`` (``pause_ms`` measured by it) or failed with ``error``.

        ``report`` is the ack's ``swap`` object, ``prompt_cache_policy`` / ``inflight_policy`` the
        policies the engine applied (kept, bounded, for the replica and engine views).

        Raises:
            Conflict: ``identity`` was never offered to (nor acknowledged by) this engine.
        """
        if engine.offered != identity and engine.acked != identity:
            raise Conflict(f"engine was not offered {identity!r} (offered {engine.offered!r})")
        self._seen(engine)
        if error:
            engine.error = error.splitlines()[0][:500]
            engine.error_ready = getattr(self.snapshots.get(identity), "ready_count", 0)
            log.error("engine %s failed to load %s: %s", engine.engine_id, identity, engine.error)
        else:
            if engine.offered == identity and engine.offered_lease:
                self.release(engine.lease_id)
                engine.lease_id, engine.offered_lease = engine.offered_lease, None
            engine.acked, engine.pause_ms, engine.error = identity, pause_ms, None
            engine.swap = engine_rules.sanitize_report(report)
            engine.prompt_cache_policy = prompt_cache_policy[:32] if prompt_cache_policy else None
            engine.inflight_policy = inflight_policy[:32] if inflight_policy else None
            if self._all_acked(identity):
                self._set_current(identity)
            log.info("engine %s serves %s (pause %.1f ms)", engine.engine_id, identity, pause_ms or 0.0)
        await self.poke()
