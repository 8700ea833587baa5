"""What the live peers hold of each snapshot: their have-bitfields, asked when a download starts
and then every 0.5 s while it runs (``GET snapshots/{identity}/have``). Untrusted: a bitfield
that does not fit the manifest's chunk counts is dropped."""

from __future__ import annotations

import asyncio
import logging

from bdn.daemon.bitfield import Bitfield
from bdn.daemon.membership import Member, Membership
from bdn.daemon.peer_client import PeerClient, PeerError
from bdn.daemon.snapshot import STORED, SnapshotJob

log = logging.getLogger("bdn.fetch")
POLL_S = 0.5


class Haves:
    """Per snapshot identity, per peer url: ``(stored, result)`` bitfields as last reported."""

    def __init__(self, peers: PeerClient, membership: Membership) -> None:
        self.peers = peers
        self.membership = membership
        self._by_identity: dict[str, dict[str, tuple[Bitfield, Bitfield]]] = {}

    async def refresh(self, job: SnapshotJob, need_result: bool = False) -> bool:
        """Ask every live peer what it holds of ``job``; True if ``need_result`` and one holds
        every rebuilt chunk (result mode only pays off when some peer rebuilt the whole target)."""
        haves = self._by_identity.setdefault(job.identity, {})
        ns, nr = len(job.stored_refs), len(job.result_refs)

        async def one(m: Member) -> None:
            try:
                h = await self.peers.get_have(m.url, job.identity)
            except PeerError:
                return
            if not h:
                return
            try:
                if h.get("ns") != ns or h.get("nr") != nr:
                    return
                haves[m.url] = (Bitfield(ns, h.get("stored")), Bitfield(nr, h.get("result")))
            except (ValueError, TypeError):
                return

        await asyncio.gather(*(one(m) for m in self.membership.live()))
        return any(r.complete for _, r in haves.values()) if need_result else False

    async def poll(self, job: SnapshotJob) -> None:
        """Keep the bitfields for ``job`` fresh until cancelled."""
        while True:
            await asyncio.sleep(POLL_S)
            try:
                await self.refresh(job)
            except Exception:
                log.debug("have refresh failed", exc_info=True)

    def forget(self, identity: str) -> None:
        """Drop what peers reported of ``identity`` (its download ended)."""
        self._by_identity.pop(identity, None)

    @property
    def tracked(self) -> int:
        """How many snapshots' bitfields are held (one per download in progress)."""
        return len(self._by_identity)

    def holding(self, job: SnapshotJob, layer: str, index: int) -> list[str]:
        """Urls of the peers whose last bitfield of ``layer`` shows chunk ``index`` of ``job``."""
        out = []
        for url, h in self._by_identity.get(job.identity, {}).items():
            bits = h[0] if layer == STORED else h[1]
            if bits.n > index and bits[index]:
                out.append(url)
        return out
