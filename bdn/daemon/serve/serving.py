"""The chunk requests peers make of this node (an ``ASK`` on the transfer wire,
``bdn.daemon.serve.wire_peer``), minus the wire.

``request`` finds the chunk (waiting up to ``wait`` s while this node obtains it: it joins the
snapshot the asker names unless GC already collected it as old, and starts the fetch at once
if it is the chunk's owner, single-flight with its own download), then asks the upload policy
(``bdn.daemon.serve.uploads``) whether to send it now; the wire sends it and reports ``done``.
"""

from __future__ import annotations

import asyncio

from bdn.daemon.fetch.fetcher import Fetcher
from bdn.daemon.fetch.ratelimit import RateLimit
from bdn.daemon.observe.stats import Stats
from bdn.daemon.serve.uploads import Admission, Uploads
from bdn.daemon.snapshots.catalog import Catalog
from bdn.daemon.snapshots.snapshot import Loc
from bdn.daemon.store.index import ChunkIndex
from bdn.daemon.swarm.membership import Membership
from bdn.transfer.growing import Growing, GrowingChunks

#: Seconds between two looks, while a request is held, at who owns its chunk now (a membership
#: change can make the asker itself the owner: then it must not wait on this node).
OWNER_RECHECK_S = 1.0


class ChunkServing:
    """Answers peers' chunk requests: find or wait, admit (upload policy), open, account.
    ``growing``: the chunks landing here from the bucket, served cut-through over the transfer
    wire (None: cut-through off)."""

    def __init__(
        self,
        node_id: str,
        catalog: Catalog,
        index: ChunkIndex,
        fetcher: Fetcher,
        membership: Membership,
        uploads: Uploads,
        stats: Stats,
        limit: RateLimit,
        growing: GrowingChunks | None = None,
    ) -> None:
        self.node_id = node_id
        self.catalog = catalog
        self.index = index
        self.fetcher = fetcher
        self.membership = membership
        self.uploads = uploads
        self.stats = stats
        self.limit = limit
        self.growing = growing

    def _growing(self, address: str, cut_through: bool) -> Growing | None:
        return self.growing.get(address) if cut_through and self.growing is not None else None

    def _asker_owns(self, address: str, asker: str | None) -> bool:
        """Whether ``asker`` is, in this node's view, the owner of the pending chunk at
        ``address`` while nothing of it lands here. Such a request must not be held: this node
        will not read that chunk from the bucket, it asks the owner for it, i.e. the asker, which
        waits on this node meanwhile (after a membership change moved the chunk between two
        survivors each parked at the other until ``chunk_wait_s`` ran out)."""
        if not asker or asker == self.node_id:
            return False
        pend = self.index.pending_for(address)
        if pend is None or (self.growing is not None and self.growing.get(address) is not None):
            return False
        job, layer, ref = pend
        return self.fetcher.owner(job, layer, ref.digest) == asker

    def _failed_here(self, identity: str) -> bool:
        job = self.catalog.get(identity)
        return job is not None and job.state == "failed"

    async def _wait_for(
        self,
        address: str,
        wait: float,
        hint: str | None,
        cut_through: bool,
        asker: str | None = None,
    ) -> Loc | Growing | None:
        loc = self.index.lookup(address) or self._growing(address, cut_through)
        if loc is not None or wait <= 0:
            return loc
        pend = self.index.pending_for(address)
        if hint and pend is None and self.catalog.get(hint) is None and not self.catalog.closing:
            if hint in self.catalog.collected:
                return None  # old here: the asker goes on to its next source at once
            # nothing published under it: fail at once (one listing), not poll the bucket for
            # manifest_wait_s per invented identity (tests/test_adversarial_peer.py)
            self.catalog.prefetch(hint, requested_by="peer", wait_publish=False)
            pend = self.index.pending_for(address)
        if pend is not None:
            job, layer, ref = pend
            if self.fetcher.owner(job, layer, ref.digest) == self.node_id:  # bdn.daemon.fetch.owners
                asyncio.ensure_future(self.fetcher.ensure_chunk(job, layer, ref)).add_done_callback(
                    lambda f: f.cancelled() or f.exception()
                )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while True:
            if self._asker_owns(address, asker):
                return None  # "still fetching": the asker, the owner, goes round and reads it
            if hint and self._failed_here(hint) and self.index.pending_for(address) is None:
                # this node gave the snapshot up (its bucket bytes never matched, say): it will
                # not get the chunk, so the asker goes on now instead of parking out its wait
                # each round (3 x chunk_wait_s before its own fallback read)
                return None
            # woken when the chunk is indexed, or (ChunkIndex.wake) when it starts landing here;
            # in slices, to see a membership change that makes the asker the owner
            found = await self.index.wait(address, min(OWNER_RECHECK_S, deadline - loop.time()))
            if found is not None:
                return found
            g = self._growing(address, cut_through)
            if g is not None or loop.time() >= deadline or self.index.elsewhere(address):
                return g  # (elsewhere: another node reads it for us; the asker takes it there)

    async def request(
        self,
        address: str,
        wait: float,
        hint: str | None,
        cut_through: bool = False,
        asker: str | None = None,
    ) -> tuple[Admission, Loc | Growing | None]:
        """The answer for a peer's request of ``address`` (``wait`` s, snapshot ``hint``;
        ``cut_through``: the asker takes the chunk's bytes while they still land here from the
        bucket, bdn.transfer.growing; ``asker``: its node id, never held while it owns the chunk
        in this node's view). On ``SEND`` an upload slot is booked: call :meth:`done` once the
        upload ends."""
        loc = await self._wait_for(address, wait, hint, cut_through, asker)
        if isinstance(loc, Growing):
            decision = self.uploads.admit_growing(address)
        else:
            decision = self.uploads.admit(address, loc is not None, self.index.fetching(address), wait > 0)
        if decision is Admission.SEND:
            self.stats.inflight["upload"] += 1
        return decision, loc

    def done(self, address: str) -> None:
        """The upload booked by :meth:`request` for ``address`` ended (sent or not)."""
        self.stats.inflight["upload"] -= 1
        self.uploads.done(address)

    def give(self, peer: str, identity: str, index: int) -> bool:
        """Event (a peer's ``TAKE``, on the loop): whether this node gives its bucket read of
        stored chunk ``index`` of ``identity`` up to ``peer`` (``Fetcher.give``)."""
        return self.fetcher.give(peer, identity, index)
