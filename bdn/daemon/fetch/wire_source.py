"""Chunks from peers over the transfer wire (bdn.transfer), and from the bucket, received
straight into the target file's mapping (``bdn.daemon.fetch.targets``) at the chunk's offset
and hashed in place; the fetcher marks a chunk verified (and indexes it) only after ``OK``.

How a ``FetchResult`` maps onto the peer path of ``Sources.from_peer``: ``BUSY`` -> a busy
answer (the plan's next round), ``NOT_HERE`` -> the next source, ``CORRUPT`` -> the peer is
penalised for ``penalty_s``, ``FAILED`` -> the peer is marked failed (two in a row: it leaves
HRW). On anything but ``OK`` the range holds unspecified bytes that are never served: only
verified chunks are indexed, and a resumed download re-hashes every chunk it counts.

One writer per range: an acquisition asks one source at a time, so a fetch owns its range
until its thread returns; a fetch whose task is cancelled waits for its thread first (a member
that left has its streams closed, so that is quick). The endgame race asks several holders of
one chunk at once: each receives into its own buffer and only the first verified copy is
written into the mapping; a racer's buffer goes back to the pool only once its thread ended
(a racer whose peer was penalised returns before that: ``_free_when_done``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

import xxhash

from bdn.bucket import BucketError, BucketUnavailable, ObjectChanged, ObjectNotFound
from bdn.daemon.config import Config
from bdn.daemon.errors import Superseded
from bdn.daemon.fetch import retry_policy
from bdn.daemon.fetch.bucketio import BucketIO
from bdn.daemon.fetch.policy import bucket_parts
from bdn.daemon.fetch.ratelimit import RateLimit
from bdn.daemon.fetch.targets import TargetMaps
from bdn.daemon.fetch.watch import Attempt
from bdn.daemon.observe.chunklog import ChunkLog
from bdn.daemon.observe.stats import Stats
from bdn.daemon.process.clock import SYSTEM
from bdn.daemon.snapshots.events import FROM_PEERS, BytesCounted, ForeignReceived
from bdn.daemon.snapshots.snapshot import SnapshotJob
from bdn.daemon.swarm.membership import Member, Membership
from bdn.proto import wire
from bdn.proto.errors import BdnError, ProtocolError
from bdn.proto.manifest import ChunkRef
from bdn.transfer import Abort, FetchPool, FetchResult, Outcome, Peer
from bdn.transfer.growing import Growing, GrowingChunks

log = logging.getLogger("bdn.fetch.wire")

#: Seconds a request waits for a free stream to its peer before it counts as a busy answer and
#: the fetcher plans the chunk again (docs/decisions/0017-no-queue-behind-a-full-peer.md).
QUEUE_S = 1.0
#: ... when at least this many peers are live: with fewer there is hardly another holder to plan
#: for, and a request that leaves the queue loses its place in the owner's order (N = 2 went
#: from 46 to 51 s); with more, the late owner's tail is what it removes (N = 8).
NO_QUEUE_MIN_PEERS = 4


def _hash_ok(view: memoryview, digest: str) -> bool:
    return xxhash.xxh3_128(view).hexdigest() == digest


def _digest(job: SnapshotJob, ref: ChunkRef) -> str | None:
    """What the wire checks ``ref``'s bytes against: its digest, or None for a snapshot without
    a manifest (its chunk ids are no digests; its objects are verified whole against the
    bucket's checksums, and a peer whose chunk fails that is penalised then:
    bdn.daemon.snapshots.foreign_source)."""
    return None if job.foreign is not None else ref.digest


def _part_of(view: memoryview, offset: int, length: int, _size: int) -> memoryview:
    """Where a bucket read of ``length`` bytes at ``offset`` of the chunk lands in ``view``."""
    return view[offset : offset + length]


def _copy_into(mm: Any, offset: int, buf: bytearray) -> None:
    mm[offset : offset + len(buf)] = buf


def stalled(res: FetchResult) -> bool:
    """Whether a FAILED fetch ended in a time-out of the stream (``TimeoutError``: no byte
    within ``io_timeout_s``, plus the request's wait) rather than a reset, a closed connection
    or a protocol error (bdn.transfer.client reports the exception's type first). A stream
    that could not be opened in time (``connect:``: a handshake slow under load) is a plain
    failure: penalising the peer would take it out of every asker's live set and move its chunks
    to new owners, who would read them from the bucket a second time."""
    return res.outcome is Outcome.FAILED and "TimeoutError" in res.error and ": connect: " not in res.error


class WireSource:
    """Peer fetches over the wire and bucket reads into the mapping (see the module docstring).

    ``peer_sem`` (all peer requests) and ``alloc``/``free`` (chunk buffers for the endgame race)
    are shared with ``Sources``; ``chunk_log`` may be None. ``growing`` (None: cut-through off)
    is where this node's bucket reads land for parked askers, ``on_growing``/``on_grown`` the
    events that announce them; ``on_bad_bytes(url, node, address, snapshot)``: a peer sent bad
    bytes (it is told, ``bdn.daemon.serve.chunkcheck``).
    """

    def __init__(
        self,
        cfg: Config,
        pool: FetchPool,
        maps: TargetMaps,
        membership: Membership,
        stats: Stats,
        peer_sem: asyncio.Semaphore,
        download_limit: RateLimit,
        disk_pool: Executor,
        alloc: Callable[[int], bytearray],
        free: Callable[[bytearray], None],
        chunk_log: ChunkLog | None = None,
        *,
        on_bad_bytes: Callable[[str, str, str, str], None] | None = None,
        growing: GrowingChunks | None = None,
        on_growing: Callable[[SnapshotJob, ChunkRef], None] | None = None,
        on_grown: Callable[[SnapshotJob, ChunkRef], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.pool = pool
        self.maps = maps
        self.membership = membership
        self.stats = stats
        self.peer_sem = peer_sem
        self.download_limit = download_limit
        self.disk_pool = disk_pool
        self.alloc, self.free = alloc, free
        self.chunk_log = chunk_log
        self._peer_sems: dict[str, asyncio.Semaphore] = {}
        self.on_bad_bytes = on_bad_bytes  # (url, node, address, snapshot): the peer is told
        #: Chunks landing from the bucket, for cut-through (None: store and forward only).
        self.growing = growing
        #: Event hook (job, ref): a chunk started growing here (announced to subscribed peers).
        self.on_growing = on_growing
        #: Event hook (job, ref): that chunk no longer grows here (verified or failed).
        self.on_grown = on_grown

    async def _disk(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.disk_pool, fn, *args)

    # ---- peers --------------------------------------------------------------------------------
    async def from_peer(
        self,
        job: SnapshotJob,
        m: Member,
        peer: Peer,
        address: str,
        ref: ChunkRef,
        target: Path,
        wait: float,
        errors: list[str],
        racing: bool = False,
        att: Attempt | None = None,
    ) -> bool:
        """Ask ``peer`` (member ``m``) for ``ref`` (parked up to ``wait`` s at an owner). True
        when the chunk is in ``target`` and verified; False to try the next source (busy answers
        counted in ``stats.busy_answers``, failures appended to ``errors``). ``att`` is told
        when the answer's body begins and how the request ended (bdn.daemon.fetch.watch)."""
        att = att or Attempt(SYSTEM)
        sem = self._peer_sems.get(m.url)
        if sem is None:
            sem = self._peer_sems[m.url] = asyncio.Semaphore(self.cfg.max_per_peer)
        wait = min(wait, wire.MAX_WAIT_MS / 1000)  # the wire's bound
        held = False
        if not racing and sem.locked() and len(self.membership.live()) >= NO_QUEUE_MIN_PEERS:
            # Every stream to this peer is taken. Waiting long behind them (even to park at the
            # owner) would commit the chunk to a saturated uplink (a late owner's last chunks would
            # all leave through it, one asker after another, while the first receivers sit idle); failing at once idles a lone holder's
            # streams between rounds (N = 2). So: wait up to QUEUE_S for a stream, then count
            # a busy answer; the next round (woken by a HAVE from any holder) asks whoever is
            # least loaded then.
            try:
                await asyncio.wait_for(sem.acquire(), QUEUE_S)
                held = True
            except TimeoutError:
                self.stats.busy_answers += 1
                if self.chunk_log is not None:
                    self.chunk_log.attempt(job, ref, f"peer:{m.node_id}", "busy", "wire")
                return False
        m.inflight += 1
        try:
            if not held:
                await sem.acquire()
            try:
                async with self.peer_sem:
                    if self.membership.redirected(m):
                        return False  # penalised (or gone) while this request was queued for it
                    await self.download_limit.take(ref.length)
                    self.stats.inflight["peer"] += 1
                    try:
                        res = await (self._race_one if racing else self._direct)(
                            job, m, peer, address, ref, target, wait, att
                        )
                    finally:
                        self.stats.inflight["peer"] -= 1
            finally:
                sem.release()
        finally:
            m.inflight -= 1
        att.outcome = res.outcome.value
        if self.chunk_log is not None:
            self.chunk_log.attempt(
                job, ref, f"peer:{m.node_id}", res.outcome.value, "wire-cut" if res.cut_through else "wire"
            )
        if res.outcome is Outcome.OK:
            if job.foreign is not None:
                job.apply(ForeignReceived(ref, m.url, m.node_id))  # blamed if its object fails
            if res.cut_through:
                self.stats.add("peer_chunks_in_cut_through")
            if not racing:  # a race counts its winner only (Sources.race)
                job.apply(BytesCounted(FROM_PEERS, ref.length))
                self.stats.add("peer_bytes_in", ref.length)
                self.stats.add("peer_wire_bytes_in", ref.length)
                self.stats.add("peer_chunks_in")
            return True
        if res.outcome is Outcome.BUSY:
            self.stats.busy_answers += 1
        elif res.outcome is Outcome.CORRUPT:
            self.stats.verify_failed(m.node_id)
            self.membership.penalise(m.url, self.cfg.penalty_s)
            if self.on_bad_bytes is not None:
                self.on_bad_bytes(m.url, m.node_id, address, job.identity)  # chunkcheck: tell the peer
            log.warning(
                "snapshot %s: peer %s sent bad bytes for chunk %d of %s; penalised for %g s",
                job.identity,
                m.node_id,
                ref.index,
                ref.path,
                self.cfg.penalty_s,
                extra={"peer": m.node_id},
            )
        elif res.outcome is Outcome.FAILED and res.cut_through and not stalled(res):
            # A cut-through answer broken off: the owner's copy failed its own check or its
            # bucket read broke (bdn.transfer.growing cuts the answers off), or the owner died.
            # Not a failure of the peer (nobody is blamed for it, DESIGN.md "Cut-through"): the
            # round counts as busy and the chunk is asked again; a dead owner is SWIM's to find.
            # (Counted as failures, one bucket hiccup at an owner marked it failed at every
            # asker, took it out of their HRW and moved its chunks to owners that read them again.)
            log.debug(
                "snapshot %s: cut-through answer for chunk %d of %s from %s broke off: %s",
                job.identity,
                ref.index,
                ref.path,
                m.node_id,
                res.error,
            )
            self.stats.busy_answers += 1
        elif res.outcome is Outcome.FAILED:
            log.debug(
                "snapshot %s: chunk %d of %s from %s failed: %s",
                job.identity,
                ref.index,
                ref.path,
                m.node_id,
                res.error,
            )
            errors.append(res.error)
            self.membership.mark_failed(m.url)
            if stalled(res):
                # alive on membership exchanges, yet silent on a chunk for the whole time-out: as
                # it is skipped like a peer that sent bad bytes,
                # and the requests queued for it go elsewhere at once (penalise cancels them)
                self.membership.penalise(m.url, self.cfg.penalty_s)
                log.warning(
                    "snapshot %s: peer %s stalled on chunk %d of %s (%s); penalised for %g s",
                    job.identity,
                    m.node_id,
                    ref.index,
                    ref.path,
                    res.error,
                    self.cfg.penalty_s,
                    extra={"peer": m.node_id},
                )
        return False

    async def _direct(
        self,
        job: SnapshotJob,
        m: Member,
        peer: Peer,
        address: str,
        ref: ChunkRef,
        target: Path,
        wait: float,
        att: Attempt,
    ) -> FetchResult:
        try:
            mm = await self.maps.acquire(job, target)
        except OSError as e:
            return FetchResult(Outcome.FAILED, error=f"cannot map {target}: {e}")
        # a whole answer is pwritten through the stream's buffer (no page tables for the
        # mapping, no zeroing of fresh pages), a cut-through one lands in the mapping
        fd = self.maps.fd(target)
        abort = Abort()
        fut = self.pool.submit(
            peer,
            address,
            mm,
            ref.offset,
            ref.length,
            _digest(job, ref),
            wait_s=wait,
            snapshot=job.identity,
            # a foreign chunk is never in a peer's growing table (its bucket reads are not
            # announced: from_bucket), so it never comes cut-through
            cut_through=self.growing is not None and job.foreign is None,
            fd=fd,
            on_data=att.data,
            abort=abort,
        )
        return await self._await(fut, m, peer, lambda: self.maps.release(target), abort=abort)

    async def _race_one(
        self,
        job: SnapshotJob,
        m: Member,
        peer: Peer,
        address: str,
        ref: ChunkRef,
        target: Path,
        wait: float,
        att: Attempt,
    ) -> FetchResult:
        buf = self.alloc(ref.length)
        abort = Abort()
        fut = self.pool.submit(
            peer,
            address,
            buf,
            0,
            ref.length,
            _digest(job, ref),
            wait_s=wait,
            snapshot=job.identity,
            on_data=att.data,
            abort=abort,
        )
        res = await self._await(fut, m, peer, None, settle=False, abort=abort)
        if res.outcome is not Outcome.OK:
            self._free_when_done(fut, buf)
            return res
        try:
            mm = await self.maps.acquire(job, target)
        except OSError as e:
            return FetchResult(Outcome.FAILED, error=f"cannot map {target}: {e}")
        try:
            await self._disk(_copy_into, mm, ref.offset, buf)
        finally:
            self.maps.release(target)
        self.free(buf)
        return res

    def _free_when_done(self, fut: concurrent.futures.Future[FetchResult], buf: bytearray) -> None:
        """Give a race's ``buf`` back to the pool once ``fut``'s thread no longer writes into it.
        A racer whose peer was penalised meanwhile (``Membership.penalise`` cancels its request)
        returns at once, unsettled, while its thread may still be waiting for a stream to that
        peer and then receive the whole chunk: freed then, the peer's bytes would land in the
        buffer of the next race, and that race's honest peer would be blamed for
        them (or, written after its hash, they would reach the target unverified)."""
        if fut.done():
            self.free(buf)
            return
        loop = asyncio.get_running_loop()

        def back(_f: concurrent.futures.Future[FetchResult]) -> None:
            try:
                loop.call_soon_threadsafe(self.free, buf)
            except RuntimeError:  # the loop is closed (the daemon stopped): the buffer just goes
                pass

        fut.add_done_callback(back)

    async def _await(
        self,
        fut: concurrent.futures.Future[FetchResult],
        m: Member,
        peer: Peer,
        release: Callable[[], None] | None,
        settle: bool = True,
        abort: Abort | None = None,
    ) -> FetchResult:
        """The fetch's result; on cancellation (this task's, or ``m`` leaving the swarm, which
        cancels its requests) the fetch is ended and, with ``settle``, waited for, so no thread
        writes into the range after this returns. ``release`` runs once the thread is done.
        ``abort``: the fetch's own handle, set when this task is cancelled (the download was
        cancelled: a body frozen mid-way would otherwise hold the cancel for the peer time-out,
        ``peer_timeout_s`` x 2 to x 4; the peer's other streams are left alone)."""
        loop = asyncio.get_running_loop()
        if release is not None:
            fut.add_done_callback(lambda _f: loop.call_soon_threadsafe(release))
        req = asyncio.wrap_future(fut)
        m.requests.add(req)
        try:
            return await asyncio.shield(req)
        except asyncio.CancelledError:
            me = asyncio.current_task()
            mine = me is not None and me.cancelling() > 0
            if not mine:
                self.pool.client.close_peer(peer)  # the member left: end its streams now
            elif abort is not None:
                abort.set()  # this fetch alone: its thread returns at once
            if settle:
                while not fut.done():
                    try:
                        await asyncio.shield(asyncio.wrap_future(fut))
                    except asyncio.CancelledError:
                        self.pool.client.close_peer(peer)
                    except Exception:  # noqa: BLE001 - it ended: that is all we wait for
                        break
            if mine:
                raise
            return FetchResult(Outcome.FAILED, error=f"{m.url}: left the swarm while the request waited")
        finally:
            m.requests.discard(req)

    # ---- the bucket ---------------------------------------------------------------------------
    async def from_bucket(
        self,
        bucket: BucketIO,
        job: SnapshotJob,
        ref: ChunkRef,
        target: Path,
        owner: bool,
        address: str = "",
        claim: Callable[[], bool] | None = None,
    ) -> None:
        """``Sources.from_bucket`` with the bytes read into the mapping and hashed in place
        (never indexed before the digest matched). Same errors, and Superseded when ``claim()``
        (asked once, as the first part takes its bucket slot) says another node has the chunk
        now. With ``growing`` set and the chunk's swarm ``address`` given, the chunk is
        registered as growing while it lands, so the transfer server can send it on
        cut-through (bdn.transfer.growing).

        A chunk of a snapshot without a manifest is read the same way, at its object's ETag
        (``If-Match``: ObjectChanged when the object was replaced, and the runner lists again),
        and not hashed (its id is no digest: the object is verified whole before READY,
        ``bdn.daemon.snapshots.foreign_source``); it is neither announced for cut-through nor
        given up by ``claim`` (peers exchange no HAVEs for such a snapshot, so a read given up
        would not find the node that took it)."""
        key = f"{job.identity}/{ref.path}"
        digest = _digest(job, ref)
        if_match = None
        if job.foreign is not None:
            if_match, address, claim = job.foreign.etag(ref), "", None
        try:
            mm = await self.maps.acquire(job, target)
        except OSError as e:
            raise BdnError(f"cannot map {target}: {e}") from None
        parts = bucket_parts(ref.length, self.cfg.bucket_concurrency)
        try:
            with memoryview(mm) as whole, whole[ref.offset : ref.offset + ref.length] as view:
                try:
                    async for attempt in retry_policy.bucket_bytes():
                        with attempt:
                            g = (
                                Growing(str(target), ref.offset, parts)
                                if self.growing is not None and address
                                else None
                            )
                            try:
                                await self._read_parts(
                                    bucket,
                                    key,
                                    ref,
                                    view,
                                    parts,
                                    g,
                                    self._on_slot(job, address, ref, g, claim),
                                    if_match,
                                )
                                if digest is not None and not await self._disk(_hash_ok, view, digest):
                                    self.stats.verify_failed("bucket")
                                    if self.chunk_log is not None:
                                        self.chunk_log.attempt(job, ref, "bucket", "corrupt")
                                    log.warning(
                                        "snapshot %s: bucket bytes of %s chunk %d do not match the manifest",
                                        job.identity,
                                        key,
                                        ref.index,
                                    )
                                    raise retry_policy.BadBytes()
                                if g is not None:
                                    g.verified()
                            finally:
                                self._ungrow(job, ref, address, g)
                except retry_policy.BadBytes:
                    raise ProtocolError(
                        f"{key}: chunk {ref.index} from the bucket does not match the manifest digest"
                    ) from None
                except retry_policy.Transient as e:
                    raise BdnError(str(e)) from None
        finally:
            self.maps.release(target)

    async def _read_parts(
        self,
        bucket: BucketIO,
        key: str,
        ref: ChunkRef,
        view: memoryview,
        parts: list[tuple[int, int]],
        g: Growing | None,
        started: Callable[[], None] | None = None,
        if_match: str | None = None,
    ) -> None:
        """Read ``parts`` of the chunk into ``view``. The parts queue, in order, for the
        bucket's ``bucket_concurrency`` slots (FIFO): a chunk's parts run together and, as each
        ends, the next chunk's part takes its slot, so the streams never idle between chunks.
        Every part ends before this returns (a failed part does not leave the others writing
        into the view). ``started()``: called as each part takes its bucket slot, before its
        request (the chunk starts landing then, not while its parts queue); what it raises ends
        that part. ``if_match``: the object's version token every part must match. Raises
        BdnError (missing object, bucket error), ObjectChanged (``if_match`` no longer holds)."""
        try:
            res = await asyncio.gather(
                *(
                    bucket.read_chunk(
                        key,
                        ref.offset + off,
                        n,
                        functools.partial(_part_of, view, off, n),
                        if_match=if_match,
                        progress=None if g is None else functools.partial(g.landed, i),
                        started=started,
                    )
                    for i, (off, n) in enumerate(parts)
                ),
                return_exceptions=True,
            )
            for r in res:
                if isinstance(r, BaseException):
                    raise r
        except ObjectNotFound:
            named = "its listing" if if_match is not None else "the manifest"
            raise BdnError(f"bucket object {key} is missing (named by {named})") from None
        except ObjectChanged:
            raise  # a snapshot without a manifest starts again on a fresh listing (runner)
        except BucketUnavailable as e:
            raise retry_policy.Transient(f"bucket read of {key} failed: {e}") from None
        except BucketError as e:
            raise BdnError(f"bucket read of {key} failed: {e}") from None

    def _on_slot(
        self,
        job: SnapshotJob,
        address: str,
        ref: ChunkRef,
        g: Growing | None,
        claim: Callable[[], bool] | None,
    ) -> Callable[[], None] | None:
        """The hook each part of one read attempt calls as it takes its bucket slot: the first
        call decides (``claim()``: does the chunk still want this read?) and announces the chunk
        for cut-through; later parts follow that decision. A read given up raises Superseded
        in every part, before any request went out, so none of its bytes is read."""
        if g is None and claim is None:
            return None
        decided: list[bool] = []

        def started() -> None:
            if not decided:
                decided.append(claim is None or claim())
                if decided[0] and g is not None:
                    self._grow(job, address, ref, g)
            if not decided[0]:
                raise Superseded(f"chunk {ref.index} of {ref.path}: another node has it now")

        return started

    def _grow(self, job: SnapshotJob, address: str, ref: ChunkRef, g: Growing) -> None:
        """The chunk's first part holds its bucket slot: from now on ``g`` lands, so it is
        registered for cut-through and announced. (Announced when the acquisition began, while
        its parts may still queue behind the owner's other chunks for seconds, a chunk would draw
        askers before its first byte, holding their cut-through workers and the owner's growing
        slots while the chunks landing then find none free.)"""
        assert self.growing is not None
        if g.state != "growing":
            return  # its read ended before the loop got here: nothing to pass on
        g.announced = True
        self.growing.start(address, g)
        if self.on_growing is not None:
            self.on_growing(job, ref)  # a HAVE of layer HAVE_GROWING to the subscribers

    def _ungrow(self, job: SnapshotJob, ref: ChunkRef, address: str, g: Growing | None) -> None:
        """The read attempt ended: a failed copy leaves the table at once (its answers in
        flight are cut off); a verified one on the loop's next turn, after the fetcher indexed
        the chunk, so a request resolved meanwhile finds one of the two."""
        if g is None or self.growing is None:
            return
        g.failed()  # no-op once verified
        if not g.announced:
            return  # it never held a bucket slot: nobody knows of it
        if self.on_grown is not None:
            self.on_grown(job, ref)
        if g.state == "verified":
            asyncio.get_running_loop().call_soon(self.growing.end, address, g)
        else:
            self.growing.end(address, g)
