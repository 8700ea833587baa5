"""bdnd's side of the transfer wire (bdn.transfer, bdn.proto.wire): the ``TransferServer`` that
serves this node's verified chunks with ``sendfile``, and the ``TransferClient``/``FetchPool``
the fetcher receives chunks with (``bdn.daemon.fetch.wire_source``).

Serving: ``admit`` runs on the server's connection threads and hands the request to the event
loop, where ``ChunkServing.request`` decides (wait at the owner while it fetches, join the
snapshot the asker names, the pure upload policy of ``bdn.daemon.serve.uploads``, the upload
rate limit); ``resolve`` looks the address up in the chunk index (only verified chunks are
indexed) and gives the file, offset and length, whose descriptor the server opens once and
caches. ``forget(job)`` closes the cached descriptors of a snapshot GC
collected (and the target mappings no download uses), so its shm pages are freed.

Receiving: ``pool`` and ``maps`` are what ``bdn.daemon.fetch.wire_source`` fetches through,
``growing`` the chunks landing here from the bucket that cut-through answers read, and
``subscriptions`` makes the HAVE subscriber of ``bdn.daemon.fetch.haves``; so a ``WirePeer`` is
built before the fetch path, and its server started later with the chunk service (``start``).

Advertising: ``address`` is ``"host:port"`` (the advertise URL's host, the bound port), sent in
every membership exchange as ``transfer``; ``parse_address`` checks a peer's (untrusted) one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
from concurrent.futures import Executor
from typing import Any, Protocol
from urllib.parse import urlsplit

from bdn.daemon.config import Config, split_hostport
from bdn.daemon.fetch.held import HeldFiles
from bdn.daemon.fetch.ratelimit import RateLimit
from bdn.daemon.fetch.targets import TargetMaps
from bdn.daemon.observe.stats import Stats
from bdn.daemon.serve.transfer_address import learn, parse_address, peer_of
from bdn.daemon.serve.uploads import Admission
from bdn.daemon.snapshots.snapshot import RESULT, STORED, Loc, SnapshotJob
from bdn.daemon.store.index import ChunkIndex
from bdn.proto import wire
from bdn.proto.errors import BdnError
from bdn.proto.identity import validate_identity
from bdn.proto.keys import SwarmKeys
from bdn.proto.manifest import ChunkRef
from bdn.transfer import (
    NOT_HERE,
    Busy,
    FetchPool,
    Granted,
    TransferClient,
    TransferServer,
)
from bdn.transfer.announce import HaveFeed, HaveSubscriber, OnEnd, OnHave
from bdn.transfer.growing import Growing, GrowingChunks
from bdn.transfer.server import Location, Verdict

log = logging.getLogger("bdn.wire")

#: Seconds an ``admit`` waits for the event loop beyond the asker's own ``wait``.
ADMIT_SLACK_S = 30.0
#: Seconds a TAKE waits for the event loop's decision before it is refused.
TAKE_WAIT_S = 5.0
#: Seconds between a waiting connection thread's looks at ``WirePeer.closing``.
CLOSING_POLL_S = 0.25


def listen_address(cfg: Config) -> tuple[str, int, bool]:
    """Where the transfer server binds: ``(host, port, auto)``. ``transfer_listen = "auto"`` is
    the peer host with the peer port + 1 (+ 2 when ``local_listen`` uses + 1, as the defaults
    7080/7081 do), ``auto`` True: if that port is taken any free one is used instead."""
    if cfg.transfer_listen != "auto":
        host, port = split_hostport(cfg.transfer_listen)
        return host or "0.0.0.0", port, False
    phost, pport = split_hostport(cfg.peer_listen)
    lport = split_hostport(cfg.local_listen)[1] if cfg.local_listen else None
    port = pport + 1 if lport != pport + 1 else pport + 2
    if pport == 0 or port > 65535:
        port = 0  # any free port: peers learn the bound one from membership exchanges
    return phost or "0.0.0.0", port, True


class Serving(Protocol):
    """What the transfer server asks of the chunk service (``bdn.daemon.serve.serving.ChunkServing``)."""

    limit: RateLimit

    async def request(
        self, address: str, wait: float, hint: str | None, cut_through: bool = False, asker: str | None = None
    ) -> tuple[Admission, Any]:
        """The upload decision for a peer's request of ``address`` (a booked slot on ``SEND``)."""
        ...

    def done(self, address: str) -> None:
        """The upload booked for ``address`` ended."""
        ...

    def give(self, peer: str, identity: str, index: int) -> bool:
        """Whether this node gives its bucket read of that stored chunk up to ``peer`` (a TAKE)."""
        ...


class HeldJobs(Protocol):
    """Where a new HAVE subscriber's bitfields come from (``bdn.daemon.snapshots.catalog.Catalog``)."""

    held: HeldFiles

    def get(self, identity: str) -> SnapshotJob | None:
        """The job of ``identity``, or None."""
        ...


class WirePeer:
    """The transfer server and client of one daemon: the one path of chunks between daemons.

    Built before the fetcher, which receives through its ``pool`` and ``maps`` (``WireLink`` of
    ``bdn.daemon.fetch.sources``), announces through ``announce``/``started_growing`` and
    subscribes through ``subscriptions``. ``start(loop, serving, jobs)`` binds the server that
    answers with ``serving`` and ``jobs`` (raises OSError when an explicit ``transfer_listen``
    cannot be bound; the ``auto`` port falls back to any free port), ``close_client()`` ends the
    fetches in flight (shutdown, before the jobs are cancelled), ``close()`` stops both.
    """

    def __init__(
        self,
        cfg: Config,
        keys: SwarmKeys,
        index: ChunkIndex,
        stats: Stats,
        disk_pool: Executor,
        *,
        workers: int | None = None,
    ) -> None:
        self.cfg = cfg
        self.keys = keys
        self.index = index
        self.stats = stats
        self._host, self._port, self.auto_port = listen_address(cfg)
        self.serving: Serving | None = None  # given at ``start``
        self.jobs: HeldJobs | None = None  # given at ``start``
        self.maps = TargetMaps(disk_pool)
        self.feed = HaveFeed(self._held)
        self.server: TransferServer | None = None
        self.client = TransferClient(
            keys, cfg.node_id, streams_per_peer=max(1, cfg.max_per_peer), io_timeout_s=cfg.peer_timeout_s
        )
        self.pool = FetchPool(self.client, workers or max(2, cfg.max_inflight))
        self.loop: asyncio.AbstractEventLoop | None = None
        self.address: str | None = None
        #: Chunks landing here from the bucket, served cut-through (bdn.transfer.growing); a
        #: chunk that starts growing wakes the requests parked for it.
        self.growing = GrowingChunks(on_start=index.wake)
        #: identity -> stored chunk positions growing here now (sent to a new HAVE subscriber)
        self.growing_positions: dict[str, set[int]] = {}
        #: Set when the daemon stops (``close_client``): connection threads stop waiting for the loop.
        self.closing = threading.Event()

    def subscriptions(self, on_have: OnHave, on_end: OnEnd) -> HaveSubscriber:
        """HAVE subscriptions over this node's client, their frames to ``on_have``/``on_end``
        (``bdn.daemon.fetch.haves.Haves`` makes and closes its own)."""
        return HaveSubscriber(self.client, on_have, on_end)

    def _held(self, identity: str) -> dict[int, Any] | None:
        jobs = self.jobs
        if jobs is None:
            return None
        return _held(jobs.get(identity), self.growing_positions.get(identity), jobs.held)

    def _server(self, port: int) -> TransferServer:
        return TransferServer(
            self.keys,
            self.cfg.node_id,
            self.resolve,
            admit=self.admit,
            host=self._host,
            port=port,
            on_have=self.feed.serve,
            on_take=self.take,
            # a DATA body goes out by the deadline its asker gives it (peer_timeout_s as its io
            # timeout, bdn.transfer.receive.body_limit): a peer reading slowly gives its slot back
            send_timeout_s=self.cfg.peer_timeout_s,
        )

    # ---- life ---------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop, serving: Serving, jobs: HeldJobs) -> str:
        """Listen, answering with ``serving`` (uploads, TAKEs) and ``jobs`` (HAVE subscribers'
        bitfields) on ``loop``; the advertised ``host:port``."""
        self.loop = loop
        self.serving = serving
        self.jobs = jobs
        self.server = self._server(self._port)
        try:
            host, port = self.server.start()
        except OSError as e:
            if not self.auto_port:
                raise
            log.warning(
                "transfer port %s:%d is taken (%s): listening on any free port instead "
                "(peers learn it from membership exchanges)",
                self._host,
                self._port,
                e.strerror,
            )
            self.server = self._server(0)
            host, port = self.server.start()
        adv = urlsplit(self.cfg.advertise_url).hostname or host
        if self._host not in ("0.0.0.0", "::", ""):
            adv = host
        self.address = self.cfg.transfer_advertise or (f"[{adv}]:{port}" if ":" in adv else f"{adv}:{port}")
        return self.address

    def close_client(self) -> None:
        """End every fetch in flight (they report FAILED) and refuse new ones; from now on the
        server's connection threads stop waiting for the event loop (``admit``, ``take``), so
        that ``close`` can join them while the loop runs it."""
        self.closing.set()
        self.client.close()

    def close(self) -> None:
        """Stop the client, its worker threads, the server and the target mappings."""
        self.closing.set()
        self.feed.close()
        self.client.close()
        self.pool.close()
        if self.server is not None:
            self.server.close()
        self.maps.close()

    def forget(self, job: SnapshotJob) -> None:
        """Event: GC collected ``job`` (or it failed): close the descriptors cached for its files
        and drop the mappings no job uses any more."""
        m = job.manifest
        if m is not None and self.server is not None:
            store = job.store
            for f in m.files:
                for d in (
                    store.ready_dir(job.identity),
                    store.staging_dir(job.identity),
                    store.stored_dir(job.identity),
                ):
                    self.server.forget(d / f.path)
        self.maps.sweep()

    def announce(self, job: SnapshotJob, layer: str, position: int) -> None:
        """Event (``Fetcher.on_indexed``): chunk ``position`` of ``job``'s ``layer`` is verified
        and indexed here: a HAVE to the peers subscribed to ``job``."""
        self.feed.announce(job.identity, 0 if layer == STORED else 1, position)

    def started_growing(self, job: SnapshotJob, ref: ChunkRef) -> None:
        """Event: stored chunk ``ref`` of ``job`` started landing here from the bucket: a HAVE
        of layer ``HAVE_GROWING`` to the subscribers (they may take it cut-through now)."""
        pos = job.ref_index(STORED, ref)
        self.growing_positions.setdefault(job.identity, set()).add(pos)
        self.feed.announce(job.identity, wire.HAVE_GROWING, pos)

    def stopped_growing(self, job: SnapshotJob, ref: ChunkRef) -> None:
        """Event: that chunk no longer lands here (verified, or the read failed)."""
        pos = self.growing_positions.get(job.identity)
        if pos is not None:
            pos.discard(job.ref_index(STORED, ref))
            if not pos:
                del self.growing_positions[job.identity]

    # ---- the server's callbacks (connection threads) ------------------------------------------
    def admit(self, peer: str, ask: wire.Ask) -> Verdict:
        """The upload decision for ``peer``'s ``ask``, made on the event loop (blocks this thread
        up to the ask's wait plus ``ADMIT_SLACK_S``)."""
        loop, serving = self.loop, self.serving
        if loop is None or serving is None or loop.is_closed():
            return NOT_HERE
        if self.closing.is_set():
            return NOT_HERE
        fut = asyncio.run_coroutine_threadsafe(self._admit(serving, ask, peer), loop)
        deadline = time.monotonic() + ask.wait_ms / 1000 + ADMIT_SLACK_S
        while True:
            try:
                return fut.result(min(CLOSING_POLL_S, max(0.0, deadline - time.monotonic())))
            except concurrent.futures.TimeoutError:
                if time.monotonic() < deadline and not self.closing.is_set():
                    continue
            fut.cancel()
            # granted just as we gave up: give the slot back
            fut.add_done_callback(_release_late)
            # a stopping daemon answers at once: its loop is joining this thread (App.shutdown ->
            # close -> TransferServer.close) and would not run the decision (the daemon would wait
            # out its shutdown watchdog)
            return NOT_HERE if self.closing.is_set() else Busy(1.0)

    def take(self, peer: str, take: wire.Take) -> bool:
        """Whether this node, the owner, gives its bucket read of stored chunk ``take.index`` of
        ``take.identity`` up to ``peer`` (``Fetcher.give``, decided on the event loop where this
        node's own reads decide; blocks this thread up to ``TAKE_WAIT_S``; refused on a time-out)."""
        loop, serving = self.loop, self.serving
        if loop is None or serving is None or loop.is_closed() or self.closing.is_set():
            return False
        try:
            validate_identity(take.identity)
        except BdnError:
            return False

        result: concurrent.futures.Future[bool] = concurrent.futures.Future()

        def decide() -> None:
            if not result.set_running_or_notify_cancel():
                return  # this thread gave up waiting first: nothing was granted
            try:
                result.set_result(serving.give(peer, take.identity, take.index))
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                result.set_exception(e)

        try:
            loop.call_soon_threadsafe(decide)
        except RuntimeError:  # the loop closed meanwhile
            return False
        try:
            try:
                deadline = time.monotonic() + TAKE_WAIT_S
                while True:  # in slices: a stopping daemon's loop may be joining this thread
                    try:
                        return result.result(min(CLOSING_POLL_S, max(0.0, deadline - time.monotonic())))
                    except concurrent.futures.TimeoutError:
                        if time.monotonic() >= deadline or self.closing.is_set():
                            raise
            except concurrent.futures.TimeoutError:
                # a decision not started yet is cancelled (never granted); one running right now
                # (give() is synchronous: a moment) stands, so the asker learns what was decided
                return False if result.cancel() else result.result()
        except Exception:  # noqa: BLE001 - a bug in give: refused, the connection serves on
            log.exception("take of chunk %d of %s from %s failed", take.index, take.identity, peer)
            return False

    async def _admit(self, serving: Serving, ask: wire.Ask, peer: str | None = None) -> Verdict:
        hint = ask.snapshot
        if hint is not None:
            try:
                validate_identity(hint)
            except BdnError:
                return NOT_HERE
        cut = ask.cut_through and ask.offset == 0
        decision, _loc = await serving.request(ask.address, ask.wait_ms / 1000, hint, cut, peer)
        if decision is Admission.NOT_HERE:
            return NOT_HERE
        if decision is not Admission.SEND:
            return Busy(float(decision.retry_after or "1"))
        try:
            await serving.limit.take(ask.length)
        except BaseException:
            serving.done(ask.address)
            raise
        loop = asyncio.get_running_loop()
        address, length = ask.address, ask.length

        def release(sent: bool) -> None:
            loop.call_soon_threadsafe(self._sent, serving, address, length, sent)

        return Granted(release)

    def _sent(self, serving: Serving, address: str, length: int, sent: bool) -> None:
        """Event: a granted upload ended: ``sent`` whole (counted), or not (NOT_HERE or BUSY after
        all, or cut short: the asker then retries elsewhere)."""
        serving.done(address)
        if sent:
            self.stats.add("peer_bytes_out", length)
            self.stats.add("peer_wire_bytes_out", length)
            self.stats.add("peer_chunks_out")

    def resolve(self, address: str) -> Location | Growing | None:
        """Where the verified chunk at ``address`` lies: ``(path, offset, length)``; the chunk
        while it lands here from the bucket (``Growing``, for a cut-through answer); or None."""
        loc = self.index.lookup(address)
        if loc is None:
            g = self.growing.get(address)
            # a verified copy leaves the growing table only after it is indexed: look again
            return g if g is not None else self._resolve_verified(address)
        return self._locate(loc)

    def _resolve_verified(self, address: str) -> Location | None:
        loc = self.index.lookup(address)
        return None if loc is None else self._locate(loc)

    def _locate(self, loc: Loc) -> Location | None:
        job = loc.job
        m = job.manifest
        if m is None:
            return None
        f = m.files[loc.file_index]
        paths = [loc.path()]
        if not (loc.layer == STORED and f.is_diff):
            # staging is renamed to ready when the snapshot completes (see ChunkServing.open)
            paths += [job.store.ready_dir(job.identity) / f.path, job.store.staging_dir(job.identity) / f.path]
        for p in paths:
            try:
                if os.stat(p).st_size >= loc.offset + loc.length:  # not deleted nor truncated meanwhile
                    return str(p), loc.offset, loc.length
            except OSError:
                continue
        return None


def _held(
    job: SnapshotJob | None,
    growing: set[int] | None = None,
    files: HeldFiles | None = None,
) -> dict[int, Any] | None:
    """``{layer: positions}`` of the verified chunks of ``job`` (less those of files gone from
    disk, ``files``), and (layer ``HAVE_GROWING``) those landing here now (for a new HAVE
    subscriber; read on a connection thread: a change meanwhile is announced by the feed as
    well). None: not a snapshot with a manifest here."""
    if job is None or job.manifest is None or job.foreign is not None:
        return None
    out: dict[int, Any] = {}
    if growing:
        try:
            out[wire.HAVE_GROWING] = sorted(growing)
        except RuntimeError:  # the loop changed the set meanwhile: its announcements follow anyway
            pass
    for layer, name in ((0, STORED), (1, RESULT)):
        bits = job.bits(name) if files is None else files.advertised(job, name)
        if bits is not None and bits.count:
            out[layer] = bits.set_positions()
    return out


def _release_late(f: concurrent.futures.Future[Verdict]) -> None:
    if not f.cancelled() and f.exception() is None:
        _release(f.result())


def _release(v: Verdict) -> None:
    if isinstance(v, Granted) and v.release is not None:
        v.release(False)


__all__ = ["WirePeer", "learn", "parse_address", "peer_of"]
