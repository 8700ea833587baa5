"""The node: one daemon's snapshots, chunk index, swarm membership and transfers.

How a chunk is obtained (DESIGN.md, "Moving chunks"), in order: this node's own store (the same
digest may already sit in another snapshot); peers whose have-bitfields show it; the chunk's HRW
owner, asked with ``?wait=`` so the request waits while the owner fetches it (single-flight); the
next owners by HRW score; and last the bucket. Only the owner's bucket reads are expected: every
other bucket read is counted as a fallback. Every chunk is hashed (xxh3-128) and compared with the
manifest in a worker thread before it is written to the snapshot's file or served.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import mmap
import os
import random
import shutil
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bdn.bucket import BucketError, ObjectNotFound, open_bucket
from bdn.daemon import logctx
from bdn.daemon.bitfield import Bitfield
from bdn.daemon.config import Config
from bdn.daemon.membership import Member, Membership
from bdn.daemon.peer_client import PeerBusy, PeerClient, PeerError
from bdn.daemon.ratelimit import RateLimit
from bdn.daemon.snapshot import RESULT, STORED, TERMINAL, Loc, SnapshotJob
from bdn.daemon.store import Store
from bdn.proto import hrw
from bdn.proto.chunks import digest as xxh3_digest
from bdn.proto.errors import BdnError, ProtocolError
from bdn.proto.identity import validate_identity
from bdn.proto.keys import NonceCache, derive_keys
from bdn.proto.manifest import MANIFEST_NAME, STARTUP_NAME, ChunkRef, FileEntry, Manifest, parse_startup

log = logging.getLogger("bdn.node")


class NotAvailable(BdnError):
    """No source could supply a chunk (message says which and why)."""


class BufferPool:
    """Reusable chunk buffers, so receiving a chunk allocates nothing on the hot path."""

    def __init__(self, keep: int) -> None:
        self._free: dict[int, list[bytearray]] = {}
        self._keep = keep

    def get(self, size: int) -> bytearray:
        lst = self._free.get(size)
        return lst.pop() if lst else bytearray(size)

    def put(self, buf: bytearray) -> None:
        lst = self._free.setdefault(len(buf), [])
        if len(lst) < self._keep:
            lst.append(buf)


def _verify_and_write(buf: memoryview, want: str, path: Path, offset: int) -> bool:
    """Hash ``buf``; write it at ``offset`` of ``path`` only if the digest matches."""
    if xxh3_digest(buf) != want:
        return False
    fd = os.open(path, os.O_WRONLY)
    try:
        pos = 0
        while pos < len(buf):
            pos += os.pwrite(fd, buf[pos:], offset + pos)
    finally:
        os.close(fd)
    return True


def _copy_range(src: Path, src_off: int, dst: Path, dst_off: int, length: int, want: str) -> bool:
    """Copy a chunk already on this node into another file, re-verifying it on the way."""
    with open(src, "rb") as f:
        data = os.pread(f.fileno(), length, src_off)
    if len(data) != length:
        return False
    return _verify_and_write(memoryview(data), want, dst, dst_off)


class Node:
    """Everything one ``bdnd`` holds. Create, ``await start()``, ``await stop()``."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.keys = derive_keys(cfg.partition_secret)
        self.node_id = cfg.node_id
        self.store = Store(cfg.shm_dir, self.keys.swarm_id)
        self.bucket = open_bucket(
            cfg.bucket,
            credentials_file=cfg.credentials_file or None,
            endpoint_url=cfg.endpoint_url or None,
            max_concurrency=cfg.bucket_concurrency,
        )
        self.membership = Membership(cfg.node_id, cfg.advertise_url, cfg.peers)
        self.peers = PeerClient(self.keys, cfg.node_id, cfg.peer_timeout_s)
        self.nonces = NonceCache()
        self.jobs: dict[str, SnapshotJob] = {}
        self.by_address: dict[str, Loc] = {}
        self.by_digest: dict[str, Loc] = {}
        self.pending: dict[str, tuple[SnapshotJob, str, ChunkRef]] = {}
        self._addr_waiters: dict[str, asyncio.Event] = {}
        self.peer_haves: dict[str, dict[str, tuple[Bitfield, Bitfield]]] = {}
        self.pool = BufferPool(keep=cfg.max_inflight + cfg.bucket_concurrency)
        self.io = ThreadPoolExecutor(max_workers=cfg.bucket_concurrency + 8, thread_name_prefix="bdn-io")
        self.bucket_sem = asyncio.Semaphore(cfg.bucket_concurrency)
        self.peer_sem = asyncio.Semaphore(cfg.max_inflight)
        self.upload_sem = asyncio.Semaphore(cfg.max_uploads)
        self.upload_limit = RateLimit.from_mbit(cfg.peer_upload_mbit)
        self.download_limit = RateLimit.from_mbit(cfg.peer_download_mbit)
        self.bucket_limit = RateLimit.from_mbit(cfg.bucket_mbit)
        self._peer_sems: dict[str, asyncio.Semaphore] = {}
        self.resumable: set[str] = set()
        self.collected: set[str] = set()  # identities GC removed: old, not re-joined for peers
        self.counters: dict[str, int] = {
            "bucket_bytes_owner": 0,
            "bucket_bytes_fallback": 0,
            "bucket_chunks_owner": 0,
            "bucket_chunks_fallback": 0,
            "bucket_manifest_bytes": 0,
            "peer_bytes_in": 0,
            "peer_bytes_out": 0,
            "peer_chunks_in": 0,
            "peer_chunks_out": 0,
            "local_bytes_copied": 0,
            "chunk_verify_failures": 0,
        }
        self.verify_failures_by_peer: dict[str, int] = {}
        self.inflight = {"peer": 0, "bucket": 0, "upload": 0}  # requests in flight, for metrics
        self._busy_answers = 0  # 503s received from peers (upload slots full, still fetching)
        self.uploads_by_address: dict[str, int] = {}  # chunk uploads in progress, per chunk
        self.started = time.time()
        from bdn.daemon.hotload import HotLoad

        self.hotload = HotLoad(self)
        self._tasks: list[asyncio.Task[Any]] = []
        self._closing = False

    # ---- life ----------------------------------------------------------------------------
    async def start(self) -> None:
        """Open the peer client, register ready snapshots from shm, start membership rounds."""
        await self.peers.start()
        self._load_ready_from_store()
        self._tasks.append(asyncio.create_task(self._membership_loop(), name="membership"))

    async def after_listen(self) -> None:
        """Called once both servers listen: membership settles, then STARTUP_SNAPSHOT loads.

        Daemons of a fleet start within seconds of each other; loading before they know each
        other would make each one the HRW owner of everything and multiply bucket egress. So the
        first rounds run every 0.25 s until every static peer answered or ``startup_settle_s``
        passed (peers that are really down just cost that much delay). STARTUP_SNAPSHOT is read
        first, so that it is this replica's target (and safe from GC) even if a peer makes this
        daemon join it before the settling ends.
        """
        startup = await self._read_startup() if self.cfg.load_startup else None
        if startup is not None and self.hotload.target is None:
            from bdn.daemon.hotload import Target

            self.hotload.target = Target(startup, 0, "startup", "startup")
        deadline = time.monotonic() + self.cfg.startup_settle_s
        while True:
            await self._membership_round()
            static = [m for m in self.membership.members.values() if m.static]
            if all(m.alive for m in static) or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.25)
        target = self.hotload.target
        if startup is not None and target is not None and target.identity != startup and target.seq > 0:
            # The fleet moved on while this daemon was away: go straight to its target (rebuilt
            # chunks come from peers); loading the outdated startup snapshot first is only waste.
            log.info("%s names %s, but the fleet serves %s: loading that instead",
                     STARTUP_NAME, startup, target.identity)
        elif startup is not None:
            log.info("%s names %s: loading it", STARTUP_NAME, startup)
            job = self.prefetch(startup, requested_by="startup")
            if job.state == "ready":
                self.hotload.on_snapshot_ready(startup)
        for ident in sorted(self.resumable):
            log.info("snapshot %s: resuming the download a restart interrupted", ident)
            self.prefetch(ident, requested_by="resume")
        if self.cfg.peers_dns:
            self._tasks.append(asyncio.create_task(self._dns_loop(), name="peers-dns"))

    async def stop(self) -> None:
        """Cancel every task and job (progress is saved), close the peer client and the bucket."""
        self._closing = True
        for t in self._tasks:
            t.cancel()
        for j in self.jobs.values():
            if j.task and not j.task.done():
                j.task.cancel()
        await asyncio.gather(*self._tasks, *(j.task for j in self.jobs.values() if j.task), return_exceptions=True)
        await self.peers.close()
        self.io.shutdown(wait=False, cancel_futures=True)
        self.bucket.close()

    def _load_ready_from_store(self) -> None:
        """Register the snapshots already READY in shm (a restarted daemon keeps serving them)."""
        # Downloads a restart cut short resume from their saved progress; other half-built
        # leftovers were never handed out and are removed.
        self.resumable = set(self.store.resumable())
        self.store.clean_staging(self.resumable)
        for info in self.store.list_ready():
            bad = self.store.check_sizes(info)
            if bad:
                # Never hand out a file that is not what READY describes; it is fetched again.
                log.error("snapshot %s in shm is damaged (%s): removed, it will be fetched again", info.identity, bad)
                self.store.remove(info.identity)
                continue
            job = SnapshotJob(info.identity, self.store)
            files = [FileEntry(f.path, f.size, f.chunks) for f in info.files]
            m = Manifest(
                identity=info.identity, kind="full", policy_version=info.policy_version,
                chunk_size=info.chunk_size, files=tuple(files),
            )
            job.attach_manifest(m)
            job.kind, job.base_identity = info.kind, info.base_identity
            job.stored.set_all()  # type: ignore[union-attr]
            job.result.set_all()  # type: ignore[union-attr]
            job.bytes_done = job.bytes_total
            job.requested_by = "store"
            job.set_state("ready")
            self.jobs[info.identity] = job
            for ref in job.result_refs:
                self._register(job, RESULT, ref)
            log.info("snapshot %s: ready from shm (%d bytes)", info.identity, info.total_bytes)

    # ---- membership ----------------------------------------------------------------------
    async def _membership_loop(self) -> None:
        while not self._closing:
            await asyncio.sleep(2.0 + random.random())
            try:
                await self._membership_round()
            except Exception:  # keep the loop alive whatever one round met
                log.exception("membership round failed")

    def _members_payload(self) -> dict[str, Any]:
        t = self.hotload.target
        return {
            "node_id": self.node_id,
            "url": self.cfg.advertise_url,
            "members": [{"node_id": m.node_id, "url": m.url} for m in self.membership.live()],
            "target": t.wire() if t is not None and t.seq > 0 else None,
        }

    async def _adopt_from(self, obj: Any, who: str) -> None:
        """A peer's hot-load target, seen in a membership exchange: adopt it if it is later."""
        from bdn.daemon.hotload import Target

        t = Target.from_wire(obj.get("target")) if isinstance(obj, dict) else None
        if t is not None and (self.hotload.target is None or t.order > self.hotload.target.order):
            await self.hotload.adopt(t, source=f"peer {who}")

    async def _membership_round(self) -> None:
        payload = self._members_payload()

        async def one(m: Member) -> None:
            try:
                ans = await self.peers.exchange_members(m.url, payload)
            except PeerError as e:
                if m.alive:
                    log.warning("peer %s: health check failed: %s", m.url, e, extra={"peer": m.node_id or m.url})
                elif "answered 401" in str(e) and not m.extra.get("warned_401"):
                    m.extra["warned_401"] = True
                    log.warning("peer %s refuses our signed requests (401): a different partition "
                                "secret, or a clock skew over 30 s", m.url)
                self.membership.mark_failed(m.url)
                return
            self.membership.mark_ok(m.url, ans["node_id"])
            await self._adopt_from(ans, m.url)
            for other in ans.get("members") or []:
                if isinstance(other, dict) and isinstance(other.get("url"), str):
                    self.membership.learn(other["url"], str(other.get("node_id") or ""))

        await asyncio.gather(*(one(m) for m in list(self.membership.members.values())))

    async def handle_members(self, body: Any) -> dict[str, Any]:
        """A peer's POST members: learn it and what it knows; answer with our view."""
        if isinstance(body, dict) and isinstance(body.get("url"), str) and isinstance(body.get("node_id"), str):
            await self._adopt_from(body, body["url"][:512])
            # The caller proved it holds the secret. A URL we already know (configured, or heard
            # of) is marked alive at once, so a fleet starting together agrees on owners quickly;
            # an unknown one is only learned, and counts once our own health check reaches it.
            url, nid = body["url"][:512].rstrip("/"), body["node_id"][:64]
            if url in self.membership.members:
                self.membership.mark_ok(url, nid)
            else:
                self.membership.learn(url, nid)
            others = body.get("members")
            for other in (others if isinstance(others, list) else [])[:256]:
                if isinstance(other, dict) and isinstance(other.get("url"), str):
                    self.membership.learn(other["url"][:512], str(other.get("node_id") or "")[:64])
        else:
            raise ProtocolError("members body must have node_id and url")
        return self._members_payload()

    # ---- snapshots -----------------------------------------------------------------------
    def prefetch(self, identity: str, requested_by: str = "local") -> SnapshotJob:
        """Start (or return) the job that brings ``identity`` to ``ready`` on this node.

        A failed job is retried from scratch. Raises IdentityError for a bad identity.
        """
        validate_identity(identity)
        job = self.jobs.get(identity)
        if job is not None and job.state != "failed":
            return job
        self.collected.discard(identity)
        if job is not None:
            self._forget(job)
        job = SnapshotJob(identity, self.store)
        job.requested_by = requested_by
        job.on_change = self._job_changed
        self.jobs[identity] = job
        job.task = asyncio.create_task(self._run(job), name=f"snapshot-{identity}")
        return job

    async def wait_state(self, identity: str, state: str, timeout: float) -> SnapshotJob | None:
        """The job once it reaches ``state`` or a terminal state, or after ``timeout`` s; None if unknown."""
        job = self.jobs.get(identity)
        if job is None:
            return None
        deadline = time.monotonic() + timeout
        while job.state != state and job.state not in TERMINAL:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            await job.wait_change(job.version, left)
            job = self.jobs.get(identity, job)
        return job

    async def _job_changed(self, job: SnapshotJob) -> None:
        if job.state == "ready":
            self.hotload.on_snapshot_ready(job.identity)
        await self.hotload.poke()

    def _forget(self, job: SnapshotJob) -> None:
        """Drop ``job``'s chunks from the index. Bytes that other snapshots on this node hold
        too (an unchanged tokenizer, a shared chunk) stay served from one of those."""
        lost: set[str] = set()
        for addr, loc in list(self.by_address.items()):
            if loc.job is job:
                del self.by_address[addr]
                lost.add(loc.digest)
        for dg, loc in list(self.by_digest.items()):
            if loc.job is job:
                del self.by_digest[dg]
                lost.add(dg)
        if lost:
            for other in self.jobs.values():
                if other is job or other.state == "failed":
                    continue
                for layer, ref in other.registered:
                    if ref.digest in lost and ref.digest not in self.by_digest:
                        loc = Loc(other, layer, ref.file_index, ref.offset, ref.length, ref.digest)
                        self.by_digest[ref.digest] = loc
                        self.by_address.setdefault(self.keys.address(ref.digest), loc)
        for addr, (j, _, _) in list(self.pending.items()):
            if j is job:
                del self.pending[addr]

    async def _run(self, job: SnapshotJob) -> None:
        logctx.SNAPSHOT.set(job.identity)  # every line this task (and its children) logs names it
        try:
            m = await self._read_manifest(job)
            job.attach_manifest(m)
            loop = asyncio.get_running_loop()
            saved = self.store.load_progress(m.identity, job.manifest_digest)
            if saved is not None:
                await self._resume(job, saved)
            else:
                self._check_budget(m)
                await loop.run_in_executor(self.io, self.store.prepare_staging, m)
            flusher = asyncio.create_task(self._progress_flusher(job))
            job.flusher = flusher
            for ref in job.stored_refs:
                self.pending.setdefault(self.keys.address(ref.digest), (job, STORED, ref))
            job.set_state("downloading")
            await job.notify()
            log.info("snapshot %s: %s, %d files, %d stored bytes", job.identity, m.kind, len(m.files), m.stored_bytes)
            if m.is_delta:
                await self._run_delta(job, m)
            else:
                await self._fetch_layer(job, STORED)
                job.result.set_all()  # type: ignore[union-attr]  # full: stored == result
                job.set_state("verifying")
                await job.notify()
            final = await asyncio.get_running_loop().run_in_executor(self.io, self.store.publish, m)
            job.set_state("ready")
            log.info("snapshot %s: ready at %s (stages %s)", job.identity, final,
                     {k: round(v, 3) for k, v in job.stages.items()})
            self.gc()
        except asyncio.CancelledError:
            self._save_progress(job)  # a clean stop resumes like a crash, from what is verified
            raise
        except (BdnError, OSError) as e:
            reason = str(e) if isinstance(e, BdnError) else f"{type(e).__name__}: {e}"
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                reason = f"shm full while writing {job.identity!r}: {self.store.free_bytes()} bytes free on {self.store.root} ({e.strerror})"
            job.set_state("failed", reason.splitlines()[0] if reason else type(e).__name__)
            log.error("snapshot %s: failed: %s", job.identity, job.reason)
            self._forget(job)
            self.store.discard(job.identity)
        except Exception as e:  # a bug must fail the snapshot, not kill the daemon
            log.exception("snapshot %s: internal error", job.identity)
            job.set_state("failed", f"internal error: {type(e).__name__}: {e}")
            self._forget(job)
            self.store.discard(job.identity)
        finally:
            if getattr(job, "flusher", None) is not None:
                job.flusher.cancel()
            for ref in job.stored_refs:
                addr = self.keys.address(ref.digest)
                if self.pending.get(addr, (None,))[0] is job:
                    del self.pending[addr]
            await job.notify()

    def _check_budget(self, m: Manifest) -> None:
        """Fail early, with the numbers, when the snapshot would not fit the shm budget."""
        budget = self.cfg.shm_budget_bytes
        if budget <= 0:
            return
        need = self.store.space_needed(m)

        def used() -> int:
            return sum(
                self.store.space_needed(j.manifest)
                for j in self.jobs.values()
                if j.manifest is not None and j.identity != m.identity and j.state != "failed"
            )

        if used() + need > budget:
            self.gc()
        u = used()
        if u + need > budget:
            holders = ", ".join(sorted(j.identity for j in self.jobs.values() if j.manifest is not None and j.identity != m.identity and j.state != "failed"))
            raise BdnError(
                f"shm budget exceeded: snapshot {m.identity!r} needs {need} bytes; budget "
                f"{budget}, {u} in use by {holders or 'nothing'} (leased, current or in progress)"
            )

    async def _resume(self, job: SnapshotJob, saved: tuple[bytes, bytes]) -> None:
        """Take back the chunks a previous run wrote, re-verifying each against the manifest."""
        try:
            stored, result = Bitfield(len(job.stored_refs), saved[0]), Bitfield(len(job.result_refs), saved[1])
        except ValueError as e:  # a progress file that does not fit the manifest: start over
            log.warning("snapshot %s: saved progress ignored: %s", job.identity, e)
            self._check_budget(job.manifest)  # type: ignore[arg-type]
            await asyncio.get_running_loop().run_in_executor(self.io, self.store.prepare_staging, job.manifest)
            return

        def verify(layer: str, refs: list[ChunkRef], bits: Bitfield) -> list[int]:
            good = []
            for i, ref in enumerate(refs):
                if not bits[i]:
                    continue
                try:
                    with open(job.file_path(layer, ref.file_index), "rb") as f:
                        data = os.pread(f.fileno(), ref.length, ref.offset)
                except OSError:
                    continue
                if len(data) == ref.length and xxh3_digest(data) == ref.digest:
                    good.append(i)
            return good

        loop = asyncio.get_running_loop()
        ok_s = await loop.run_in_executor(self.io, verify, STORED, job.stored_refs, stored)
        ok_r = await loop.run_in_executor(self.io, verify, RESULT, job.result_refs, result)
        for i in ok_s:
            job.stored.set(i)  # type: ignore[union-attr]
            self._register(job, STORED, job.stored_refs[i])
        for i in ok_r:
            job.result.set(i)  # type: ignore[union-attr]
            self._register(job, RESULT, job.result_refs[i])
        job.bytes_done = sum(job.stored_refs[i].length for i in ok_s)
        job.bytes_resumed = job.bytes_done
        log.info("snapshot %s: resumed with %d of %d stored chunks verified on disk",
                 job.identity, len(ok_s), len(job.stored_refs))

    def _save_progress(self, job: SnapshotJob) -> None:
        if job.manifest is None or job.stored is None or job.result is None or job.state in ("ready", "failed"):
            return
        try:
            self.store.save_progress(job.identity, job.manifest_digest, job.stored.to_bytes(), job.result.to_bytes())
        except OSError as e:
            log.warning("snapshot %s: cannot save progress: %s", job.identity, e)

    async def _progress_flusher(self, job: SnapshotJob) -> None:
        last = -1
        while True:
            await asyncio.sleep(self.cfg.progress_interval_s)
            if job.version != last:
                last = job.version
                self._save_progress(job)

    async def _dns_loop(self) -> None:
        """Learn every daemon behind ``peers_dns`` (e.g. a Kubernetes headless Service)."""
        from bdn.daemon.config import split_hostport

        host, port = split_hostport(self.cfg.peers_dns)
        loop = asyncio.get_running_loop()
        while not self._closing:
            try:
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
                for fam, _, _, _, addr in infos:
                    ip = addr[0]
                    url = f"http://[{ip}]:{port}" if fam == socket.AF_INET6 else f"http://{ip}:{port}"
                    m = self.membership.learn(url)
                    if m is not None:
                        m.static = True  # re-resolved: it stays a member until DNS drops it
            except OSError as e:
                log.warning("peers_dns %s: %s", self.cfg.peers_dns, e)
            await asyncio.sleep(self.cfg.peers_dns_interval_s)

    async def _read_manifest(self, job: SnapshotJob) -> Manifest:
        key = f"{job.identity}/{MANIFEST_NAME}"
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + self.cfg.manifest_wait_s
        while True:
            try:
                async with self.bucket_sem:
                    data = await loop.run_in_executor(self.io, self.bucket.read, key)
                break
            except ObjectNotFound:
                if not self.cfg.require_manifest:
                    raise BdnError(
                        f"snapshot {job.identity!r} has no {MANIFEST_NAME}; listing-based loading "
                        "(require_manifest = false) is not implemented yet"
                    ) from None
                if time.monotonic() >= deadline:
                    raise BdnError(
                        f"snapshot {job.identity!r} is not published: {MANIFEST_NAME} did not "
                        f"appear within {self.cfg.manifest_wait_s:g} s"
                    ) from None
                if not job.reason.startswith("waiting for manifest"):
                    job.reason = f"waiting for manifest: {key} is not in the bucket yet"
                    job.touch()
                    await job.notify()
                await asyncio.sleep(self.cfg.manifest_poll_s)
        self.counters["bucket_manifest_bytes"] += len(data)
        job.manifest_digest = xxh3_digest(data)
        return Manifest.from_json(data, expect_identity=job.identity)

    async def _run_delta(self, job: SnapshotJob, m: Manifest) -> None:
        assert m.base_identity is not None
        base_id = m.base_identity
        base = self.jobs.get(base_id)
        if base is None or base.state != "ready":
            # No base here: take the reconstructed chunks from peers that already rebuilt it
            # (content-addressed like any chunk), else walk the chain from the nearest anchor.
            if await self._refresh_haves(job, need_result=True):
                try:
                    await self._fetch_layer(job, RESULT)
                    job.stored.set_all()  # type: ignore[union-attr]
                    job.set_state("verifying")
                    return
                except NotAvailable as e:
                    log.info("snapshot %s: peers' reconstructed chunks not enough (%s); walking the chain", job.identity, e)
                    job.result = Bitfield(len(job.result_refs))
            base = self.prefetch(base_id, requested_by=f"base of {job.identity}")
        download = asyncio.create_task(self._fetch_layer(job, STORED))
        try:
            base = await self._await_job(base)
        except BaseException:
            download.cancel()
            raise
        await download
        if base.state != "ready":
            raise BdnError(f"base snapshot {base_id!r} failed: {base.reason}")
        job.set_state("applying")
        await job.notify()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self.io, self._apply_delta, job, m, self.store.ready_dir(base_id))
        job.set_state("verifying")
        await job.notify()
        await loop.run_in_executor(self.io, self._verify_results, job, m)
        for ref in job.result_refs:
            self._register(job, RESULT, ref)

    async def _await_job(self, job: SnapshotJob) -> SnapshotJob:
        while job.state not in TERMINAL:
            await job.wait_change(job.version, 5.0)
        return job

    def _apply_delta(self, job: SnapshotJob, m: Manifest, base_dir: Path) -> None:
        """target = base XOR diff per tensor into the staging files, Adler-32 checked per tensor."""
        from bdn.proto import arc
        from bdn.proto.safetensors_fmt import read_header

        st = self.store.staging_dir(m.identity)
        for fi, f in enumerate(m.files):
            if not f.is_diff:
                continue
            base_path = base_dir / f.path
            diff_path = self.store.stored_dir(m.identity) / f.path
            if not base_path.is_file():
                raise BdnError(f"base snapshot {m.base_identity!r} has no file {f.path!r} to apply the delta to")
            base_h = read_header(base_path)
            with open(base_path, "rb") as bf, open(diff_path, "rb") as df, open(st / f.path, "r+b") as of:
                dsize = os.fstat(df.fileno()).st_size
                with mmap.mmap(df.fileno(), 0, access=mmap.ACCESS_READ) as dm:
                    diff_h = arc.read_diff_header(dm, dsize)
                    want = arc.target_size(base_h, diff_h)
                    if want != f.result.size:  # type: ignore[union-attr]
                        raise ProtocolError(
                            f"{f.path}: delta rebuilds {want} bytes but the manifest says {f.result.size}"  # type: ignore[union-attr]
                        )
                    if f.result.size == 0:  # type: ignore[union-attr]
                        continue
                    with mmap.mmap(bf.fileno(), 0, access=mmap.ACCESS_READ) as bm, mmap.mmap(
                        of.fileno(), 0
                    ) as om:
                        arc.apply_diff(
                            bm, base_h, dm, diff_h, om, m.compression_format,
                            workers=self.cfg.apply_workers,
                        )
                        om.flush()

    def _verify_results(self, job: SnapshotJob, m: Manifest) -> None:
        """Every reconstructed chunk's xxh3-128 against the manifest's ``result`` digests."""
        st = self.store.staging_dir(m.identity)
        for fi, f in enumerate(m.files):
            if not f.is_diff or f.result_size == 0:
                continue
            with open(st / f.path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                for ci, want in enumerate(f.result_chunks):
                    off = ci * m.chunk_size
                    got = xxh3_digest(memoryview(mm)[off : off + m.chunk_size])
                    if got != want:
                        raise ProtocolError(
                            f"{f.path}: reconstructed chunk {ci} has digest {got}, manifest says {want}"
                        )
        job.result.set_all()  # type: ignore[union-attr]

    # ---- chunk index ---------------------------------------------------------------------
    def _register(self, job: SnapshotJob, layer: str, ref: ChunkRef) -> None:
        job.registered.append((layer, ref))
        loc = Loc(job, layer, ref.file_index, ref.offset, ref.length, ref.digest)
        addr = self.keys.address(ref.digest)
        self.by_address.setdefault(addr, loc)
        self.by_digest.setdefault(ref.digest, loc)
        ev = self._addr_waiters.pop(addr, None)
        if ev is not None:
            ev.set()

    def fetching(self, address: str) -> bool:
        """True while ``address`` is a chunk of a snapshot in progress here, not yet held."""
        pend = self.pending.get(address)
        return pend is not None and pend[0].state not in TERMINAL and address not in self.by_address

    def unindex(self, address: str) -> None:
        """Stop serving ``address`` (its bytes on disk turned out not to be what was indexed)."""
        loc = self.by_address.pop(address, None)
        if loc is not None and self.by_digest.get(loc.digest) is loc:
            del self.by_digest[loc.digest]

    def lookup(self, address: str) -> Loc | None:
        """The verified location of the chunk at swarm ``address`` on this node, or None."""
        return self.by_address.get(address)

    async def wait_for_address(self, address: str, wait: float, hint: str | None) -> Loc | None:
        """Hold a peer's chunk request up to ``wait`` s while this node obtains the chunk.

        If ``hint`` names a snapshot this node does not know yet, it joins it (the fleet wants it),
        unless this node already collected that snapshot as old: then it answers at once, and
        the asker goes on to its next source instead of waiting for bytes that will not come.
        If this node is the chunk's owner, it starts the fetch at once (single-flight with its own).
        """
        loc = self.by_address.get(address)
        if loc is not None or wait <= 0:
            return loc
        if hint and hint not in self.jobs and not self._closing:
            if hint in self.collected:
                return None
            self.prefetch(hint, requested_by="peer")
        pend = self.pending.get(address)
        if pend is not None:
            job, layer, ref = pend
            if hrw.owner(self.membership.hrw_nodes(), ref.digest) == self.node_id:
                asyncio.ensure_future(self._ensure_chunk(job, layer, ref)).add_done_callback(
                    lambda f: f.cancelled() or f.exception()
                )
        ev = self._addr_waiters.get(address)
        if ev is None:
            ev = self._addr_waiters[address] = asyncio.Event()
        try:
            await asyncio.wait_for(ev.wait(), wait)
        except asyncio.TimeoutError:
            pass
        return self.by_address.get(address)

    # ---- fetching ------------------------------------------------------------------------
    async def _fetch_layer(self, job: SnapshotJob, layer: str) -> None:
        """Obtain every chunk of ``layer``; owned chunks are started first (others wait on them)."""
        refs = job.stored_refs if layer == STORED else job.result_refs
        bits = job.stored if layer == STORED else job.result
        if job.fetch_layer != layer:
            job.fetch_layer = layer
            job.bytes_total = job.stored_bytes if layer == STORED else job.result_bytes
            job.bytes_done = sum(r.length for i, r in enumerate(refs) if bits[i])  # type: ignore[index]
        # Learn who already holds what before anything starts, so that a late joiner takes from
        # peers what they have rather than reading its own HRW share from the bucket.
        try:
            await asyncio.wait_for(self._refresh_haves(job), 5.0)
        except asyncio.TimeoutError:
            pass
        nodes = self.membership.hrw_nodes()
        todo = [r for i, r in enumerate(refs) if not bits[i]]  # type: ignore[index]
        todo.sort(key=lambda r: hrw.owner(nodes, r.digest) != self.node_id)
        poller = asyncio.create_task(self._have_poller(job))
        try:
            tasks = [asyncio.create_task(self._ensure_chunk(job, layer, r)) for r in todo]
            try:
                await asyncio.gather(*tasks)
            except BaseException:
                # The acquisitions run shielded (single-flight), so cancelling their waiters alone
                # would leave them running: writing into files this job abandons (result mode
                # falling back to the chain) and dying with unretrieved exceptions.
                acquiring = [f for (lay, _), f in list(job.inflight.items()) if lay == layer]
                for t in (*tasks, *acquiring):
                    t.cancel()
                await asyncio.gather(*tasks, *acquiring, return_exceptions=True)
                raise
        finally:
            poller.cancel()

    async def _have_poller(self, job: SnapshotJob) -> None:
        """Keep peers' have-bitfields for ``job`` fresh while it downloads."""
        while True:
            await asyncio.sleep(0.5)
            try:
                await self._refresh_haves(job)
            except Exception:
                log.debug("have refresh failed", exc_info=True)

    async def _refresh_haves(self, job: SnapshotJob, need_result: bool = False) -> bool:
        """Ask every live peer what it holds of ``job``; True if one holds every result chunk."""
        haves = self.peer_haves.setdefault(job.identity, {})
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
        # Result mode only pays off when some peer has rebuilt the whole target already.
        return any(r.complete for _, r in haves.values()) if need_result else False

    def _holders(self, job: SnapshotJob, layer: str, index: int) -> list[Member]:
        haves = self.peer_haves.get(job.identity, {})
        out = []
        for m in self.membership.live():
            h = haves.get(m.url)
            if h and (h[0] if layer == STORED else h[1]).n > index and (h[0] if layer == STORED else h[1])[index]:
                out.append(m)
        out.sort(key=lambda m: (m.inflight, random.random()))
        return out

    async def _ensure_chunk(self, job: SnapshotJob, layer: str, ref: ChunkRef) -> None:
        """Single-flight: one acquisition per chunk, however many ask for it."""
        key = (layer, self._ref_index(job, layer, ref))
        fut = job.inflight.get(key)
        if fut is None:
            fut = asyncio.ensure_future(self._acquire(job, layer, ref))
            job.inflight[key] = fut
            fut.add_done_callback(lambda _f: job.inflight.pop(key, None))
        await asyncio.shield(fut)

    @staticmethod
    def _ref_index(job: SnapshotJob, layer: str, ref: ChunkRef) -> int:
        refs = job.stored_refs if layer == STORED else job.result_refs
        # refs are in manifest order, so (file, chunk) -> position is a prefix sum; cache it.
        cache = job.__dict__.setdefault("_pos_" + layer, {})
        if not cache:
            for i, r in enumerate(refs):
                cache[(r.file_index, r.index)] = i
        return cache[(ref.file_index, ref.index)]

    async def _acquire(self, job: SnapshotJob, layer: str, ref: ChunkRef) -> None:
        idx = self._ref_index(job, layer, ref)
        bits = job.stored if layer == STORED else job.result
        if bits[idx]:  # type: ignore[index]
            return
        target = job.file_path(layer, ref.file_index)
        loop = asyncio.get_running_loop()
        # 0. the same bytes already on this node (e.g. an unchanged config.json)
        loc = self.by_digest.get(ref.digest)
        if loc is not None and loc.length == ref.length:
            ok = await loop.run_in_executor(
                self.io, _copy_range, loc.path(), loc.offset, target, ref.offset, ref.length, ref.digest
            )
            if ok:
                job.bytes_local += ref.length
                self.counters["local_bytes_copied"] += ref.length
                await self._got(job, layer, ref, idx, None)
                return
        address = self.keys.address(ref.digest)
        errors: list[str] = []
        # Three rounds over the sources before the bucket fallback; a round in which a peer
        # only said "busy" (503: upload slots full, or the owner still fetching it) does not
        # count, within ``owner_patience_s``: peers that are serving or fetching are better
        # than a second read of the bucket.
        attempt, busy_deadline = 0, time.monotonic() + self.cfg.owner_patience_s
        while attempt < 3:
            errors_before = len(errors)
            busy_before = self._busy_answers
            tried: set[str] = set()
            holders = self._holders(job, layer, idx)
            # Endgame: with only a few chunks left, ask two holders at once so one slow peer
            # cannot hold the whole snapshot back; the first verified copy wins.
            if len(holders) >= 2 and bits.n - bits.count <= self.cfg.endgame_chunks:  # type: ignore[union-attr]
                tried.update(m.url for m in holders[:2])
                winner = await self._race_peers(job, holders[:2], address, ref, target, errors)
                if winner is not None:
                    await self._got(job, layer, ref, idx, winner)
                    return
                holders = holders[2:]
            # 1. peers known to hold it, least loaded first
            for m in holders:
                tried.add(m.url)
                if await self._from_peer(job, m, address, ref, target, 0.0, errors):
                    await self._got(job, layer, ref, idx, m.url)
                    return
            # 2. the owner (waiting while it fetches), 3. the next owners, 4. the bucket;
            # rebuilt (result) chunks exist only on peers, never in the bucket.
            ranked = hrw.rank(self.membership.hrw_nodes(), ref.digest) if layer == STORED else []
            by_node = self.membership.by_node()
            for pos, node in enumerate(ranked):
                if node == self.node_id:
                    # The owner is the highest-ranked *live* node: when the ones ranked above
                    # this node died during this round (an owner killed mid-transfer), this
                    # read is the new owner's, not a fallback.
                    if pos == 0 or hrw.owner(self.membership.hrw_nodes(), ref.digest) == self.node_id:
                        await self._from_bucket(job, ref, target, owner=True)
                        await self._got(job, layer, ref, idx, "bucket")
                        return
                    # Not the owner: the nodes above only said "busy" or "not yet". Reading the
                    # bucket here would compete with the owners for its bandwidth and slow every
                    # node; go round again (busy rounds do not count) and fall back only after
                    # real failures.
                    break
                m = by_node.get(node)
                if m is None or m.url in tried:
                    continue
                tried.add(m.url)
                wait = self.cfg.chunk_wait_s if pos == 0 else 2.0
                if await self._from_peer(job, m, address, ref, target, wait, errors):
                    await self._got(job, layer, ref, idx, m.url)
                    return
            if self._busy_answers > busy_before and len(errors) == errors_before and time.monotonic() < busy_deadline:
                await asyncio.sleep(0.1 + random.random() * 0.4)  # jittered: slots free up
                continue
            attempt += 1
            await asyncio.sleep(0.2 * attempt)
        if layer == RESULT:
            raise NotAvailable(f"no peer holds reconstructed chunk {ref.index} of {ref.path}")
        # every peer failed: this node reads the bucket itself, as a counted fallback
        await self._from_bucket(job, ref, target, owner=False)
        await self._got(job, layer, ref, idx, "bucket")

    async def _race_peers(
        self, job: SnapshotJob, members: list[Member], address: str, ref: ChunkRef, target: Path,
        errors: list[str],
    ) -> str | None:
        """Request the chunk from each member at once; the url of the first verified copy."""
        tasks = {
            asyncio.ensure_future(self._from_peer(job, m, address, ref, target, 0.0, errors)): m
            for m in members
        }
        winner: str | None = None
        pending = set(tasks)
        try:
            while pending and winner is None:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    if not t.cancelled() and t.exception() is None and t.result():
                        winner = tasks[t].url
        finally:
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
        return winner

    async def _verify_write(self, buf: bytearray, ref: ChunkRef, target: Path) -> bool:
        """Hash and write ``buf`` on a worker thread; the buffer goes back to the pool after,
        unless this coroutine is cancelled while the thread may still use it."""
        try:
            ok = await asyncio.get_running_loop().run_in_executor(
                self.io, _verify_and_write, memoryview(buf), ref.digest, target, ref.offset
            )
        except asyncio.CancelledError:
            raise  # the thread may still read ``buf``: leave it to the garbage collector
        self.pool.put(buf)
        return ok

    async def _from_peer(
        self, job: SnapshotJob, m: Member, address: str, ref: ChunkRef,
        target: Path, wait: float, errors: list[str],
    ) -> bool:
        sem = self._peer_sems.get(m.url)
        if sem is None:
            sem = self._peer_sems[m.url] = asyncio.Semaphore(self.cfg.max_per_peer)
        m.inflight += 1
        try:
            async with sem, self.peer_sem:
                await self.download_limit.take(ref.length)
                self.inflight["peer"] += 1
                try:
                    # The buffer is taken only once the peer answers 200: a request parked at an
                    # owner (``wait``) holds no memory.
                    req = asyncio.ensure_future(self.peers.get_chunk(
                        m.url, address, ref.length, self.pool.get, wait=wait, snapshot=job.identity
                    ))
                    m.requests.add(req)
                    try:
                        buf = await req
                    except asyncio.CancelledError:
                        me = asyncio.current_task()
                        if me is not None and me.cancelling():
                            raise  # this acquisition itself is being cancelled
                        raise PeerError(f"{m.url}: left the swarm while the request waited") from None
                    finally:
                        m.requests.discard(req)
                        if not req.done():
                            req.cancel()
                finally:
                    self.inflight["peer"] -= 1
        except PeerBusy:
            self._busy_answers += 1
            return False
        except PeerError as e:
            errors.append(str(e))
            self.membership.mark_failed(m.url)
            return False
        finally:
            m.inflight -= 1
        if buf is None:
            return False
        good = await self._verify_write(buf, ref, target)
        if not good:
            self.counters["chunk_verify_failures"] += 1
            self.verify_failures_by_peer[m.node_id] = self.verify_failures_by_peer.get(m.node_id, 0) + 1
            self.membership.penalise(m.url, self.cfg.penalty_s)
            log.warning("snapshot %s: peer %s sent bad bytes for chunk %d of %s; penalised for %g s",
                        job.identity, m.node_id, ref.index, ref.path, self.cfg.penalty_s,
                        extra={"peer": m.node_id})
            return False
        job.bytes_from_peers += ref.length
        self.counters["peer_bytes_in"] += ref.length
        self.counters["peer_chunks_in"] += 1
        return True

    async def _from_bucket(self, job: SnapshotJob, ref: ChunkRef, target: Path, owner: bool) -> None:
        key = f"{job.identity}/{ref.path}"
        loop = asyncio.get_running_loop()
        for attempt in range(3):
            await self.bucket_limit.take(ref.length)
            async with self.bucket_sem:
                self.inflight["bucket"] += 1
                buf = self.pool.get(ref.length)
                try:
                    await loop.run_in_executor(self.io, self.bucket.read_range_into, key, ref.offset, memoryview(buf))
                except ObjectNotFound:
                    raise BdnError(f"bucket object {key} is missing (named by the manifest)") from None
                except BucketError as e:
                    raise BdnError(f"bucket read of {key} failed: {e}") from None
                finally:
                    self.inflight["bucket"] -= 1
            ok = await self._verify_write(buf, ref, target)
            if ok:
                role = "owner" if owner else "fallback"
                self.counters[f"bucket_bytes_{role}"] += ref.length
                self.counters[f"bucket_chunks_{role}"] += 1
                job.bytes_from_bucket += ref.length
                if not owner:
                    log.info("snapshot %s: chunk %d of %s read from the bucket as a fallback", job.identity, ref.index, ref.path)
                return
            self.counters["chunk_verify_failures"] += 1
            self.verify_failures_by_peer["bucket"] = self.verify_failures_by_peer.get("bucket", 0) + 1
            log.warning("snapshot %s: bucket bytes of %s chunk %d do not match the manifest", job.identity, key, ref.index)
        raise ProtocolError(f"{key}: chunk {ref.index} from the bucket does not match the manifest digest")

    async def _got(self, job: SnapshotJob, layer: str, ref: ChunkRef, idx: int, source: str | None) -> None:
        bits = job.stored if layer == STORED else job.result
        if bits.set(idx):  # type: ignore[union-attr]
            if layer == job.fetch_layer:
                job.bytes_done += ref.length
            if job.manifest is not None and not job.manifest.files[ref.file_index].is_diff:
                # stored == result for this file: the chunk counts in both layers
                other = job.result if layer == STORED else job.stored
                if other is not None and job.result_refs and other.n:
                    other.set(self._ref_index(job, RESULT if layer == STORED else STORED, ref))
            self._register(job, layer, ref)
            job.touch()
            await job.notify()

    # ---- startup snapshot ----------------------------------------------------------------
    async def _read_startup(self) -> str | None:
        """The identity STARTUP_SNAPSHOT names, or None (absent or unreadable: logged)."""
        loop = asyncio.get_running_loop()
        try:
            data = await loop.run_in_executor(self.io, self.bucket.read, STARTUP_NAME)
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

    # ---- garbage collection --------------------------------------------------------------
    def gc(self) -> dict[str, list[str]]:
        """Remove ready snapshots nobody needs; keep the newest ``keep_ready`` ready ones, every
        leased one, the current and target snapshots, and the base of any snapshot in progress."""
        keep: set[str] = set(self.hotload.leased())
        if self.hotload.current:
            keep.add(self.hotload.current)
        if self.hotload.target:
            keep.add(self.hotload.target.identity)
        for j in self.jobs.values():
            if j.state not in TERMINAL:
                keep.add(j.identity)
                if j.base_identity:
                    keep.add(j.base_identity)
        ready = sorted(
            (j for j in self.jobs.values() if j.state == "ready"),
            key=lambda j: (j.policy_version or 0, j.created),
            reverse=True,
        )
        keep.update(j.identity for j in ready[: self.cfg.keep_ready])
        # A snapshot that just became ready was wanted by someone (an operator's prefetch, a peer
        # still pulling it): it stays at least gc_grace_s, however old its policy version.
        now = time.time()
        keep.update(j.identity for j in ready if now - j.updated < self.cfg.gc_grace_s)
        removed = []
        for j in ready:
            if j.identity not in keep:
                self._forget(j)
                del self.jobs[j.identity]
                self.store.remove(j.identity)
                self.collected.add(j.identity)
                removed.append(j.identity)
                log.info("gc: removed snapshot %s (%d bytes)", j.identity, j.result_bytes)
        return {"removed": removed, "kept": sorted(j.identity for j in ready if j.identity in keep)}

    # ---- views ---------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """The ``GET /v1/status`` document: node, peers, bucket stats, counters, snapshot records."""
        return {
            "node_id": self.node_id,
            "swarm_id": self.keys.swarm_id,
            "peer_url": self.cfg.advertise_url,
            "version": __import__("bdn").__version__,
            "uptime_s": round(time.time() - self.started, 3),
            "peers": self.membership.describe(),
            "bucket": {"url": self.cfg.bucket, **self.bucket.stats.snapshot()},
            "counters": dict(self.counters),
            "verify_failures_by_peer": dict(self.verify_failures_by_peer),
            "snapshots": [j.describe() for j in self.jobs.values()],
        }
