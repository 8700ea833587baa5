"""What the HTTP adapters may call: the services of one daemon, built by ``bdn.daemon.app``."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from bdn.daemon.catalog import Catalog
from bdn.daemon.chunkcheck import ChunkCheck
from bdn.daemon.config import Config
from bdn.daemon.gossip import Gossip
from bdn.daemon.metrics import Metrics
from bdn.daemon.nonces import NonceCache
from bdn.daemon.readiness import Readiness
from bdn.daemon.replica.hotload import HotLoad
from bdn.daemon.replica.view import ReplicaView
from bdn.daemon.serving import ChunkServing
from bdn.daemon.status import StatusView
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
