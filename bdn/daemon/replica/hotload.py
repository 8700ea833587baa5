"""The fleet hot-load (DESIGN.md, "Hot-load"; the hosted hot-load APIs' request and answers).

The daemon that accepts ``POST /hot_load/v1/models/hot_load`` checks the request against the
bucket, makes it its target and pushes it to ``hotload_fanout`` random live members (signed
``POST /bdn/v1/{swarm}/hot_load``); a member that adopts it pushes it on to ``hotload_fanout``
others once (infect-and-forward), so it reaches N members in about ``log_fanout(N)`` hops.
Every SWIM message also carries the sender's target (anti-entropy), so a daemon that missed the
pushes, started late or restarted adopts the fleet's target within O(log N) periods and fetches
its rebuilt chunks from peers instead of replaying the delta chain from the bucket. The order
is the trainer's (``bdn.daemon.replica.target``). ``fleet()`` is the GET, answered from the
aggregators (``bdn.daemon.replica.fleet_status``).

Errors are domain errors (``bdn.daemon.errors``): Invalid (malformed request), Unsupported
(compression/checksum format), NotFound (nothing under the identity), Conflict (base or served
snapshot does not match), Upstream (the bucket failed or holds an invalid manifest).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import secrets
from typing import Any

from bdn.bucket import BucketError, ObjectNotFound
from bdn.daemon.config import Config
from bdn.daemon.errors import Conflict, Invalid, NotFound, Unsupported, Upstream
from bdn.daemon.fetch.bucketio import BucketIO
from bdn.daemon.observe.packing import packb
from bdn.daemon.observe.stats import Stats
from bdn.daemon.process.clock import Clock
from bdn.daemon.replica import contract
from bdn.daemon.replica.fleet_status import FleetStatus
from bdn.daemon.replica.options import OPTION_FIELDS, parse_options
from bdn.daemon.replica.ports import Snapshots
from bdn.daemon.replica.target import MAX_GEN, Target, published_at
from bdn.daemon.replica.view import ReplicaView
from bdn.daemon.snapshots.foreign_source import Hint, Hints
from bdn.daemon.swarm.membership import Membership
from bdn.daemon.swarm.peer_client import PeerClient
from bdn.proto.arc import COMPRESSION_FORMATS
from bdn.proto.errors import IdentityError, ManifestError
from bdn.proto.identity import validate_identity
from bdn.proto.manifest import MANIFEST_NAME, Manifest

log = logging.getLogger("bdn.hotload")
META_FIELDS = ("previous_snapshot_identity", "compression_format", "checksum_format")


def push_fanout(configured: int, members: int) -> int:
    """How many members one adopting daemon pushes a new target to: ``configured``, or for 0
    ceil(ln members) + 3. Infect-and-forward-once reaches all but about e**-f of the members
    with fan-out f (Demers et al., epidemic algorithms); a fixed 3 left ~5 % of a large fleet to
    SWIM's piggyback, one period later (bench/fleetsim), ln N + 3 leaves about e**-3 / N of it.
    """
    if configured > 0:
        return configured
    return math.ceil(math.log(max(members, 1))) + 3


def parse_request(body: bytes) -> tuple[str, dict[str, Any] | None]:
    """Validate a hot-load body; ``(identity, metadata or None)``. Raises Invalid or Unsupported."""
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise Invalid(f"request body is not JSON: {e}") from None
    except RecursionError:
        raise Invalid("request body is nested too deeply") from None
    if not isinstance(obj, dict):
        raise Invalid("request body must be a JSON object")
    unknown = set(obj) - {"identity", "incremental_snapshot_metadata", *OPTION_FIELDS}
    if unknown:
        raise Invalid(f"unknown request field(s): {', '.join(sorted(unknown))}")
    try:
        ident = validate_identity(obj.get("identity"))
    except IdentityError as e:
        raise Invalid(f"identity: {e}") from None
    meta = obj.get("incremental_snapshot_metadata")
    if meta is None:
        return ident, None
    if not isinstance(meta, dict):
        raise Invalid("incremental_snapshot_metadata must be an object")
    unknown = set(meta) - set(META_FIELDS)
    if unknown:
        raise Invalid(f"unknown incremental_snapshot_metadata field(s): {', '.join(sorted(unknown))}")
    for k in META_FIELDS:
        if k in meta and not isinstance(meta[k], str):
            raise Invalid(f"incremental_snapshot_metadata.{k} must be a string")
    if "previous_snapshot_identity" in meta:
        try:
            validate_identity(meta["previous_snapshot_identity"])
        except IdentityError as e:
            raise Invalid(f"previous_snapshot_identity: {e}") from None
    cf = meta.get("compression_format")
    if cf is not None and cf.lower() not in COMPRESSION_FORMATS:
        raise Unsupported(f"unsupported compression_format {cf!r}: bdn supports {', '.join(COMPRESSION_FORMATS)}")
    contract.checksum_format(meta.get("checksum_format"))  # alder32 or adler32, else Unsupported
    return ident, meta


#: Members a daemon asks for their hot-load target before it accepts a POST (``catch_up``).
PULL_PEERS = 3
#: Seconds it waits for each of them.
PULL_TIMEOUT_S = 2.0


class HotLoad:
    """Accepts a trainer's hot-load (checked against the bucket), fans it out, answers the fleet GET."""

    def __init__(
        self,
        node_id: str,
        view: ReplicaView,
        snapshots: Snapshots,
        bucket: BucketIO,
        peers: PeerClient,
        membership: Membership,
        stats: Stats,
        clock: Clock,
        cfg: Config | None = None,
        hints: Hints | None = None,
    ) -> None:
        self.node_id = node_id
        self.view = view
        self.snapshots = snapshots
        self.bucket = bucket
        self.peers = peers
        self.membership = membership
        self.stats = stats
        self.clock = clock
        self.cfg = cfg or Config(bucket=bucket.url)
        self.hints = hints if hints is not None else Hints()
        self.last: tuple[tuple[Any, ...], dict[str, Any]] | None = None  # the last accepted request and answer
        #: The fleet's replica rows, reported and aggregated (its ``loop`` runs as a daemon task).
        self.status = FleetStatus(self.cfg, view, membership, peers, stats, clock)
        self.rng = random.Random()

    async def _manifest(self, identity: str) -> Manifest | None:
        """The manifest from the bucket; None if the snapshot's files are there without it."""
        try:
            data = await self.bucket.read(f"{identity}/{MANIFEST_NAME}")
        except ObjectNotFound:
            try:
                objs = await self.bucket.list(f"{identity}/")
            except BucketError as e:
                raise Upstream(f"cannot list {identity}/ in the bucket: {e}") from None
            if not objs:
                raise NotFound(f"snapshot {identity!r} is not in the bucket {self.bucket.url}") from None
            return None
        except BucketError as e:
            raise Upstream(f"cannot read the manifest of {identity!r}: {e}") from None
        self.stats.add("bucket_manifest_bytes", len(data))
        try:
            # a worker thread: a 10^6-chunk manifest takes seconds to validate
            return await asyncio.to_thread(Manifest.from_json, data, expect_identity=identity)
        except ManifestError as e:
            raise Upstream(f"the bucket holds an invalid manifest for {identity!r}: {e}") from None

    async def _check_delta(self, ident: str, m: Manifest, meta: dict[str, Any] | None) -> None:
        prev = meta.get("previous_snapshot_identity") if meta else None
        if prev is not None and prev != m.base_identity:
            raise Conflict(
                f"previous_snapshot_identity {prev!r} is not the base of {ident!r} "
                f"(its base is {m.base_identity!r}); to load it over its chain of deltas, leave"
                " incremental_snapshot_metadata out"
            )
        cf = meta.get("compression_format") if meta else None
        if cf is not None and cf.lower() != m.compression_format:
            raise Conflict(f"compression_format {cf!r} does not match the snapshot's {m.compression_format!r}")
        base = m.base_identity
        assert base is not None
        bj = self.snapshots.get(base)
        if bj is None or bj.state == "failed":
            try:
                await self.bucket.stat(f"{base}/{MANIFEST_NAME}")
            except ObjectNotFound:
                raise Conflict(f"unknown base {base!r}: it is not published in the bucket") from None
            except BucketError as e:
                raise Upstream(f"cannot check base {base!r}: {e}") from None

    async def _base_of(self, identity: str, known: dict[str, str | None]) -> str | None:
        """A snapshot's base for the chain cap: this node's record, else the bucket's manifest,
        else the hot-load hint of a snapshot without one (None: an anchor, or not known)."""
        if identity in known:
            return known[identity]
        job = self.snapshots.get(identity)
        if job is not None and job.kind is not None and job.state != "failed":
            base = job.base_identity if job.kind == "delta" else None
        else:
            try:
                m = await self._manifest(identity)
            except (NotFound, Upstream):
                m = None
            base = (
                (m.base_identity if m.is_delta else None) if m is not None else self.hints.get(identity).base_identity
            )
        known[identity] = base
        return base

    async def _chain(self, ident: str, base: str | None) -> dict[str, str | None]:
        """``{identity: base}`` from ``ident`` down to its anchor, at most max_delta_chain + 1 links."""
        known: dict[str, str | None] = {ident: base}
        cur = base
        for _ in range(self.cfg.max_delta_chain + 1):
            if cur is None or cur in known:
                break
            cur = await self._base_of(cur, known)
        return known

    async def accept(self, body: bytes) -> dict[str, Any]:
        """A trainer's POST: validate, apply here, fan out; the 200 answer's body.

        Concurrency (README "Hot-load API"): a POST identical to the one that set the current
        target (same identity and metadata, :func:`contract.request_key`) is answered with that
        request's answer and id, and retries a failed load; any other accepted POST becomes the
        target at once, and the load it supersedes is cancelled unless the new target's chain
        needs it. Raises Invalid, Unsupported, NotFound, Conflict (base, served snapshot,
        max_delta_chain), Upstream.
        """
        ident, meta = parse_request(body)
        options = parse_options(json.loads(body))  # the engine options at the top level
        key = contract.request_key(ident, meta)
        await self.catch_up()
        t = self.view.target
        if (
            self.last is not None
            and t is not None
            and self.last[0] == key
            and t.request_id == self.last[1]["request_id"]
        ):
            return await self._again(t, dict(self.last[1]))
        m = await self._manifest(ident)
        prev = meta.get("previous_snapshot_identity") if meta else None
        base: str | None = None
        if m is not None:
            if meta is not None and not m.is_delta:
                raise Invalid(f"snapshot {ident!r} is a full snapshot; drop incremental_snapshot_metadata")
            if m.is_delta:
                await self._check_delta(ident, m, meta)
                base = m.base_identity
        else:
            base = prev or self.cfg.foreign_base or None
            self.hints.set(ident, Hint(base, meta.get("compression_format") if meta else None))
        if t is not None and t.identity == ident and t.base == base and t.seq > 0:
            # the fleet's target already (accepted by another daemon, or before a restart)
            return await self._again(
                t,
                {
                    "accepted": True,
                    "identity": ident,
                    "policy_version": m.policy_version if m is not None else None,
                    "request_id": t.request_id,
                    "replicas": len(self.membership.live()) + 1,
                    "manifest_written": m is not None,
                },
            )
        contract.check_previous(prev, self.view.current, t.identity if t else None)
        contract.chain_length(ident, (await self._chain(ident, base)).get, self.cfg.max_delta_chain)
        target = Target(
            ident,
            self.clock.time_ns(),
            self.node_id,
            secrets.token_hex(8),
            base,
            options,
            gen=min(t.gen + 1, MAX_GEN) if t is not None else 1,  # the wire's bound: past it no peer takes it
            policy_version=m.policy_version if m is not None else -1,
            published_at=published_at(m.created_at) if m is not None else 0.0,
        )
        await self.view.adopt(target, source="request")
        await self.fan_out(target)
        reached = len(self.membership.live())
        answer = {
            "accepted": True,
            "identity": ident,
            "policy_version": m.policy_version if m is not None else None,
            "request_id": target.request_id,
            "replicas": reached + 1,
            "manifest_written": m is not None,
            **options.wire(),
        }
        self.last = (key, answer)
        return dict(answer)

    async def catch_up(self) -> int:
        """Before a POST's target is made (its ``gen`` is one more than the target held here):
        ask up to ``PULL_PEERS`` members for their current target, live ones first, then other
        known ones (static seeds, members not yet admitted), and adopt any later one as a push
        would. A daemon restarted seconds before may not have heard the fleet's target by
        gossip yet, and a ``gen`` made from its stale one would lose to the fleet's older target:
        the POST would answer 200 and the fleet stay where it was
        (docs/decisions/0014-hotload-target-order.md). A member
        that does not answer within ``PULL_TIMEOUT_S`` is skipped; returns how many answered."""
        live = self.membership.live()
        ids = {m.node_id for m in live}
        others = [
            m for m in self.membership.members.values() if m.node_id not in ids and m.url != self.membership.self_url
        ]
        picked = self.rng.sample(live, min(PULL_PEERS, len(live)))
        picked += self.rng.sample(others, min(PULL_PEERS - len(picked), len(others)))

        async def one(url: str) -> bool:
            self.stats.control_request("sent", "hot_load_pull")
            try:
                status, obj = await self.peers.get_json(url, "hot_load", timeout=PULL_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - unreachable, slow or garbled: gossip converges anyway
                return False
            if status != 200 or not isinstance(obj, dict):
                return False
            if obj.get("target") is not None:
                t = Target.from_wire(obj["target"], self.clock.time_ns())
                if t is not None:
                    await self.view.adopt(t, source=f"peer {url} (asked before a hot-load)")
            return True

        return sum(await asyncio.gather(*(one(m.url) for m in picked)))

    def current_wire(self) -> dict[str, Any]:
        """What a member's ``catch_up`` gets from here: ``{"target": the target's wire map or None}``."""
        t = self.view.target
        return {"target": None if t is None else t.wire()}

    async def _again(self, t: Target, answer: dict[str, Any]) -> dict[str, Any]:
        """The same hot-load posted again: its first answer (same request id); a failed load of it
        starts again here and on the peers it is fanned out to once more."""
        log.info("hot-load %s: the same request again (%s)", t.identity, t.request_id)
        await self.view.adopt(t, source="request again", retry_failed=True)
        await self.fan_out(t)
        return answer

    async def fan_out(self, target: Target, exclude: str = "") -> int:
        """Push ``target`` to ``hotload_fanout`` random live members (not ``exclude``, who sent
        it to us); how many took it. Those that adopt it push it on: O(log N) hops in all."""
        payload = packb(target.wire())
        live = [m for m in self.membership.live() if m.node_id != exclude]
        picked = self.rng.sample(live, min(push_fanout(self.cfg.hotload_fanout, len(live) + 1), len(live)))

        async def one(url: str) -> bool:
            self.stats.control_request("sent", "hot_load")
            try:
                status, _ = await self.peers.post_json(url, "hot_load", payload, timeout=10.0)
            except Exception as e:  # a peer that misses it catches up through SWIM's piggyback
                log.warning("hot-load %s: peer %s unreachable: %s", target.identity, url, e)
                return False
            return status == 200

        results = await asyncio.gather(*(one(m.url) for m in picked))
        return sum(results)

    async def from_peer(self, obj: Any, peer: str) -> bool:
        """A target pushed by a member (untrusted map); pushed on once if it is new here.
        Raises Invalid: malformed, or its policy version or publish time contradicts the
        snapshot's manifest known here."""
        self.stats.control_request("received", "hot_load")
        t = Target.from_wire(obj, self.clock.time_ns())
        if t is None:
            raise Invalid("hot-load target is malformed")
        why = self.view.claims.contradiction(t)
        if why is not None:  # a member's claim the manifest read here refutes (docs/TRUST.md)
            raise Invalid(why)
        if await self.view.adopt(t, source=f"peer {peer}", retry_failed=True):
            asyncio.get_running_loop().create_task(self.fan_out(t, exclude=peer))
        return True

    async def fleet(self, page_size: object = None, page_token: object = None) -> dict[str, Any]:
        """One page of the fleet's replicas (``bdn.daemon.replica.fleet_status``). A daemon with
        no target yet first asks members for theirs (:meth:`catch_up`): a GET on a daemon the
        hot-load's push had not reached answered a null identity. Raises Invalid."""
        if self.view.target is None:
            await self.catch_up()
        return await self.status.fleet(page_size, page_token)
