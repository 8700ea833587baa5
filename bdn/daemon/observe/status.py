"""The ``GET /v1/status`` and ``/v1/health`` documents, read from the services (never written)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import bdn
from bdn.daemon.config import Config
from bdn.daemon.fetch.bucketio import BucketIO
from bdn.daemon.observe.stats import Stats
from bdn.daemon.process.clock import Clock
from bdn.daemon.snapshots.catalog import Catalog
from bdn.daemon.swarm.membership import Membership


class StatusView:
    """Builds the status and health documents from the services it is handed (read only)."""

    def __init__(
        self,
        cfg: Config,
        swarm_id: str,
        membership: Membership,
        bucket: BucketIO,
        stats: Stats,
        catalog: Catalog,
        clock: Clock,
        buffers: Callable[[], dict[str, int]] | None = None,
    ) -> None:
        self.cfg = cfg
        self.swarm_id = swarm_id
        self.membership = membership
        self.bucket = bucket
        self.stats = stats
        self.catalog = catalog
        self.clock = clock
        self.buffers = buffers
        self.started = clock.time()

    def health(self) -> dict[str, Any]:
        """``GET /v1/health`` (liveness): status ``ok``, node id and swarm id while the loop answers; readiness is ``/v1/ready``."""
        return {"status": "ok", "node_id": self.cfg.node_id, "swarm_id": self.swarm_id}

    def status(self) -> dict[str, Any]:
        """Node, peers, bucket stats, counters, ``buffers`` (transfer buffers held now, for the
        memory they hold: ``bdn.daemon.fetch.sources.Sources.buffers``), snapshot records."""
        return {
            "node_id": self.cfg.node_id,
            "swarm_id": self.swarm_id,
            "peer_url": self.cfg.advertise_url,
            "version": bdn.__version__,
            "uptime_s": round(self.clock.time() - self.started, 3),
            "peers": self.membership.describe(),
            "bucket": {"url": self.cfg.bucket, **self.bucket.bucket_stats()},
            **self.stats.snapshot(),
            "buffers": self.buffers() if self.buffers is not None else {},
            "snapshots": self.catalog.records(),
        }
