"""The daemon's composition root and lifecycle, as uvicorn's ``Server`` runs one:

1. **signal handlers first**: SIGTERM and SIGINT ask the daemon to stop, at any moment,
   including while it settles membership at startup; every snapshot in progress saves its
   verified chunks, so the next start resumes. A second SIGTERM/SIGINT while stopping exits at
   once (status 1) without waiting for the rest. **SIGHUP is ignored** (one log line): bdnd has
   no configuration reload; restart it to apply a new configuration.
2. ``startup()``: open the peer client, register the ready snapshots in shm, start membership
   rounds, listen on the peer port and the local API, then settle (membership rounds every
   0.25 s until the static peers answered or ``startup_settle_s`` passed) and load
   ``STARTUP_SNAPSHOT`` and the downloads a restart interrupted; tell systemd ``READY=1``.
3. ``main_loop()``: wait for the stop request.
4. ``shutdown()``: tell systemd ``STOPPING=1``, stop listening, cancel every task and job (each
   saves its progress), close the peer client, the worker pools and the bucket.

``serve()`` returns the exit status, 0 after a stop request; a port that cannot be bound raises
``CannotListen`` (``bdnd`` exits 2 with its one line, as for a configuration error); building
the App raises ``ConfigError`` for a bucket it cannot open (credentials file, endpoint) or a
``chunk_log`` it cannot open (exit 2 too).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from bdn.bucket import BucketError, ObjectNotFound, open_bucket
from bdn.daemon.config import Config, ConfigError, split_hostport
from bdn.daemon.fetch.bucketio import BucketIO
from bdn.daemon.fetch.fetcher import Fetcher
from bdn.daemon.fetch.haves import Haves
from bdn.daemon.fetch.ratelimit import RateLimit
from bdn.daemon.fetch.sources import Sources
from bdn.daemon.http.guard import GuardedRunner
from bdn.daemon.http.local import make_local_app
from bdn.daemon.http.peer import make_peer_app
from bdn.daemon.http.services import Services
from bdn.daemon.observe.chunklog import open_chunk_log
from bdn.daemon.observe.memprobe import MemProbe
from bdn.daemon.observe.metrics import Metrics
from bdn.daemon.observe.problems import Problems
from bdn.daemon.observe.readiness import Readiness
from bdn.daemon.observe.stats import Stats
from bdn.daemon.observe.status import StatusView
from bdn.daemon.process.clock import SYSTEM, Clock
from bdn.daemon.process.executors import Executors
from bdn.daemon.process.listening import binding, clear_unix_socket
from bdn.daemon.process.shmlock import ShmLock
from bdn.daemon.process.shutdown import HTTP_GRACE_S, NoWaitExecutor, StopClock
from bdn.daemon.replica import registry
from bdn.daemon.replica.changes import ChangedTensorsCache
from bdn.daemon.replica.engines import Engine
from bdn.daemon.replica.hotload import HotLoad
from bdn.daemon.replica.target import Target
from bdn.daemon.replica.view import MAX_ENGINES, ReplicaView
from bdn.daemon.serve.chunkcheck import BadChunkReports, ChunkCheck
from bdn.daemon.serve.serving import ChunkServing
from bdn.daemon.serve.uploads import Uploads
from bdn.daemon.serve.wire_peer import WirePeer
from bdn.daemon.snapshots.catalog import Catalog
from bdn.daemon.snapshots.foreign_source import ForeignLoader, Hints
from bdn.daemon.snapshots.runner import Runner
from bdn.daemon.snapshots.snapshot import SnapshotJob
from bdn.daemon.store.current import CurrentLink
from bdn.daemon.store.index import ChunkIndex
from bdn.daemon.store.store import Store
from bdn.daemon.swarm.gossip import Gossip
from bdn.daemon.swarm.membership import Membership
from bdn.daemon.swarm.nonces import NonceCache
from bdn.daemon.swarm.peer_client import PeerClient
from bdn.proto.errors import ProtocolError
from bdn.proto.keys import derive_keys
from bdn.proto.manifest import STARTUP_NAME, parse_startup
from bdn.transfer import target

log = logging.getLogger("bdn.bdnd")


class App:
    """One ``bdnd``: build with a Config, then ``await serve()``. ``notify`` is sd_notify.

    ``shm_lock`` is the lock of ``cfg.shm_dir`` (``ShmLock.acquire``); without one it is taken
    here, first, so a second daemon on the same ``shm_dir`` raises ``ShmInUse`` before it touches
    the directory or listens.
    """

    def __init__(
        self,
        cfg: Config,
        notify: Callable[[str], None] | None = None,
        clock: Clock = SYSTEM,
        shm_lock: ShmLock | None = None,
        stop_clock: StopClock | None = None,
    ) -> None:
        self.shm_lock = shm_lock or ShmLock.acquire(cfg.shm_dir)
        self.stop_clock = stop_clock or StopClock()  # bdnd passes one with the exit watchdog
        self.cfg = cfg
        self.notify = notify or (lambda msg: None)
        self.clock = clock
        self.keys = derive_keys(cfg.partition_secret)
        self.stats = Stats()
        self.pools = Executors.create(cfg.bucket_concurrency, cfg.background_nice)
        self.store = Store(cfg.shm_dir, self.keys.swarm_id, spare_limit=cfg.shm_spare_bytes)
        try:
            bucket = open_bucket(
                cfg.bucket,
                credentials_file=cfg.credentials_file or None,
                endpoint_url=cfg.endpoint_url or None,
                max_concurrency=cfg.bucket_concurrency,
            )
        except BucketError as e:  # a credentials file or endpoint it cannot use: bdnd exits 2
            raise ConfigError(f"config keys bucket/credentials_file/endpoint_url: {e}") from None
        self.bucket = BucketIO(
            bucket,
            cfg.bucket,
            cfg.bucket_concurrency,
            RateLimit.from_mbit(cfg.bucket_mbit),
            self.pools.bucket,
            self.stats,
        )
        self.membership = Membership(cfg.node_id, cfg.advertise_url, cfg.peers, clock)
        self.peers = PeerClient(
            self.keys,
            cfg.node_id,
            cfg.peer_timeout_s,
            node_of=self.membership.node_of,
            # below the peers' keep-alive (header timeout + 1 s) by 3 s; SWIM
            # probes one member per second, so at N = 8 a pair's connection
            # idles ~7 s between probes: with 5 s each probe paid a new
            # connection (9 % of a daemon's GIL time, measured at N = 8)
            keepalive_s=max(1.0, cfg.http_header_timeout_s - 2),
        )
        self.index = ChunkIndex(self.keys.address)
        # the transfer wire, the one path of peers' chunks: the fetch path receives through it,
        # its server is started with the chunk service once the loop runs (startup)
        wire = self.wire = WirePeer(cfg, self.keys, self.index, self.stats, self.pools.disk)
        try:
            chunk_log = self.chunk_log = open_chunk_log(cfg.chunk_log)
        except OSError as e:  # no such directory, no permission: bdnd exits 2
            raise ConfigError(f"config key 'chunk_log': cannot open {cfg.chunk_log}: {e.strerror}") from None
        self.haves = Haves(self.peers, self.membership, stats=self.stats, subscriptions=wire.subscriptions)
        sources = Sources(
            cfg,
            self.membership,
            self.bucket,
            self.stats,
            self.pools.disk,
            wire,
            chunk_log=chunk_log,
            on_bad_bytes=BadChunkReports(self.peers).report,
        )
        self.fetcher = Fetcher(
            cfg,
            self.membership,
            self.index,
            self.haves,
            sources,
            self.stats,
            clock,
            chunk_log=chunk_log,
            on_indexed=wire.announce,
        )
        self.hints = Hints()  # what hot-load requests say of snapshots without a manifest
        foreign = ForeignLoader(
            cfg, self.bucket, self.store, self.pools, clock, self.hints, self.membership, self.stats
        )

        def runner_for(jobs: Catalog) -> Runner:
            return Runner(
                cfg,
                self.store,
                self.bucket,
                self.index,
                self.fetcher,
                self.haves,
                self.stats,
                self.pools,
                clock,
                jobs=jobs,
                foreign=foreign,
            )

        def forgot(job: SnapshotJob) -> None:  # a job's chunks left the index
            wire.forget(job)
            if chunk_log is not None:
                chunk_log.drop(job)

        # The replica view reads the catalog, and the catalog asks the replica what GC keeps and
        # tells it of every job change: the catalog's two hooks reach the view built right below.
        self.catalog = Catalog(
            cfg,
            self.store,
            self.index,
            runner_for,
            clock,
            pinned=lambda: self.replica.pinned(),
            on_change=lambda job: self.replica.on_job_changed(job),
            on_forget=forgot,
        )
        runner = self.catalog.runner
        link = CurrentLink(self.store.root).point

        def on_current(identity: str) -> None:
            link(identity)
            runner.on_served(identity)  # the spare it frees is brought forward in the background

        engines_file = self.store.root / registry.FILE_NAME

        written = [b""]

        def on_engines(engines: list[Engine], target: Target | None) -> None:
            data = registry.encode(engines, target.wire() if target is not None and target.seq > 0 else None)
            if data == written[0]:
                return
            try:
                registry.save(engines_file, data)
                written[0] = data
            except OSError as e:  # a restart then forgets the engines, as before the table was kept
                runner.repeat.log(logging.WARNING, "engines", "cannot save the engine table: %s", e)

        self.replica = ReplicaView(
            cfg.node_id,
            self.catalog,
            clock,
            self.hints,
            engine_ttl_s=cfg.engine_ttl_s,
            engine_stale_s=cfg.engine_stale_s,
            changes=ChangedTensorsCache(self.catalog.ready_dir, sparse=runner.forward),
            on_current=on_current,
            on_engines=on_engines,
        )
        self.hotload = HotLoad(
            cfg.node_id,
            self.replica,
            self.catalog,
            self.bucket,
            self.peers,
            self.membership,
            self.stats,
            clock,
            cfg,
            self.hints,
        )
        self.problems = Problems(clock)  # misconfigurations noticed (readiness, metrics, the log)
        self.gossip = Gossip(cfg, self.membership, self.peers, self.replica, clock, self.stats, self.problems)
        self.serving = ChunkServing(
            cfg.node_id,
            self.catalog,
            self.index,
            self.fetcher,
            self.membership,
            Uploads(cfg.max_uploads, cfg.uploads_per_chunk),
            self.stats,
            RateLimit.from_mbit(cfg.peer_upload_mbit),
            growing=wire.growing if cfg.cut_through else None,
        )
        self.readiness = Readiness(
            cfg.node_id,
            self.bucket,
            self.catalog,
            self.replica,
            clock,
            self.problems,
            lambda: len(self.membership.live()),
            cfg.bucket,
        )
        self.checks = ChunkCheck(
            self.index,
            self.catalog,
            self.stats,
            self.pools.disk,
            RateLimit.from_mbit(cfg.scrub_mbit) if cfg.scrub_mbit > 0 else None,
            cfg.log_repeat_s,
            scrub_pool=self.pools.background,
        )
        self.services = Services(
            cfg=cfg,
            keys=self.keys,
            nonces=NonceCache(),
            catalog=self.catalog,
            replica=self.replica,
            hotload=self.hotload,
            gossip=self.gossip,
            serving=self.serving,
            status=StatusView(
                cfg,
                self.keys.swarm_id,
                self.membership,
                self.bucket,
                self.stats,
                self.catalog,
                clock,
                buffers=self.fetcher.sources.buffers,
            ),
            metrics=Metrics(self.stats, self.catalog, self.membership, self.bucket, self.replica, self.readiness),
            readiness=self.readiness,
            checks=self.checks,
        )
        self.should_exit = asyncio.Event()
        self._tasks: list[asyncio.Task[Any]] = []
        self._kept: Target | None = None  # the hot-load target the last run kept (startup reads it)
        self._runners: list[web.AppRunner] = []

    # ---- signals -------------------------------------------------------------------------
    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.handle_exit, sig)
        loop.add_signal_handler(signal.SIGHUP, self._ignore_hup)

    def handle_exit(self, sig: int) -> None:
        if self.should_exit.is_set():
            log.warning("bdnd %s: %s again while stopping: exiting now", self.cfg.node_id, signal.Signals(sig).name)
            os._exit(1)
        self.should_exit.set()

    def _ignore_hup(self) -> None:
        log.info("SIGHUP ignored: bdnd has no configuration reload; restart it to apply a new configuration")

    # ---- life ----------------------------------------------------------------------------
    async def serve(self) -> int:
        """Run until SIGTERM/SIGINT; 0. Raises CannotListen (a port cannot be bound)."""
        self.install_signal_handlers()
        # asyncio.to_thread's pool: asyncio.Runner.close would wait for its threads without a bound
        asyncio.get_running_loop().set_default_executor(NoWaitExecutor(thread_name_prefix="bdn-default"))
        try:
            starting = asyncio.create_task(self.startup(), name="startup")
            stop = asyncio.create_task(self.should_exit.wait())
            await asyncio.wait({starting, stop}, return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            if not starting.done():
                starting.cancel()  # a stop request while settling: shut down from where it is
                await asyncio.gather(starting, return_exceptions=True)
            elif (failed := starting.exception()) is not None:
                raise failed  # CannotListen: main exits 2
            await self.main_loop()
            return 0
        finally:
            await self.shutdown()

    async def startup(self) -> None:
        """Open, listen, settle, load (see the module docstring). Raises CannotListen."""
        await self.peers.start()
        await self.catalog.load_ready_from_store()
        # the engines registered before a restart, under their ids, before the local API answers
        engines, target = registry.load(self.store.root / registry.FILE_NAME, MAX_ENGINES)
        for r in engines:
            self.replica.register_engine(r.name, r.acked, r.engine_id, r.offered)
        # a hot-load accepted before the restart: the target again once membership settled
        self._kept = Target.from_wire(target, self.clock.time_ns()) if target is not None else None
        # before the first membership message, so every peer learns our transfer address with
        # our first entry (an address learned later is a change of its own)
        with binding("transfer_listen", self.cfg.transfer_listen):  # raises only when explicit
            self.gossip.transfer_listening(self.wire.start(asyncio.get_running_loop(), self.serving, self.catalog))
        self._tasks.append(asyncio.create_task(self.gossip.loop(), name="membership"))
        self._tasks.append(asyncio.create_task(self.hotload.status.loop(), name="fleet-status"))
        self._tasks.append(asyncio.create_task(self.stats.loop_lag.run(), name="loop-lag"))
        self._tasks.append(asyncio.create_task(self.replica.expiry_loop(), name="engine-expiry"))
        self._tasks.append(asyncio.create_task(self.checks.run(), name="chunk-reports"))
        if self.cfg.memory_probe_dir:
            probe = MemProbe(
                Path(self.cfg.memory_probe_dir),
                self.cfg.memory_probe_every_s,
                frames=8,
                top=20,
                census=self.census,
                trace=self.cfg.memory_probe_trace,
            )
            self._tasks.append(asyncio.create_task(probe.run(), name="memory-probe"))
        if self.checks.scrub is not None:
            self._tasks.append(asyncio.create_task(self.checks.scrub_loop(), name="scrub"))
        await self._listen()
        self.readiness.listening_now()
        cfg = self.cfg
        log.info(
            "bdnd %s listening: peers on %s (advertised %s), transfer on %s, local API on %s%s; swarm %s; bucket %s",
            cfg.node_id,
            cfg.peer_listen,
            cfg.advertise_url,
            self.gossip.transfer or "- (off)",
            cfg.local_listen or "-",
            f" and {cfg.local_socket}" if cfg.local_socket else "",
            self.keys.swarm_id,
            cfg.bucket,
        )
        if not cfg.api_token:
            log.info("no api_token: the fleet hot-load API answers on the local API only (401 on the peer port)")
        await self._load_startup()
        self.readiness.startup_done()
        line = self.readiness.summary(await self.readiness.check())
        if line != "ready":
            log.warning("bdnd %s is %s", cfg.node_id, line)  # e.g. a bucket directory that does not exist
        self.notify(f"READY=1\nSTATUS={line}")
        self._tasks.append(asyncio.create_task(self.readiness.watch(self.notify, line), name="readiness"))

    async def _listen(self) -> None:
        cfg = self.cfg
        # keepalive_timeout bounds idle connections; the guard (http/guard.py) bounds unfinished
        # requests (http_header_timeout_s), open connections and answers bad headers in one line.
        guard: dict[str, Any] = dict(
            header_timeout_s=cfg.http_header_timeout_s,
            max_connections=cfg.http_max_connections,
            stats=self.stats,
            max_line_size=8190,
            max_field_size=8190,
            max_headers=128,
        )
        peer_runner = GuardedRunner(
            make_peer_app(self.services),
            name="peer API",
            access_log=None,
            keepalive_timeout=15,
            shutdown_timeout=HTTP_GRACE_S,
            **guard,
        )
        await peer_runner.setup()
        self._runners.append(peer_runner)
        host, port = split_hostport(cfg.peer_listen)
        with binding("peer_listen", cfg.peer_listen):
            await web.TCPSite(peer_runner, host or None, port, reuse_address=True).start()
        local_runner = GuardedRunner(
            make_local_app(self.services),
            name="local API",
            access_log=None,
            keepalive_timeout=75,
            shutdown_timeout=HTTP_GRACE_S,
            **guard,
        )
        await local_runner.setup()
        self._runners.append(local_runner)
        if cfg.local_listen:
            lhost, lport = split_hostport(cfg.local_listen)
            with binding("local_listen", cfg.local_listen):
                await web.TCPSite(local_runner, lhost, lport, reuse_address=True).start()
        if cfg.local_socket:
            clear_unix_socket(cfg.local_socket)  # a stale one goes; one in use: CannotListen
            with binding("local_socket", cfg.local_socket):
                await web.UnixSite(local_runner, cfg.local_socket).start()

    async def _load_startup(self) -> None:
        """Membership settles, then what this replica serves is decided: the fleet's target if
        its peers hold a hot-loaded one, else the hot-load target it kept across a restart
        (``registry.py``), else the one it served, or was moving its engines to, before a
        restart (``_offered_before``, else the ``current`` link, when that snapshot is still
        ready here), else STARTUP_SNAPSHOT.

        Daemons of a fleet start within seconds of each other; loading before they know each
        other would make each one the HRW owner of everything and multiply bucket egress.
        The first choice is made before the settling, so that it is this replica's target (and
        safe from GC) even if a peer makes this daemon join it before the settling ends.
        """
        kept = self._kept
        served = self._offered_before() or self._served_before()
        startup = await self._read_startup() if self.cfg.load_startup else None
        first = (kept.identity if kept is not None else None) or served or startup
        if first is not None:
            self.replica.set_startup_target(first)
        await self.gossip.settle()
        if kept is not None:  # (adopted once settled: its load must not start before membership)
            await self.replica.adopt(kept, "the table kept across a restart")
        target = self.replica.target
        if first is not None and target is not None and target.identity != first and target.seq > 0:
            # The fleet moved on while this daemon was away: go straight to its target (rebuilt
            # chunks come from peers); loading the outdated startup snapshot first is only waste.
            log.info(
                "%s names %s, but the fleet serves %s: loading that instead",
                "current" if served else STARTUP_NAME,
                first,
                target.identity,
            )
        elif served is not None:
            # A restart (or a lone daemon's) serves what it served: a hot-load is not undone by
            # a restart (README "Rebuilt snapshots", docs/OPERATIONS.md section 4)
            log.info(
                "current names %s, ready here: serving it again%s",
                served,
                f" ({STARTUP_NAME} names {startup}: not loaded)" if startup and startup != served else "",
            )
            self.replica.on_snapshot_ready(served)
        elif startup is not None:
            log.info("%s names %s: loading it", STARTUP_NAME, startup)
            job = self.catalog.prefetch(startup, requested_by="startup")
            if job.state == "ready":
                self.replica.on_snapshot_ready(startup)
        for ident in sorted(self.catalog.resumable):
            log.info("snapshot %s: resuming the download a restart interrupted", ident)
            self.catalog.prefetch(ident, requested_by="resume")
        if self.cfg.peers_dns:
            self._tasks.append(asyncio.create_task(self.gossip.dns_loop(), name="peers-dns"))

    def _offered_before(self) -> str | None:
        """The snapshot the engines restored at start were offered and had not all acknowledged
        (the hot-load target when the daemon stopped), if it is ready here; else None. Some
        engines may serve it already: the ``current`` link names the snapshot before it."""
        offered = {e.offered for e in self.replica.engines.values() if e.offered and e.offered != e.acked}
        if len(offered) != 1:
            return None
        (ident,) = offered
        job = self.catalog.get(ident)
        return ident if job is not None and job.state == "ready" else None

    def _served_before(self) -> str | None:
        """The identity the ``current`` link names if that snapshot is ready on this node (a
        restarted daemon), else None (no link, or it names a snapshot collected or removed)."""
        link = CurrentLink(self.store.root)
        why = link.problem()
        if why is not None:  # someone else's directory or file: reported, never removed
            log.error("%s", why)
            return None
        ident = link.target()
        if ident is None:
            return None
        job = self.catalog.get(ident)
        if job is None or job.state != "ready":
            log.info("current names %s, which is not ready here: not serving it again", ident)
            return None
        return ident

    async def _read_startup(self) -> str | None:
        """The identity STARTUP_SNAPSHOT names, or None (absent or unreadable: logged)."""
        try:
            data = await self.bucket.read_unbounded(STARTUP_NAME)
        except ObjectNotFound:
            log.info("no %s in %s: nothing to load at start", STARTUP_NAME, self.cfg.bucket)
            return None
        except BucketError as e:
            log.error("cannot read %s: %s", STARTUP_NAME, e)
            return None
        try:
            return parse_startup(data)
        except ProtocolError as e:
            log.error("%s: %s", STARTUP_NAME, e)
            return None

    async def main_loop(self) -> None:
        await self.should_exit.wait()

    def census(self) -> dict[str, int]:
        """Sizes (entries) of the long-lived structures that grow with snapshots, peers, engines or
        requests, for the memory probe (``bdn/daemon/observe/memprobe.py``); ``pool_kb`` in KiB."""

        def n(obj: Any, attr: str) -> int:
            return len(getattr(obj, attr, ()))

        f, r = self.fetcher, self.replica
        return {
            "jobs": n(self.catalog, "jobs"),
            "collected": n(self.catalog, "collected"),
            "failed_holding_manifest": sum(1 for j in self.catalog.jobs.values() if j.state == "failed" and j.manifest),
            "resumable": n(self.catalog, "resumable"),
            "hints": n(self.hints, "_by_identity"),
            "engines": n(r, "engines"),
            "leases": n(r, "leases"),
            "claims_voided": n(r.claims, "voided"),
            "changes_done": n(r.changes, "_done"),
            "changes_ranges": n(r.changes, "_ranges"),
            "members": n(self.membership, "members"),
            "verify_failures_by_peer": n(self.stats, "verify_failures_by_peer"),
            "haves": n(self.haves, "_by_identity"),
            "haves_synced": n(self.haves, "_synced"),
            "haves_growing": n(self.haves, "_growing"),
            "owner_tables": n(f.owners, "_tables"),
            "checks_recent": n(self.checks, "_recent"),
            "problems": n(self.problems, "_active"),
            "board_rows": n(self.hotload.status.board, "_rows"),
            "pool_buffers": getattr(f.sources.pool, "_count", 0),
            "pool_kb": getattr(f.sources.pool, "_bytes", 0) >> 10,
            "receive_buffers": f.sources.buffers()["receive_buffers"],
            "tasks": len(asyncio.all_tasks()),
            "threads": threading.active_count(),
            "gc_objects": len(gc.get_objects()),
        }

    async def shutdown(self) -> None:
        """Stop within ``shutdown_timeout_s`` (``bdn.daemon.process.shutdown``): stop accepting
        connections, cancel the tasks and jobs (each saves its progress; long-polls answer at
        once), give requests still in flight ``HTTP_GRACE_S``, close clients and pools (their
        threads are not waited for here)."""
        if self.should_exit.is_set():
            log.info("bdnd %s stopping", self.cfg.node_id)
            self.notify("STOPPING=1")
        self.stop_clock.start(self.cfg.shutdown_timeout_s)
        target.STOPPING.set()  # a disk worker filling a big target's page tables stops there
        for r in self._runners:  # no new connections; the requests in flight go on for now
            for site in list(r.sites):
                await site.stop()
        await self.gossip.close()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.haves.close()  # HAVE subscriptions end with the fetches in flight
        self.wire.close_client()  # fetches in flight end now, so the jobs stop at once
        # Before the HTTP servers: a request held for a job (a peer's have long-poll, a /wait
        # long-poll) would otherwise keep its listener open while the download goes on.
        await self.catalog.stop()
        # what is still in flight gets HTTP_GRACE_S, then is cancelled (both listeners at once)
        await asyncio.gather(*(r.cleanup() for r in self._runners))
        self.wire.close()
        if self.chunk_log is not None:
            self.chunk_log.close()
        await self.peers.close()
        self.pools.shutdown()
        self.bucket.close()
