"""bdn.daemon.serve.serving: a request held while this node obtains a chunk is never held for the
chunk's owner itself.

Found with real daemons (3 bdnd, ``bucket_readers = 2``, a reader killed -9 mid-download): the
death switched the owner rule from reader slots to bounded loads over the two survivors, which
moved chunks between them. A survivor whose old owner request was parked at the other (then the
owner) became the owner itself, while the other's acquisition of the same chunk went to park at
it: each held the other's request for the whole ``chunk_wait_s`` (both downloads stood still
for 30 s, then read the chunk). Here with stand-ins for the index, the fetcher and the catalog:
the hold must end at once for an asker that owns the chunk in this node's view, also when the
view changes while the request is held, and must still hold anybody else.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from bdn.daemon.serve.serving import ChunkServing
from bdn.daemon.serve.uploads import Admission, Uploads

ADDRESS = "0" * 32
ME, ASKER, OTHER = "node1", "node0", "node3"
HOLD_S = 3600.0  # the asker's wait: far beyond any deadline below, so a hold cannot pass unseen
DEADLINE_S = 60.0  # generous: an answer that ends the hold comes within a slice of a second


class FakeIndex:
    """The chunk is pending here (a download lists it), not held, until ``register``."""

    def __init__(self) -> None:
        self.job = SimpleNamespace(identity="step000001", state="downloading")
        self.ref = SimpleNamespace(digest="d" * 32)
        self.held: Any = None
        self.given_up = False  # the download here failed: the chunk is neither pending nor held
        self._event = asyncio.Event()

    def lookup(self, address: str) -> Any:
        return self.held

    def pending_for(self, address: str) -> Any:
        return None if self.held is not None or self.given_up else (self.job, "stored", self.ref)

    def fetching(self, address: str) -> bool:
        return self.held is None and not self.given_up

    def elsewhere(self, address: str) -> bool:
        return False

    async def wait(self, address: str, timeout: float) -> Any:
        try:
            await asyncio.wait_for(self._event.wait(), timeout)
        except TimeoutError:
            pass
        return self.held

    def register(self, loc: Any) -> None:
        self.held = loc
        self._event.set()


class FakeFetcher:
    def __init__(self, owner: str) -> None:
        self.current_owner = owner
        self.asked_owner = asyncio.Event()

    def owner(self, job: Any, layer: str, digest: str, nodes: Any = None) -> str:
        self.asked_owner.set()
        return self.current_owner

    async def ensure_chunk(self, job: Any, layer: str, ref: Any) -> None:
        return None


def _serving(owner: str) -> tuple[ChunkServing, FakeIndex, FakeFetcher]:
    index, fetcher = FakeIndex(), FakeFetcher(owner)
    catalog = SimpleNamespace(get=lambda identity: index.job, closing=False, collected=set())
    stats = SimpleNamespace(inflight={"upload": 0})
    serving = ChunkServing(ME, catalog, index, fetcher, None, Uploads(8, 2), stats, None)  # type: ignore[arg-type]
    return serving, index, fetcher


def test_a_request_from_the_chunks_owner_is_not_held() -> None:
    async def main() -> None:
        serving, _index, _fetcher = _serving(owner=ASKER)
        decision, loc = await asyncio.wait_for(serving.request(ADDRESS, HOLD_S, "step000001", asker=ASKER), DEADLINE_S)
        assert decision is Admission.STILL_FETCHING and loc is None

    asyncio.run(main())


def test_a_held_request_ends_when_a_membership_change_makes_its_asker_the_owner() -> None:
    async def main() -> None:
        serving, _index, fetcher = _serving(owner=ME)
        task = asyncio.ensure_future(serving.request(ADDRESS, HOLD_S, "step000001", asker=ASKER))
        await asyncio.wait_for(fetcher.asked_owner.wait(), DEADLINE_S)
        assert not task.done()  # held: this node owns the chunk and reads it
        fetcher.current_owner = ASKER  # a reader died: the chunk moved to the asker
        decision, loc = await asyncio.wait_for(task, DEADLINE_S)
        assert decision is Admission.STILL_FETCHING and loc is None

    asyncio.run(main())


def test_other_askers_are_still_held_until_the_chunk_is_here() -> None:
    async def main() -> None:
        serving, index, fetcher = _serving(owner=ME)
        task = asyncio.ensure_future(serving.request(ADDRESS, HOLD_S, "step000001", asker=OTHER))
        await asyncio.wait_for(fetcher.asked_owner.wait(), DEADLINE_S)
        fetcher.current_owner = ASKER  # the owner is a third node: OTHER waits here as before
        for _ in range(3):
            fetcher.asked_owner.clear()
            await asyncio.wait_for(fetcher.asked_owner.wait(), DEADLINE_S)  # a re-check passed
        assert not task.done()
        loc = SimpleNamespace(length=1)
        index.register(loc)
        decision, got = await asyncio.wait_for(task, DEADLINE_S)
        assert decision is Admission.SEND and got is loc

    asyncio.run(main())


def test_a_held_request_ends_when_this_nodes_download_of_the_snapshot_fails() -> None:
    """This node (the owner) gave the snapshot up (its bucket bytes never matched the manifest):
    a request held for one of its chunks is answered at once, not after the asker's whole wait,
    so the asker goes on to its own fallback read (3 rounds x chunk_wait_s before; found by
    tests/test_adversarial_cut_through.py taking 95 s instead of 4)."""

    async def main() -> None:
        serving, index, fetcher = _serving(owner=ME)
        task = asyncio.ensure_future(serving.request(ADDRESS, HOLD_S, "step000001", asker=OTHER))
        await asyncio.wait_for(fetcher.asked_owner.wait(), DEADLINE_S)
        assert not task.done()
        index.job.state = "failed"
        index.given_up = True
        decision, loc = await asyncio.wait_for(task, DEADLINE_S)
        assert decision is Admission.NOT_HERE and loc is None

    asyncio.run(main())
