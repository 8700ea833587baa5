"""Worker threads that run ``TransferClient.fetch_into`` for asyncio code (and anyone holding
a ``concurrent.futures`` interface), so the daemon's event loop never blocks on chunk bytes.

Why threads: see bdn.transfer.client (every call on the byte path releases the GIL on this
build). ``workers`` bounds how many chunks are received at once; it is the knob that makes
throughput grow with cores.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

from bdn.transfer.client import FetchResult, TransferClient
from bdn.transfer.streams import Peer


class FetchPool:
    """``workers`` threads fetching chunks through ``client``.

    A fetch that has started keeps writing into its ``dest`` until it ends, even if the
    awaiting task is cancelled: keep the mapping open (and do not hand the range to anyone)
    until the future is done. ``TransferClient.close_peer`` ends the in-flight fetches from a
    peer that left (as FAILED).
    """

    def __init__(self, client: TransferClient, workers: int = 2) -> None:
        if workers < 1:
            raise ValueError("workers must be >= 1")
        self.client = client
        self.workers = workers
        self._ex = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="bdn-transfer-fetch")

    def submit(
        self, peer: Peer, address: str, dest: Any, offset: int, length: int, digest: str | None, **kw: Any
    ) -> concurrent.futures.Future[FetchResult]:
        """Queue ``client.fetch_into(peer, address, dest, offset, length, digest, **kw)``."""
        return self._ex.submit(self.client.fetch_into, peer, address, dest, offset, length, digest, **kw)

    async def fetch(
        self, peer: Peer, address: str, dest: Any, offset: int, length: int, digest: str | None, **kw: Any
    ) -> FetchResult:
        """The same, awaited from the event loop (see the class docstring about cancellation)."""
        return await asyncio.wrap_future(self.submit(peer, address, dest, offset, length, digest, **kw))

    def close(self) -> None:
        """Wait for queued fetches, then stop the threads (the client stays open)."""
        self._ex.shutdown(wait=True)
