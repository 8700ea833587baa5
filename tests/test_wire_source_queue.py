"""No request is queued behind a peer whose transfer streams are all taken
(bdn/daemon/fetch/wire_source.py): it is answered "busy" at once, counted, and nothing is sent,
so the fetcher's next round (woken by a HAVE) can ask another holder (the endgame's racing
requests are exempt; they run through tests/test_wire_daemon.py). The streams are taken by
holding the peer's semaphore, as ``max_per_peer`` requests in flight do; no transfer is
attempted, so no transfer server is needed."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from bdn.daemon.config import Config
from bdn.daemon.fetch.ratelimit import RateLimit
from bdn.daemon.fetch.wire_source import WireSource
from bdn.daemon.observe.stats import Stats
from bdn.daemon.process.clock import FakeClock
from bdn.daemon.swarm.membership import Membership
from bdn.transfer import Peer


@dataclass
class Ref:
    index: int = 0
    path: str = "model.safetensors"
    length: int = 4096
    offset: int = 0
    digest: str = "0" * 32
    file_index: int = 0


@dataclass
class Job:
    identity: str = "step000001"
    foreign: object = None
    bytes_from_peers: int = 0


def test_a_full_peer_is_busy_at_once_and_nothing_is_sent() -> None:
    async def main() -> None:
        cfg = Config()
        ms = Membership("me", "http://10.0.0.1:7080", [], FakeClock())
        for i in range(2, 6):  # four live peers: the rule applies (NO_QUEUE_MIN_PEERS)
            ms.mark_ok(f"http://10.0.0.{i}:7080", f"p{i - 1}")
        m = ms.by_node()["p1"]
        stats = Stats()
        ws = WireSource(
            cfg,
            None,
            None,
            ms,
            stats,
            asyncio.Semaphore(cfg.max_inflight),  # type: ignore[arg-type]
            RateLimit.from_mbit(0),
            None,
            bytearray,
            lambda _b: None,
        )  # type: ignore[arg-type]
        sem = ws._peer_sems[m.url] = asyncio.Semaphore(cfg.max_per_peer)
        for _ in range(cfg.max_per_peer):
            await sem.acquire()  # every stream to p1 carries a request
        errors: list[str] = []
        job = Job()
        ok = await asyncio.wait_for(
            ws.from_peer(job, m, Peer("p1", "10.0.0.2", 7082), "a" * 32, Ref(), None, 30.0, errors),  # type: ignore[arg-type]
            120,
        )
        assert ok is False and errors == [] and stats.busy_answers == 1
        assert m.inflight == 0 and stats.inflight["peer"] == 0 and job.bytes_from_peers == 0
        assert ms.by_node()["p1"].alive  # a busy answer: the peer is not marked failed

    asyncio.run(main())
