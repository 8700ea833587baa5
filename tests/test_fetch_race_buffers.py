"""The endgame race's chunk buffers (bdn.daemon.fetch.wire_source) on real sockets and threads.

A racer whose peer is penalised meanwhile (``Membership.penalise`` cancels its request) returns
at once, while its fetch thread may still be waiting for a stream to that peer and then receive
the peer's whole answer. Its buffer must go back to the pool only once that thread ended: given
back earlier, the penalised liar's bytes could land in the buffer of the next fetch, whose honest
peer was then blamed for them, or, landing after that fetch's hash, reach its target as verified
(found looking into bench/results/soak.issue31b.json, where node8 penalised the honest node3 for
bad bytes while the liar was in the swarm).
"""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from bdn.daemon.config import Config
from bdn.daemon.fetch.ratelimit import RateLimit
from bdn.daemon.fetch.sources import BufferPool
from bdn.daemon.fetch.targets import TargetMaps
from bdn.daemon.fetch.watch import Attempt
from bdn.daemon.fetch.wire_source import WireSource
from bdn.daemon.observe.stats import Stats
from bdn.daemon.process.clock import SYSTEM
from bdn.daemon.snapshots.snapshot import SnapshotJob
from bdn.daemon.store.store import Store
from bdn.daemon.swarm.membership import Membership
from bdn.proto.chunks import digest
from bdn.proto.manifest import ChunkRef
from bdn.transfer import GRANTED, FetchPool, Peer, TransferClient, TransferServer
from support.api import wait_for, wait_for_async
from support.transfer import KEYS

CHUNK = 1 << 20
LIAR_URL = "http://127.0.0.1:9"


class SeenFetchPool(FetchPool):
    """A real FetchPool that keeps the futures it hands out (so the test can wait on their state)."""

    def __init__(self, client: TransferClient, workers: int) -> None:
        super().__init__(client, workers)
        self.futures: list[Future[Any]] = []

    def submit(self, *a: Any, **kw: Any) -> Future[Any]:
        f = super().submit(*a, **kw)
        self.futures.append(f)
        return f


async def test_a_penalised_racers_buffer_goes_back_only_once_its_thread_ended(shm):
    junk = shm / "junk"
    junk.write_bytes(os.urandom(CHUNK))  # the liar's answer to every ask: right length, wrong bytes
    good = os.urandom(CHUNK)
    d = digest(good)
    address = KEYS.address(d)
    asks: list[object] = []
    first_held, release = threading.Event(), threading.Event()

    def admit(peer: str, ask: object) -> object:
        asks.append(ask)
        if len(asks) == 1:  # the first ask holds the asker's only stream to the liar
            first_held.set()
            release.wait(300)
        return GRANTED

    srv = TransferServer(KEYS, "liar", lambda _a: (str(junk), 0, CHUNK), admit=admit)
    host, port = srv.start()
    peer = Peer("liar", host, port)
    client = TransferClient(KEYS, "asker", streams_per_peer=1, io_timeout_s=60)
    pool = SeenFetchPool(client, workers=2)
    disk = ThreadPoolExecutor(2)
    freed: list[tuple[Any, bytes]] = []  # (buffer, its bytes when it went back to the pool)
    try:
        # another request of this node to the liar holds the stream, its answer pending
        held = pool.submit(peer, address, bytearray(CHUNK), 0, CHUNK, d)
        wait_for(first_held.is_set, 120, "the first ask held at the liar")

        membership = Membership("asker", "http://127.0.0.1:8", [])
        membership.mark_ok(LIAR_URL, "liar")
        m = membership.members[LIAR_URL]
        m.extra["transfer"] = (host, port)
        ws = WireSource(
            Config(),
            pool,
            TargetMaps(disk),
            membership,
            Stats(),
            asyncio.Semaphore(8),
            RateLimit(1e12),
            disk,
            BufferPool.new,
            lambda buf: freed.append((buf, bytes(buf))),
        )
        job = SnapshotJob("step000001", Store(shm / "store", "swarm"))
        ref = ChunkRef(0, "model.safetensors", 0, 0, CHUNK, d)
        errors: list[str] = []
        race = asyncio.ensure_future(
            ws.from_peer(job, m, peer, address, ref, shm / "target", 0.0, errors, racing=True, att=Attempt(SYSTEM))
        )
        # the racer's thread runs, waiting for the stream the first request holds
        racer = (await wait_for_async(lambda: pool.futures[1:], 120, "the racer's fetch submitted"))[0]
        await wait_for_async(racer.running, 120, "the racer's thread running")
        assert not race.done()

        # the liar sent bad bytes on another chunk: penalised, its requests in flight cancelled
        membership.penalise(LIAR_URL, 30.0)
        assert await race is False
        # its streams were closed (close_peer): the held request fails, the racer's thread gets
        # a stream and receives the liar's whole answer into its buffer
        await wait_for_async(racer.done, 120, "the racer's thread ended")
        assert held.result().outcome.value == "failed"
        assert racer.result().outcome.value == "corrupt"
        await wait_for_async(lambda: freed, 120, "the racer's buffer back in the pool")
        assert len(freed) == 1
        buf, when_freed = freed[0]
        assert bytes(buf) == when_freed, "the racer's thread wrote into its buffer after it went back to the pool"
    finally:
        release.set()
        pool.close()
        client.close()
        srv.close()
        disk.shutdown()
