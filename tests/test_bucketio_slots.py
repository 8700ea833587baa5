"""BucketIO's ``started`` hook (bdn.daemon.fetch.bucketio): it fires once a chunk read holds its bucket
slot, never while the read queues behind others. The owner announces a chunk for cut-through
from that hook (bdn.daemon.fetch.wire_source), so a chunk whose parts still queue is not
announced: askers would hold their cut-through workers and the owner's slots on it for seconds
before its first byte (docs/decisions/0008-cut-through-no-relays.md: ~10 s when announced at the
acquisition's start)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bdn.bucket.file import FileBucket
from bdn.daemon.fetch.bucketio import BucketIO
from bdn.daemon.fetch.ratelimit import RateLimit
from bdn.daemon.observe.stats import Stats


def test_started_fires_only_once_the_read_holds_a_slot(tmp_path: Path) -> None:
    (tmp_path / "obj").write_bytes(bytes(range(256)) * 16)

    async def main() -> None:
        with ThreadPoolExecutor(2) as pool:
            io = BucketIO(FileBucket(tmp_path.as_uri(), tmp_path), tmp_path.as_uri(), 1, RateLimit(0), pool, Stats())
            started: list[int] = []
            await io.sem.acquire()  # another read holds the only slot
            task = asyncio.create_task(io.read_chunk("obj", 16, 32, bytearray, started=lambda: started.append(1)))
            while not io.sem._waiters:  # noqa: ASYNC110  (the read is queued on the slot now: a state, not a delay)
                await asyncio.sleep(0)
            assert started == []
            io.sem.release()
            buf = await asyncio.wait_for(task, 60)
            assert started == [1]
            assert bytes(buf) == (bytes(range(256)) * 16)[16:48]

    asyncio.run(main())
