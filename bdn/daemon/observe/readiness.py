"""Readiness, apart from liveness.

``GET /v1/health`` is liveness: the event loop answers. ``GET /v1/ready`` is readiness, true when

1. both ports listen (the peer port and the local API),
2. the bucket is reachable: a cheap probe (``BucketIO.probe``: the root directory of a
   ``file://`` bucket exists; an ``s3://``/``gs://`` bucket answers a listing of
   ``STARTUP_SNAPSHOT``, present or not), renewed in the background every ``PROBE_TTL_S``
   seconds (only the first check waits for one, at most ``PROBE_TIMEOUT_S``),
3. startup is over (membership settled) and the replica's target (``STARTUP_SNAPSHOT``'s
   snapshot, or the fleet's hot-load target) is loaded or loading, not failed,
4. nothing is misconfigured (``bdn.daemon.observe.problems``): the bucket URL holds
   some object (an empty one is a mistyped prefix, or nothing published yet), no peer answers
   with this daemon's node id, and not every peer refuses its signature (401: another partition
   secret). Some peers refusing while others answer is a warning, not a reason.

The answer is ``{"ready": bool, "reasons": [str, ...], "warnings": [str, ...], "waiting_for":
str | None, "node_id"}``: each reason is one line saying what is missing or wrong (a
misconfiguration starts with ``misconfigured:``); ``waiting_for`` says in one line what the
daemon waits for now, ready or not (settling, the target's state, a hot-load), None when it
serves its target. The last answer is kept (``last``) for the metrics. Time comes from an
injected clock.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

from bdn.daemon.observe.problems import Problems
from bdn.daemon.process.clock import Clock
from bdn.daemon.replica.ports import SnapshotRecord
from bdn.daemon.replica.target import Target

PROBE_TTL_S = 10.0
PROBE_TIMEOUT_S = 1.5


class Probe(Protocol):
    """The bucket as readiness sees it (``bdn.daemon.fetch.bucketio.BucketIO``)."""

    async def probe(self) -> str | None:
        """None when the bucket is reachable, else the one-line reason; never raises for an
        unreachable bucket (a raise is reported as ``probe failed: <type>: <message>``)."""
        ...

    async def empty(self) -> bool:
        """Whether the (reachable) bucket holds no object at all under its URL."""
        ...


class Records(Protocol):
    """The snapshots this node knows (``bdn.daemon.snapshots.catalog.Catalog``)."""

    def get(self, identity: str) -> SnapshotRecord | None:
        """The record of ``identity`` (with ``state``, one of ``bdn.proto.states``, and ``reason``,
        one line, for a failed one), or None when the node has never seen it."""
        ...


class TargetView(Protocol):
    """The replica's view (``bdn.daemon.replica.view.ReplicaView``): ``target`` is the snapshot
    this node should serve, or None when there is none."""

    target: Target | None


class Readiness:
    """The ``/v1/ready`` document; the events ``listening_now`` and ``startup_done`` tell it how
    far startup is.
    ``live_peers()`` counts the members this daemon talks to; ``bucket_url`` names the bucket."""

    def __init__(
        self,
        node_id: str,
        bucket: Probe,
        catalog: Records,
        replica: TargetView,
        clock: Clock,
        problems: Problems | None = None,
        live_peers: Callable[[], int] = lambda: 0,
        bucket_url: str = "the bucket",
    ) -> None:
        self.node_id = node_id
        self.bucket = bucket
        self.catalog = catalog
        self.replica = replica
        self.clock = clock
        self.problems = problems or Problems(clock)
        self.live_peers = live_peers
        self.bucket_url = bucket_url
        self.listening = False
        self.started = False
        self.last: dict[str, Any] = {
            "ready": False,
            "reasons": ["not checked yet"],
            "warnings": [],
            "waiting_for": None,
            "node_id": node_id,
        }
        self._probed_at: float | None = None
        self._probe_error: str | None = None
        self._probing: asyncio.Future[None] | None = None

    def listening_now(self) -> None:
        """Event: the daemon listens on its ports."""
        self.listening = True

    def startup_done(self) -> None:
        """Event: startup ended (``STARTUP_SNAPSHOT`` and the interrupted downloads are started)."""
        self.started = True

    async def bucket_error(self) -> str | None:
        """Why the bucket is not reachable (None: it is). A probe older than ``PROBE_TTL_S`` is
        renewed in the background while its last answer is used; only the very first check
        waits for one, at most ``PROBE_TIMEOUT_S``."""
        now = self.clock.monotonic()
        stale = self._probed_at is None or now - self._probed_at >= PROBE_TTL_S
        if stale and (self._probing is None or self._probing.done()):
            self._probing = asyncio.ensure_future(self._probe())
        if self._probed_at is not None or self._probing is None:
            return self._probe_error
        try:
            await asyncio.wait_for(asyncio.shield(self._probing), PROBE_TIMEOUT_S)
        except TimeoutError:
            return f"the bucket did not answer a probe within {PROBE_TIMEOUT_S:g} s"
        return self._probe_error

    async def _probe(self) -> None:
        empty = False
        try:
            err = await self.bucket.probe()
            if err is None:
                empty = await self.bucket.empty()
        except Exception as e:  # noqa: BLE001 - a probe that breaks says so, it does not break readiness
            err = f"probe failed: {type(e).__name__}: {e}"
        if empty:
            self.problems.report(
                "bucket_empty",
                self.bucket_url,
                (
                    f"the bucket {self.bucket_url} holds no object: a mistyped or empty prefix, or nothing "
                    "published yet (bdn-publish writes STARTUP_SNAPSHOT and the snapshots under it)"
                ),
            )
        elif err is None:
            self.problems.clear("bucket_empty", self.bucket_url)
        self._probed_at, self._probe_error = self.clock.monotonic(), err

    def snapshot_reason(self) -> str | None:
        """Why the target snapshot is neither loaded nor loading (None: it is, or there is none)."""
        t = self.replica.target
        if t is None:
            return None
        job = self.catalog.get(t.identity)
        if job is None:
            return f"target snapshot {t.identity} is not loading"
        if job.state == "failed":
            return f"target snapshot {t.identity} failed: {job.reason}"
        return None

    def waiting_for(self) -> str | None:
        """What the daemon waits for now, in one line (None: it has its target)."""
        if not self.started:
            return "membership to settle, then the startup snapshot"
        t = self.replica.target
        if t is None:
            return "a hot-load (no target: no STARTUP_SNAPSHOT loaded, no hot-load received)"
        job = self.catalog.get(t.identity)
        if job is None:
            return f"target snapshot {t.identity} to start loading"
        if job.state in ("ready", "failed"):
            return None
        return f"target snapshot {t.identity}: {job.state}" + (f" ({job.reason})" if job.reason else "")

    def misconfigured(self) -> tuple[list[str], list[str]]:
        """``(reasons, warnings)`` from the problems noticed: an empty bucket (this daemon's own
        probe) is a reason; what peers answered (a 401, this daemon's node id) is a warning each,
        never a reason: those answers are not authenticated (a 401 comes from a peer without the
        secret by definition), so anything at a seed address could otherwise keep an honest node
        not ready for ever (docs/TRUST.md)."""
        reasons, warnings = [], []
        for p in self.problems.active():
            if p.kind in ("partition_secret", "duplicate_node_id"):
                warnings.append(f"misconfigured: {p.message}")
            else:
                reasons.append(f"misconfigured: {p.message}")
        return reasons, warnings

    async def check(self) -> dict[str, Any]:
        """``{"ready", "reasons", "warnings", "waiting_for", "node_id"}`` (see the module docstring)."""
        reasons = []
        if not self.listening:
            reasons.append("not listening yet")
        err = await self.bucket_error()
        if err:
            reasons.append(f"bucket unreachable: {err}")
        if not self.started:
            reasons.append("starting: settling membership before loading the startup snapshot")
        else:
            why = self.snapshot_reason()
            if why:
                reasons.append(why)
        wrong, warnings = self.misconfigured()
        reasons += wrong
        self.last = {
            "ready": not reasons,
            "reasons": reasons,
            "warnings": warnings,
            "waiting_for": self.waiting_for(),
            "node_id": self.node_id,
        }
        return dict(self.last)

    def summary(self, doc: dict[str, Any]) -> str:
        """One line for systemd's STATUS=: ``ready`` or ``not ready: <reasons>``."""
        return "ready" if doc["ready"] else "not ready: " + "; ".join(doc["reasons"])

    async def watch(
        self, notify: Callable[[str], None], last: str | None = None, interval_s: float = PROBE_TTL_S
    ) -> None:
        """Tell systemd (``notify("STATUS=...")``) the readiness summary whenever it changes
        from ``last`` (the line already sent)."""
        while True:
            await asyncio.sleep(interval_s)
            line = self.summary(await self.check())
            if line != last:
                notify(f"STATUS={line}")
                last = line
