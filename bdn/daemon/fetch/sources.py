"""Getting one chunk's bytes from one source into its target file, verified: this node's own
store, a peer, or the bucket. Every received chunk is hashed (xxh3-128) against the manifest on
the disk threads before it is written; a peer that sends bad bytes is penalised.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, Protocol, TypeVar

from bdn.daemon.config import Config
from bdn.daemon.fetch.bucketio import BucketIO
from bdn.daemon.fetch.policy import BUCKET
from bdn.daemon.fetch.ratelimit import RateLimit
from bdn.daemon.fetch.targets import TargetMaps
from bdn.daemon.fetch.watch import Attempt, SourceWatch
from bdn.daemon.fetch.wire_source import WireSource
from bdn.daemon.observe.chunklog import ChunkLog
from bdn.daemon.observe.lograte import RepeatLog
from bdn.daemon.observe.stats import Stats
from bdn.daemon.process.clock import SYSTEM, Clock
from bdn.daemon.serve.transfer_address import peer_of
from bdn.daemon.snapshots.events import FROM_BUCKET, FROM_LOCAL, FROM_PEERS, BytesCounted
from bdn.daemon.snapshots.snapshot import Loc, SnapshotJob
from bdn.daemon.store import diskio
from bdn.daemon.swarm.membership import Member, Membership
from bdn.proto.manifest import ChunkRef
from bdn.transfer import FetchPool
from bdn.transfer.growing import GrowingChunks

log = logging.getLogger("bdn.fetch")
T = TypeVar("T")


class BufferPool:
    """Reusable chunk buffers, so receiving a chunk allocates nothing on the hot path.

    At most ``keep`` free buffers are kept in all, whatever their sizes: chunks are mostly the
    snapshot's chunk size, but the last chunk of every file has a size of its own, and a pool
    that kept ``keep`` buffers per size grew with every delta published (the daemon's heap
    grew by about 1 MB per hot-load). The sizes used least recently go first.
    At most ``max_bytes`` are kept in free buffers as well (``keep`` = 24 of 16 MiB would be
    384 MiB).

    The buffers are anonymous mappings (``mmap.mmap(-1, size)``), not ``bytearray``: a chunk-sized
    ``bytearray`` is a glibc heap block once glibc's dynamic mmap threshold has risen past it
    (mallopt(3)), and a heap that such blocks pass through fragments; a mapping is returned to
    the system whole when it is dropped. :meth:`clear` drops every free buffer: the fetcher calls
    it when no download is running, so that what one download's endgame races needed is not held
    until the next (otherwise the pool fills towards its bound over an hour of hot-loads, one
    buffer at a time; docs/decisions/0025-flat-rss.md).
    """

    #: Bytes kept in free buffers at most (4 chunks of bdn-publish's default 16 MiB).
    MAX_BYTES = 64 << 20

    def __init__(self, keep: int, max_bytes: int = MAX_BYTES) -> None:
        self._free: OrderedDict[int, list[Any]] = OrderedDict()
        self._keep = keep
        self._max_bytes = max_bytes
        self._count = 0
        self._bytes = 0

    @staticmethod
    def new(size: int) -> Any:
        """A new zeroed buffer of ``size`` bytes: an anonymous private mapping (writable, with
        the buffer protocol, ``len`` and slice assignment of a ``bytearray``); an empty
        ``bytearray`` for 0 (a mapping cannot be empty). Private, not ``mmap``'s default
        ``MAP_SHARED``: a shared anonymous mapping is shmem (counted in ``RssShmem``, not in
        ``RssAnon``, where bench/soak judges the heap) and faulted in at twice the CPU (0.9 against
        0.5 ms per MiB, first touch)."""
        return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE) if size > 0 else bytearray(0)

    def get(self, size: int) -> Any:
        """A buffer of ``size`` bytes: a free one of that size, else a new one (:meth:`new`)."""
        lst = self._free.get(size)
        if not lst:
            return self.new(size)
        self._count -= 1
        self._bytes -= size
        buf = lst.pop()
        if not lst:
            del self._free[size]
        return buf

    def put(self, buf: Any) -> None:
        """Give ``buf`` back for reuse (dropped if it alone is over ``max_bytes``)."""
        if self._keep <= 0 or len(buf) > self._max_bytes or len(buf) == 0:
            return
        while self._count >= self._keep or self._bytes + len(buf) > self._max_bytes:
            size, lst = next(iter(self._free.items()))  # the size used least recently
            lst.pop()
            self._count -= 1
            self._bytes -= size
            if not lst:
                del self._free[size]
        lst = self._free.setdefault(len(buf), [])
        self._free.move_to_end(len(buf))
        lst.append(buf)
        self._count += 1
        self._bytes += len(buf)

    def clear(self) -> None:
        """Drop every free buffer (each mapping is unmapped once nothing refers to it)."""
        self._free.clear()
        self._count = self._bytes = 0

    @property
    def free_bytes(self) -> int:
        """Bytes held in free buffers (bounded by ``keep`` buffers and ``max_bytes``)."""
        return sum(size * len(lst) for size, lst in self._free.items())


class WireLink(Protocol):
    """What the fetch path needs of the daemon's transfer wire (``bdn.daemon.serve.wire_peer.WirePeer``):
    the fetch threads, the target files' mappings, the chunks landing here from the bucket
    (served cut-through) and the events that announce them."""

    pool: FetchPool
    maps: TargetMaps
    growing: GrowingChunks

    def started_growing(self, job: SnapshotJob, ref: ChunkRef) -> None:
        """Event: stored chunk ``ref`` of ``job`` started landing here from the bucket."""
        ...

    def stopped_growing(self, job: SnapshotJob, ref: ChunkRef) -> None:
        """Event: that chunk no longer lands here (verified, or the read failed)."""
        ...


class Sources:
    """The three ways to a chunk. Each returns True (written and verified) or False (try the next).

    ``wire``: the daemon's transfer wire, the one path of peers' chunks (``WireSource``), also
    where bucket reads land for cut-through; ``chunk_log``: the per-chunk log (None: off);
    ``on_bad_bytes(url, node, address, snapshot)``: a peer sent bad bytes
    (``bdn.daemon.serve.chunkcheck``: it is told)."""

    def __init__(
        self,
        cfg: Config,
        membership: Membership,
        bucket: BucketIO,
        stats: Stats,
        disk_pool: Executor,
        wire: WireLink,
        clock: Clock = SYSTEM,
        *,
        chunk_log: ChunkLog | None = None,
        on_bad_bytes: Callable[[str, str, str, str], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.membership = membership
        self.bucket = bucket
        self.stats = stats
        self.disk_pool = disk_pool
        self.pool = BufferPool(keep=cfg.max_inflight + cfg.bucket_concurrency)
        self.peer_sem = asyncio.Semaphore(cfg.max_inflight)
        self.download_limit = RateLimit.from_mbit(cfg.peer_download_mbit)
        self.repeat = RepeatLog(log, cfg.log_repeat_s)  # lines that can repeat per chunk
        self.chunk_log = chunk_log
        self.on_bad_bytes = on_bad_bytes
        self.wire = WireSource(
            cfg,
            wire.pool,
            wire.maps,
            membership,
            stats,
            self.peer_sem,
            self.download_limit,
            disk_pool,
            self.pool.get,
            self.pool.put,
            chunk_log,
            on_bad_bytes=on_bad_bytes,
            # an owner's bucket bytes go on to parked askers as they land (bdn.transfer.growing)
            growing=wire.growing if cfg.cut_through else None,
            on_growing=wire.started_growing if cfg.cut_through else None,
            on_grown=wire.stopped_growing if cfg.cut_through else None,
        )
        #: Each peer's rate and refusals (bdn.daemon.fetch.policy.SourceBook) and what they call for.
        self.watch = SourceWatch(cfg, membership, clock)

    def release_buffers(self) -> None:
        """Unmap the free chunk buffers (:class:`BufferPool`) and the transfer client's free
        receive buffers (``bdn.transfer.receive.Rings``); the fetcher calls it when no download
        runs, so that what one download needed at once is not held until the next."""
        self.pool.clear()
        self.wire.pool.client.rings.release()

    def buffers(self) -> dict[str, int]:
        """``{"chunk_buffers", "chunk_buffers_kb", "receive_buffers"}``: free chunk buffers held
        (their KiB) and receive buffers mapped now (lent or free, 1 MiB each)."""
        return {
            "chunk_buffers": self.pool._count,
            "chunk_buffers_kb": self.pool._bytes >> 10,
            "receive_buffers": self.wire.pool.client.rings.mapped(),
        }

    async def _disk(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.disk_pool, fn, *args)

    async def from_local(self, job: SnapshotJob, loc: Loc, ref: ChunkRef, target: Path) -> bool:
        """The same bytes already on this node (e.g. an unchanged config.json), copied and re-verified."""
        if job.foreign is not None:
            return False  # ids are not digests: nothing to re-verify a copy against
        ok = False
        for src in loc.paths():  # the holder may be renamed from staging to ready meanwhile
            try:
                ok = await self._disk(diskio.copy_range, src, loc.offset, target, ref.offset, ref.length, ref.digest)
                break
            except FileNotFoundError:
                continue
        if ok:
            job.apply(BytesCounted(FROM_LOCAL, ref.length))
            self.stats.add("local_bytes_copied", ref.length)
        return ok

    async def from_peer(
        self,
        job: SnapshotJob,
        m: Member,
        address: str,
        ref: ChunkRef,
        target: Path,
        wait: float,
        errors: list[str],
        racing: bool = False,
        invited: bool = False,
    ) -> bool:
        """Ask peer ``m`` (parked up to ``wait`` s). A busy answer counts in ``stats.busy_answers``;
        a failure is appended to ``errors`` and marks the peer failed; bad bytes penalise it.

        Over the transfer wire (``racing``: other holders are asked the same chunk at once); a
        member that advertises no transfer address is no chunk peer (``wired``). A snapshot
        without a manifest goes the same way, its bytes unhashed (its chunk ids are no digests:
        its objects are verified whole, ``bdn.daemon.snapshots.foreign_source``).

        One of the peer's ``max_per_peer`` slots is held until the chunk is verified, so that
        once a peer's bytes turn out bad, at most ``max_per_peer`` of its answers were taken: the
        penalty then cancels those in flight, and the requests queued for the peer go elsewhere.

        Every request is timed and judged (``watch``, bdn.daemon.fetch.watch): an answer whose
        body lags far behind the other sources penalises the peer at once, and so do refusals in
        a row (``invited``: the peer's have-list showed the chunk, so "busy" counts too)."""
        att = self.watch.attempt()
        ok = await self.watch.run(
            job.identity, m, ref, att, self._ask(job, m, address, ref, target, wait, errors, racing, att)
        )
        self.watch.judge(job.identity, m, ref, att, invited)
        return ok

    async def _ask(
        self,
        job: SnapshotJob,
        m: Member,
        address: str,
        ref: ChunkRef,
        target: Path,
        wait: float,
        errors: list[str],
        racing: bool,
        att: Attempt,
    ) -> bool:
        peer = peer_of(m)
        if peer is None:
            # its transfer address went away (a malformed advertisement): not a chunk peer now
            att.outcome = "not_here"
            return False
        return await self.wire.from_peer(job, m, peer, address, ref, target, wait, errors, racing, att)

    async def take(self, m: Member, identity: str, index: int) -> bool:
        """Ask member ``m``, the owner of stored chunk ``index`` of ``identity``, to give its
        bucket read up to this node (``TAKE``/``GIVE`` on the transfer wire). True only when it
        granted it; False when it refused, failed, or advertises no transfer address."""
        peer = peer_of(m)
        if peer is None:
            return False
        loop = asyncio.get_running_loop()
        # the default executor: not behind the fetch pool's threads, which may all be parked
        return await loop.run_in_executor(None, self.wire.pool.client.take, peer, identity, index)

    def count_peer_in(self, job: SnapshotJob, ref: ChunkRef) -> None:
        """Count one chunk received from a peer (the winner of an endgame race)."""
        job.apply(BytesCounted(FROM_PEERS, ref.length))
        self.stats.add("peer_bytes_in", ref.length)
        self.stats.add("peer_wire_bytes_in", ref.length)
        self.stats.add("peer_chunks_in")

    async def race(
        self,
        job: SnapshotJob,
        members: list[Member],
        address: str,
        ref: ChunkRef,
        target: Path,
        errors: list[str],
    ) -> str | None:
        """Request the chunk from each member at once; the url of the first verified copy."""
        tasks = {
            asyncio.ensure_future(
                self.from_peer(job, m, address, ref, target, 0.0, errors, racing=True, invited=True)
            ): m
            for m in members
        }
        winner: str | None = None
        pending = set(tasks)
        try:
            while pending and winner is None:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    if winner is None and not t.cancelled() and t.exception() is None and t.result():
                        winner = tasks[t].url
                        # counted once: two racers can both finish before the loser is cancelled
                        self.count_peer_in(job, ref)
        finally:
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
        return winner

    async def from_bucket(
        self,
        job: SnapshotJob,
        ref: ChunkRef,
        target: Path,
        owner: bool,
        address: str = "",
        claim: Callable[[], bool] | None = None,
    ) -> None:
        """Read the chunk from the bucket (as its ``owner``, or as a counted fallback); 3 tries
        when the bytes do not match. ``address``: the chunk's swarm address (over the transfer
        wire its bytes then go on to parked askers as they land: cut-through). ``claim()``:
        asked when the read takes its bucket slot (transfer wire only); False gives the read up
        (raises Superseded). A snapshot without a manifest's chunk is read at its object's ETag,
        unhashed (``WireSource.from_bucket``). Raises BdnError (missing object, bucket error),
        ProtocolError (never matched) or ObjectChanged (a foreign object was replaced)."""
        await self.wire.from_bucket(self.bucket, job, ref, target, owner, address, claim)  # into the mapping
        role = "owner" if owner else "fallback"
        self.watch.book.delivered(BUCKET, ref.length, None)  # a source delivered (refusals are judged against it)
        if self.chunk_log is not None:
            self.chunk_log.attempt(job, ref, f"bucket-{role}", "ok")
        self.stats.add(f"bucket_bytes_{role}", ref.length)
        self.stats.add(f"bucket_chunks_{role}")
        job.apply(BytesCounted(FROM_BUCKET, ref.length))
        if not owner:
            self.repeat.log(
                logging.INFO,
                ("fallback", job.identity),
                "snapshot %s: chunk %d of %s read from the bucket as a fallback",
                job.identity,
                ref.index,
                ref.path,
            )
