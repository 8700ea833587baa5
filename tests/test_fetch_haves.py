"""The fetcher's view of peers' have-bitfields (bdn/daemon/fetch/haves.py) fed by HAVE frames:
holders learned from announcements, a waiting acquisition woken by its chunk's HAVE (an event,
not a sleep), untrusted indices dropping the subscription, the peer set bounding the
subscriptions. The transport is replaced by a recorder of subscribe/unsubscribe calls; the
frames themselves are tested over real sockets in tests/test_transfer_announce.py."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from bdn.daemon.fetch.haves import Haves
from bdn.daemon.process.clock import FakeClock
from bdn.daemon.snapshots.snapshot import STORED
from bdn.daemon.swarm.membership import Membership
from support.api import wait_for_async


@dataclass
class Job:
    identity: str
    stored_refs: tuple = tuple(range(40))
    result_refs: tuple = ()
    foreign: object = None


class Subs:
    def __init__(self) -> None:
        self.open: set = set()
        self.dropped: list = []

    def subscribed(self, peer, identity) -> bool:
        return (peer, identity) in self.open

    def subscribe(self, peer, identity) -> bool:
        self.open.add((peer, identity))
        return True

    def unsubscribe(self, peer, identity) -> None:
        self.open.discard((peer, identity))
        self.dropped.append((peer.node_id, identity))


def _fleet(n: int, k: int = 24) -> tuple[Haves, Subs, Membership]:
    ms = Membership("me", "http://10.0.0.1:7080", [], FakeClock())
    for i in range(n):
        url = f"http://10.0.1.{i}:7080"
        ms.mark_ok(url, f"p{i}")
        ms.members[url].extra["transfer"] = (f"10.0.1.{i}", 7082)
    subs = Subs()
    h = Haves(None, ms, k=k, subscriptions=lambda _on_have, _on_end: subs)  # type: ignore[arg-type]  # no HTTP polls in these tests
    return h, subs, ms


def test_subscriptions_bounded_by_the_peer_set_and_haves_make_holders() -> None:
    h, subs, ms = _fleet(40, k=8)
    job = Job("step000001")
    h.subscribe(job)
    assert len(subs.open) == 8  # k of the 40 live peers, not all of them
    node = next(iter(subs.open))[0].node_id
    url = ms.by_node()[node].url
    assert h.holding(job, STORED, 3) == []
    h._have(node, job.identity, 0, (3, 5))
    assert h.holding(job, STORED, 3) == [url] and h.holding(job, STORED, 5) == [url]
    h._have(node, job.identity, 0, ())  # "that was all": the peer is synced, no longer polled
    assert (job.identity, node) in h._synced
    h.forget(job.identity)
    assert subs.open == set() and h.holding(job, STORED, 3) == []


def test_an_index_outside_the_manifest_drops_the_subscription() -> None:
    h, subs, ms = _fleet(3)
    job = Job("step000001")
    h.subscribe(job)
    node = next(iter(subs.open))[0].node_id
    h._have(node, job.identity, 0, (2, 40))  # 40 chunks: index 40 does not exist
    assert (node, job.identity) in subs.dropped
    assert h.holding(job, STORED, 2) == []  # nothing of that frame was taken


def test_a_waiting_acquisition_is_woken_by_its_chunks_have() -> None:
    async def main() -> None:
        h, subs, ms = _fleet(3)
        h.loop = asyncio.get_running_loop()
        job = Job("step000001")
        h.subscribe(job)
        node = next(iter(subs.open))[0].node_id
        url = ms.by_node()[node].url
        waiter = asyncio.ensure_future(h.wait_holder(job, STORED, 7, 120.0))
        await wait_for_async(
            lambda: (job.identity, STORED, 7) in h._waiters, 120, "the acquisition to wait for chunk 7"
        )
        h.on_have(node, job.identity, 0, (6,))  # another chunk: still waiting
        await wait_for_async(lambda: h.holding(job, STORED, 6) == [url], 120, "that HAVE to be handled")
        assert not h._waiters[(job.identity, STORED, 7)].is_set() and not waiter.done()
        h.on_have(node, job.identity, 0, (7,))  # from a subscription thread, via the loop
        await asyncio.wait_for(waiter, 120)
        assert h._waiters == {}
        # and a wait with nothing announced ends at its timeout
        await h.wait_holder(job, STORED, 9, 0.01)

    asyncio.run(main())


def test_a_growing_announcement_makes_a_cut_through_candidate_until_it_is_held() -> None:
    async def main() -> None:
        h, subs, ms = _fleet(3)
        h.loop = asyncio.get_running_loop()
        job = Job("step000001")
        h.subscribe(job)
        node = next(iter(subs.open))[0].node_id
        url = ms.by_node()[node].url
        waiter = asyncio.ensure_future(h.wait_holder(job, STORED, 7, 120.0))
        await asyncio.sleep(0)
        h.on_have(node, job.identity, 2, (7,))  # reading 7 from the bucket now
        await asyncio.wait_for(waiter, 120)  # woken by the growing announcement
        assert h.growing_at(job, STORED, 7) == [url] and h.growing_at(job, "result", 7) == []
        assert h.holding(job, STORED, 7) == []  # growing is not holding
        h._have(node, job.identity, 0, (7,))  # verified there: a holder, no longer growing
        assert h.holding(job, STORED, 7) == [url] and h.growing_at(job, STORED, 7) == []
        h._have(node, job.identity, 2, (8, 40))  # 40 is outside the manifest: the frame is refused
        assert h.growing_at(job, STORED, 8) == [] and (node, job.identity) in subs.dropped
        h._have(node, job.identity, 2, (9,))
        h.forget(job.identity)
        assert h.growing_at(job, STORED, 9) == []

    asyncio.run(main())


def test_a_growing_hint_that_did_not_deliver_is_forgotten() -> None:
    h, subs, ms = _fleet(3)
    job = Job("step000001")
    h.subscribe(job)
    node = next(iter(subs.open))[0].node_id
    url = ms.by_node()[node].url
    h._have(node, job.identity, 2, (5,))
    assert h.growing_at(job, STORED, 5) == [url]
    h.not_growing(job, 5, url)
    assert h.growing_at(job, STORED, 5) == []
    h.not_growing(job, 5, url)  # twice, or for a chunk never announced: nothing to do
    h.not_growing(job, 6, url)
