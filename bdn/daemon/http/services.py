"""What the HTTP adapters may call: the services of one daemon, built by ``bdn.daemon.app``."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from bdn.daemon.config import Config
from bdn.daemon.observe.metrics import Metrics
from bdn.daemon.observe.readiness import Readiness
from bdn.daemon.observe.status import StatusView
from bdn.daemon.replica.hotload import HotLoad
from bdn.daemon.replica.view import ReplicaView
from bdn.daemon.serve.chunkcheck import ChunkCheck
from bdn.daemon.serve.serving import ChunkServing
from bdn.daemon.snapshots.catalog import Catalog
from bdn.daemon.swarm.gossip import Gossip
from bdn.daemon.swarm.nonces import NonceCache
from bdn.proto.keys import SwarmKeys


@dataclass(frozen=True)
class Services:
    """The services the HTTP adapters call (and nothing else of the daemon)."""

    cfg: Config
    keys: SwarmKeys
    nonces: NonceCache
    catalog: Catalog
    replica: ReplicaView
    hotload: HotLoad
    gossip: Gossip
    serving: ChunkServing
    status: StatusView
    metrics: Metrics
    readiness: Readiness
    checks: ChunkCheck


SERVICES = web.AppKey("services", Services)


def services(request: web.Request) -> Services:
    """The :class:`Services` the app registered under ``SERVICES`` (what a handler calls)."""
    return request.app[SERVICES]
