"""Fleet hot-load, replicas, engines and leases (DESIGN.md, "Surfaces"; hosted hot-load APIs).

A **replica** is this daemon plus the engines registered with it. The fleet has one **target**
snapshot: the identity of the latest accepted hot-load. Ordering is by ``(seq, origin)``, ``seq``
being the accepting daemon's clock in nanoseconds: a hot-load that arrives with an older order
than the target is superseded, so when two race, the later wins everywhere.

Propagation: the daemon that accepts ``POST /hot_load/v1/models/hot_load`` applies it and posts
it to every live peer (signed ``POST /bdn/v1/{swarm}/hot_load``); every membership exchange also
carries the sender's target, so a daemon that missed the fan-out, started late or restarted
adopts the fleet's target within one round and fetches its rebuilt chunks from peers instead of
replaying the delta chain from the bucket.

Replica stages: ``queued, downloading, applying, verifying`` (the snapshot on this node),
``ready`` (verified, engine not yet told), ``loading`` (an engine took it and prepares it),
``done`` (every engine acknowledged the swap; with no engine registered, the daemon alone is the
replica and is done when the snapshot is ready), ``error`` (failed, with the reason).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from bdn.bucket import BucketError, ObjectNotFound
from bdn.proto.arc import CHECKSUM_FORMATS, COMPRESSION_FORMATS
from bdn.proto.errors import BdnError, IdentityError, ManifestError
from bdn.proto.identity import validate_identity
from bdn.proto.manifest import MANIFEST_NAME, Manifest

if TYPE_CHECKING:
    from bdn.daemon.node import Node

log = logging.getLogger("bdn.hotload")
MAX_FUTURE_NS = 60 * 10**9  # twice the signature's clock-skew limit


class HotLoadError(BdnError):
    """A hot-load request refused: ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


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
    last_seen: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class Target:
    """A fleet hot-load target: ``identity`` ordered by ``(seq, origin)`` (seq = accepting clock, ns)."""
    identity: str
    seq: int
    origin: str
    request_id: str

    @property
    def order(self) -> tuple[int, str]:
        return (self.seq, self.origin)

    def wire(self) -> dict[str, Any]:
        return {"identity": self.identity, "seq": self.seq, "origin": self.origin, "request_id": self.request_id}

    @classmethod
    def from_wire(cls, obj: Any) -> Target | None:
        if not isinstance(obj, dict):
            return None
        try:
            ident = validate_identity(obj.get("identity"))
        except IdentityError:
            return None
        seq, origin, rid = obj.get("seq"), obj.get("origin"), obj.get("request_id")
        if not isinstance(seq, int) or isinstance(seq, bool) or not isinstance(origin, str) or not isinstance(rid, str):
            return None
        # seq is the accepting daemon's clock (ns). One from the future would outrank every real
        # hot-load for good, so anything past our clock plus the allowed skew is refused.
        if not 0 < seq <= time.time_ns() + MAX_FUTURE_NS:
            return None
        return cls(ident, seq, origin[:64], rid[:64])


class HotLoad:
    """The replica's view: target, current (serving) snapshot, engines and leases."""

    def __init__(self, node: Node) -> None:
        self.node = node
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

    # ---- the request ---------------------------------------------------------------------
    @staticmethod
    def parse_request(body: bytes) -> tuple[str, dict[str, Any] | None]:
        """Validate a hot-load body; ``(identity, metadata or None)``.

        Raises:
            HotLoadError: 400 malformed, 415 unsupported compression or checksum format.
        """
        try:
            obj = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise HotLoadError(400, f"request body is not JSON: {e}") from None
        except RecursionError:
            raise HotLoadError(400, "request body is nested too deeply") from None
        if not isinstance(obj, dict):
            raise HotLoadError(400, "request body must be a JSON object")
        unknown = set(obj) - {"identity", "incremental_snapshot_metadata"}
        if unknown:
            raise HotLoadError(400, f"unknown request field(s): {', '.join(sorted(unknown))}")
        try:
            ident = validate_identity(obj.get("identity"))
        except IdentityError as e:
            raise HotLoadError(400, f"identity: {e}") from None
        meta = obj.get("incremental_snapshot_metadata")
        if meta is None:
            return ident, None
        if not isinstance(meta, dict):
            raise HotLoadError(400, "incremental_snapshot_metadata must be an object")
        unknown = set(meta) - {"previous_snapshot_identity", "compression_format", "checksum_format"}
        if unknown:
            raise HotLoadError(400, f"unknown incremental_snapshot_metadata field(s): {', '.join(sorted(unknown))}")
        for k in ("previous_snapshot_identity", "compression_format", "checksum_format"):
            if k in meta and not isinstance(meta[k], str):
                raise HotLoadError(400, f"incremental_snapshot_metadata.{k} must be a string")
        if "previous_snapshot_identity" in meta:
            try:
                validate_identity(meta["previous_snapshot_identity"])
            except IdentityError as e:
                raise HotLoadError(400, f"previous_snapshot_identity: {e}") from None
        cf = meta.get("compression_format")
        if cf is not None and cf.lower() not in COMPRESSION_FORMATS:
            raise HotLoadError(
                415, f"unsupported compression_format {cf!r}: bdn supports {', '.join(COMPRESSION_FORMATS)}"
            )
        ck = meta.get("checksum_format")
        if ck is not None and ck.lower() not in CHECKSUM_FORMATS:
            raise HotLoadError(415, f"unsupported checksum_format {ck!r}: bdn supports {', '.join(CHECKSUM_FORMATS)}")
        return ident, meta

    async def _bucket(self, fn: Any, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        async with self.node.bucket_sem:
            return await loop.run_in_executor(self.node.io, fn, *args)

    async def _manifest(self, identity: str) -> Manifest | None:
        """The manifest from the bucket; None if the snapshot's files are there without it.

        Raises:
            HotLoadError: 404 when nothing is stored under ``identity/``; 502 for a bad manifest.
        """
        b = self.node.bucket
        try:
            data = await self._bucket(b.read, f"{identity}/{MANIFEST_NAME}")
        except ObjectNotFound:
            try:
                objs = await self._bucket(b.list, f"{identity}/")
            except BucketError as e:
                raise HotLoadError(502, f"cannot list {identity}/ in the bucket: {e}") from None
            if not objs:
                raise HotLoadError(404, f"snapshot {identity!r} is not in the bucket {self.node.cfg.bucket}")
            return None
        except BucketError as e:
            raise HotLoadError(502, f"cannot read the manifest of {identity!r}: {e}") from None
        self.node.counters["bucket_manifest_bytes"] += len(data)
        try:
            return Manifest.from_json(data, expect_identity=identity)
        except ManifestError as e:
            raise HotLoadError(502, f"the bucket holds an invalid manifest for {identity!r}: {e}") from None

    async def accept(self, body: bytes) -> dict[str, Any]:
        """Handle a trainer's POST: validate, apply here, fan out; the 200 answer's body.

        Raises:
            HotLoadError: with the status the hosted APIs use (400, 404, 409, 415, 502).
        """
        ident, meta = self.parse_request(body)
        m = await self._manifest(ident)
        prev = meta.get("previous_snapshot_identity") if meta else None
        if m is not None:
            if meta is not None and not m.is_delta:
                raise HotLoadError(
                    400, f"snapshot {ident!r} is a full snapshot; drop incremental_snapshot_metadata"
                )
            if m.is_delta:
                if prev is not None and prev != m.base_identity:
                    raise HotLoadError(
                        409,
                        f"previous_snapshot_identity {prev!r} is not the base of {ident!r} "
                        f"(its base is {m.base_identity!r})",
                    )
                cf = meta.get("compression_format") if meta else None
                if cf is not None and cf.lower() != m.compression_format:
                    raise HotLoadError(
                        409, f"compression_format {cf!r} does not match the snapshot's {m.compression_format!r}"
                    )
                base = m.base_identity
                assert base is not None
                bj = self.node.jobs.get(base)
                if bj is None or bj.state == "failed":
                    try:
                        await self._bucket(self.node.bucket.stat, f"{base}/{MANIFEST_NAME}")
                    except ObjectNotFound:
                        raise HotLoadError(409, f"unknown base {base!r}: it is not published in the bucket") from None
                    except BucketError as e:
                        raise HotLoadError(502, f"cannot check base {base!r}: {e}") from None
        if prev is not None and self.current is not None and prev != self.current:
            raise HotLoadError(
                409,
                f"previous_snapshot_identity {prev!r} is not the snapshot being served "
                f"({self.current!r} is)",
            )
        target = Target(ident, time.time_ns(), self.node.node_id, secrets.token_hex(8))
        await self.adopt(target, source="request")
        reached = await self.fan_out(target)
        return {
            "accepted": True,
            "identity": ident,
            "policy_version": m.policy_version if m is not None else None,
            "request_id": target.request_id,
            "replicas": reached + 1,
            "manifest_written": m is not None,
        }

    async def fan_out(self, target: Target) -> int:
        """Post ``target`` to every live peer; how many took it."""
        import msgpack

        payload = msgpack.packb(target.wire(), use_bin_type=True)

        async def one(url: str) -> bool:
            try:
                status, _ = await self.node.peers.post_json(url, "hot_load", payload, timeout=10.0)
            except Exception as e:  # a peer that misses it catches up through membership rounds
                log.warning("hot-load %s: peer %s unreachable: %s", target.identity, url, e)
                return False
            return status == 200

        results = await asyncio.gather(*(one(m.url) for m in self.node.membership.live()))
        return sum(results)

    async def adopt(self, target: Target, source: str) -> bool:
        """Make ``target`` this replica's target unless a later one is already set."""
        cur = self.target
        if cur is not None and (cur.order >= target.order):
            if cur.request_id != target.request_id and target.identity != cur.identity:
                self._supersede(target.identity, cur.identity)
            return False
        if cur is not None and cur.identity != target.identity:
            self._supersede(cur.identity, target.identity)
        self.target = target
        log.info("hot-load: target is now %s (from %s, request %s)", target.identity, source, target.request_id)
        try:
            job = self.node.prefetch(target.identity, requested_by=f"hot-load {target.request_id}")
            if job.state == "ready":
                self.on_snapshot_ready(target.identity)
        except BdnError as e:
            log.error("hot-load %s: %s", target.identity, e)
        await self.poke()
        return True

    def _supersede(self, old: str, new: str) -> None:
        self.superseded.append({"identity": old, "by": new})
        del self.superseded[:-16]
        log.info("hot-load: %s superseded by %s", old, new)

    # ---- replica state -------------------------------------------------------------------
    def on_snapshot_ready(self, identity: str) -> None:
        """Called by the node: with no engine registered, the daemon serves what is ready."""
        if not self.engines and self.target is not None and self.target.identity == identity:
            job = self.node.jobs.get(identity)
            self.current = identity
            self.current_policy_version = job.policy_version if job else None

    def replica(self) -> dict[str, Any]:
        """This replica as ``GET /hot_load/v1/models/hot_load`` lists it."""
        t = self.target
        stage, reason, progress = "queued", "", 0.0
        ident = t.identity if t else self.current
        job = self.node.jobs.get(ident) if ident else None
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
            if not self.engines:
                stage = "done"
            else:
                errs = [e.error for e in self.engines.values() if e.offered == ident and e.error]
                if errs:
                    stage, reason = "error", errs[0]
                elif all(e.acked == ident for e in self.engines.values()):
                    stage = "done"
                elif any(e.offered == ident for e in self.engines.values()):
                    stage = "loading"
                else:
                    stage = "ready"
        pauses = [e.pause_ms for e in self.engines.values() if e.acked == self.current and e.pause_ms is not None]
        return {
            "replica_id": self.node.node_id,
            "current_snapshot_identity": self.current,
            "policy_version": self.current_policy_version,
            "readiness": self.current is not None,
            "loading_state": {"stage": stage, "identity": ident, "progress": round(progress, 4), "reason": reason},
            "engines": len(self.engines),
            "last_swap_pause_ms": max(pauses) if pauses else None,
            "superseded": list(self.superseded),
            "request_id": t.request_id if t else None,
        }

    async def fleet(self) -> dict[str, Any]:
        """Every replica of the fleet: this one plus each member's answer."""

        async def one(m: Any) -> dict[str, Any]:
            try:
                status, body = await self.node.peers.get_json(m.url, "replica", timeout=3.0)
                if status == 200 and isinstance(body, dict):
                    return body
                reason = f"answered {status}"
            except Exception as e:  # an unreachable replica is reported, not hidden
                reason = f"unreachable: {type(e).__name__}"
            return {
                "replica_id": m.node_id or m.url,
                "current_snapshot_identity": None,
                "policy_version": None,
                "readiness": False,
                "loading_state": {"stage": "error", "identity": None, "progress": 0.0, "reason": reason},
            }

        others = await asyncio.gather(*(one(m) for m in self.node.membership.members.values() if m.node_id))
        reps = [self.replica(), *others]
        reps.sort(key=lambda r: str(r.get("replica_id")))
        return {"replicas": reps}

    # ---- engines and leases --------------------------------------------------------------
    def lease(self, identity: str, holder: str) -> str:
        """Keep ready snapshot ``identity`` out of GC for ``holder``; the lease id. HotLoadError 409 if not ready."""
        job = self.node.jobs.get(identity)
        if job is None or job.state != "ready":
            raise HotLoadError(409, f"snapshot {identity!r} is not ready on this node")
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
        e = Engine(secrets.token_hex(8), name[:128] or "engine")
        self.engines[e.engine_id] = e
        log.info("engine %s (%s) registered", e.engine_id, e.name)
        return e

    def unregister_engine(self, engine_id: str) -> bool:
        """Forget an engine and release its leases; False if unknown."""
        e = self.engines.pop(engine_id, None)
        if e is None:
            return False
        self.release(e.lease_id)
        self.release(e.offered_lease)
        return True

    def _offerable(self, after: str | None) -> str | None:
        t = self.target
        ident = t.identity if t else None
        if ident is None:
            return None
        job = self.node.jobs.get(ident)
        if job is None or job.state != "ready" or ident == after:
            return None
        return ident

    async def next_for(self, engine: Engine, after: str | None, timeout: float) -> dict[str, Any] | None:
        """Long-poll: the target snapshot once it is READY here and differs from ``after``."""
        deadline = time.monotonic() + timeout
        while True:
            engine.last_seen = time.monotonic()
            ident = self._offerable(after)
            if ident is not None:
                job = self.node.jobs[ident]
                if engine.offered != ident:
                    self.release(engine.offered_lease)
                    engine.offered_lease = self.lease(ident, f"engine {engine.engine_id}")
                    engine.offered, engine.error = ident, None
                    await self.poke()
                return {
                    "identity": ident,
                    "policy_version": job.policy_version,
                    "kind": job.kind,
                    "path": str(self.node.store.ready_dir(ident)),
                    "lease_id": engine.offered_lease,
                }
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            await self.wait_change(self.version, min(left, 5.0))

    async def ack(self, engine: Engine, identity: str, pause_ms: float | None, error: str | None) -> None:
        """An engine swapped to ``identity`` (``pause_ms`` measured by it) or failed with ``error``."""
        if error:
            engine.error = error.splitlines()[0][:500]
            log.error("engine %s failed to load %s: %s", engine.engine_id, identity, engine.error)
        else:
            if engine.offered == identity and engine.offered_lease:
                self.release(engine.lease_id)
                engine.lease_id, engine.offered_lease = engine.offered_lease, None
            engine.acked, engine.pause_ms, engine.error = identity, pause_ms, None
            if all(e.acked == identity for e in self.engines.values()):
                job = self.node.jobs.get(identity)
                self.current = identity
                self.current_policy_version = job.policy_version if job else None
            log.info("engine %s serves %s (pause %.1f ms)", engine.engine_id, identity, pause_ms or 0.0)
        await self.poke()


def check_bearer(header: str | None, token: str) -> bool:
    """Constant-time check of ``Authorization: Bearer <token>`` (False when no token is set)."""
    if not token or not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[7:].strip().encode(), token.encode())
