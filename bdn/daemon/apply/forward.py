"""The runner's sparse step (DESIGN.md, "Sparse apply"): before a delta's files are reserved, which
spares may become them (:meth:`Forward.accept`); once its base is ready and its diffs verified,
bring those buffers forward in place (:meth:`Forward.apply`, a refused one falls back to the full
apply); after READY, hash the chunks the sparse applies touched (:meth:`Forward.after_ready`) and
only then index them, a bad one going to the repair path (quarantined, no longer offered). Off the
critical path: a freed spare caught up to the served snapshot (:meth:`Forward.catch_up`), or, when
no spare holds the served snapshot, one copied from it (:meth:`Forward.seed`).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from bdn import fileops, priority
from bdn.daemon.apply import buffers, seed
from bdn.daemon.config import Config
from bdn.daemon.observe import logctx
from bdn.daemon.observe.stats import Stats
from bdn.daemon.process import failpoints, shutdown
from bdn.daemon.process.executors import Executors
from bdn.daemon.snapshots.layers import RESULT
from bdn.daemon.snapshots.snapshot import SnapshotJob
from bdn.daemon.store import diskio
from bdn.daemon.store.spares import Spares
from bdn.daemon.store.store import Store
from bdn.proto import sparse_kernel
from bdn.proto.errors import ProtocolError
from bdn.proto.manifest import ChunkRef, Manifest

log = logging.getLogger("bdn.runner")

# the kernel's load (numba's import and its compile into the on-disk cache) holds nothing a
# stop must wait for: a SIGTERM during it does not wait shutdown_timeout_s
shutdown.holds_nothing(sparse_kernel.warm)

#: Targets whose changed ranges are remembered for their offers (``ranges``).
RANGES_KEPT = 8
#: Files whose tensors' Adler-32s a seed computed are remembered (their spare's tag after GC has none).
ADLERS_KEPT = 16


class Forward:
    """Sparse applies of one daemon: ``accept`` -> ``apply`` -> ``after_ready`` per delta job."""

    def __init__(
        self,
        cfg: Config,
        store: Store,
        stats: Stats,
        pools: Executors,
        register: Callable[[SnapshotJob, str, Iterable[ChunkRef]], Awaitable[None]],
        repair: Callable[[SnapshotJob, list[int]], Awaitable[Any]],
    ) -> None:
        self.cfg, self.store, self.stats, self.pools = cfg, store, stats, pools
        self._register, self._repair = register, repair
        self._chains: dict[str, dict[str, list[tuple[str, Any]]]] = {}
        self._held: dict[str, dict[str, dict[str, Any]]] = {}
        self._touched: dict[str, list[int]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False  # close() ran: no new background task
        self._hot_used = 0
        self._hot: dict[str, list[str]] = {}  # identity -> its files whose buffer mapping to drop after READY
        self._busy: asyncio.Future[int] | None = None  # a catch-up or a seed in flight
        self._busy_for = ""  # the identity the buffers in flight will hold
        self._hurry, self._cancel = threading.Event(), threading.Event()  # for the catch-up or seed in flight
        self._adlers: OrderedDict[tuple[str, str], dict[str, int]] = OrderedDict()  # (identity, path): a seed's
        self._planned: set[str] = set()  # identities with buffers held for a sparse apply
        self._ranges: OrderedDict[str, dict[str, list[list[int]]]] = OrderedDict()  # the last RANGES_KEPT
        self._warmed = False  # the sparse kernel's load started (once per process)

    def accept(self, m: Manifest, get: Callable[[str], buffers.Held | None]) -> Callable[[dict[str, Any]], bool] | None:
        """For ``Store.prepare_staging``: which spare tags delta ``m`` can start from (None: none)."""
        if not self.cfg.sparse_apply:
            return None
        chains = buffers.chains(m, get, self.store.stored_dir, self.cfg.sparse_max_chain)
        if not chains:
            return None
        self._chains[m.identity] = chains
        return lambda tag: tag.get("identity") in chains

    def held(self, identity: str, held: dict[str, dict[str, Any]]) -> None:
        """Record the buffers ``prepare_staging`` kept for ``identity`` (path -> tag). The first
        time, the compiled sparse kernel starts loading on an apply thread (numba's import and its
        cached code: seconds on a loaded machine) while the diffs are still on their way."""
        if held:
            self._held[identity] = held
            self._planned.add(identity)
            if not self._warmed:
                self._warmed = True
                self._spawn(asyncio.get_running_loop().run_in_executor(self.pools.apply, sparse_kernel.warm))

    def planned(self, identity: str) -> bool:
        """``identity`` holds buffers a sparse apply is to bring forward (until READY or failure)."""
        return identity in self._planned

    def ranges(self, identity: str) -> dict[str, list[list[int]]] | None:
        """Every changed tensor's ranges (absolute file offsets) of ``identity`` against its base,
        when its sparse apply brought every diff file forward (the last :data:`RANGES_KEPT`)."""
        return self._ranges.get(identity)

    def forget(self, identity: str) -> None:
        """Drop what is known of ``identity``'s buffers (it failed, or is rebuilt another way)."""
        for p in self._hot.pop(identity, []):
            self.store.spares.maps.drop(self.store.staging_dir(identity) / p)
        self._chains.pop(identity, None)
        self._held.pop(identity, None)
        self._planned.discard(identity)
        self._touched.pop(identity, None)

    def _apply(self, m: Manifest) -> list[buffers.Forwarded]:
        held, chains = self._held.pop(m.identity, {}), self._chains.pop(m.identity, {})
        files = {f.path: f for f in m.files}
        staging = self.store.staging_dir(m.identity)
        done: list[buffers.Forwarded] = []
        self._hot_used = 0
        for path, tag in held.items():
            f = files[path]
            hot = self.store.spares.maps.get(staging / path)
            self._hot_used += hot is not None
            self._hot.setdefault(m.identity, []).append(path)
            try:
                done.append(
                    buffers.bring_forward(
                        path,
                        staging / path,
                        tag,
                        chains[tag["identity"]],
                        f.result_size,
                        f.result_chunks,
                        m.chunk_size,
                        self.cfg.apply_workers,
                        hot,
                    )
                )
            except (ProtocolError, KeyError) as e:
                self.stats.add("sparse_fallbacks")
                log.warning(
                    "snapshot %s: sparse apply of %s refused (the buffer holds %s, the delta's base is %s): "
                    "%s; full apply",
                    m.identity,
                    path,
                    tag.get("identity"),
                    m.base_identity,
                    e,
                    extra={"snapshot": m.identity},
                )
        return done

    async def apply(self, job: SnapshotJob, m: Manifest) -> set[str]:
        """Bring ``job``'s held buffers forward; the paths done (the full apply skips them)."""
        if m.identity not in self._held:
            self._chains.pop(m.identity, None)
            return set()
        t0 = time.monotonic()
        done = await asyncio.get_running_loop().run_in_executor(self.pools.apply, self._apply, m)
        took = time.monotonic() - t0
        where = {(r.path, r.index): i for i, r in enumerate(job.result_refs)}
        self._touched[m.identity] = sorted(where[(f.path, c)] for f in done for c in f.touched if (f.path, c) in where)
        diffs = {f.path for f in m.files if f.is_diff and f.result_size}
        if done and {f.path for f in done} == diffs:
            self._ranges[m.identity] = {n: [[a, b] for a, b in r] for f in done for n, r in f.ranges.items()}
            while len(self._ranges) > RANGES_KEPT:
                self._ranges.popitem(last=False)
        for f in done:
            self.stats.add("sparse_applies")
            self.stats.add("sparse_bytes_written", f.written)
        if done:
            log.info(
                "snapshot %s: %d file(s) brought forward sparsely (%d delta(s), %d bytes written, %d chunks touched,"
                " %d through a mapping populated ahead) in %.3f s",
                m.identity,
                len(done),
                max(f.steps for f in done),
                sum(f.written for f in done),
                len(self._touched[m.identity]),
                self._hot_used,
                took,
            )
        return {f.path for f in done}

    def untouched(self, job: SnapshotJob) -> list[ChunkRef]:
        """The rebuilt chunks of ``job`` to index now (all but those a sparse apply touched)."""
        touched = set(self._touched.get(job.identity, ()))
        return [r for i, r in enumerate(job.result_refs) if i not in touched]

    def after_ready(self, job: SnapshotJob) -> None:
        """After READY (and GC): drop the buffers' mappings, map the spares GC just tagged, and
        hash the chunks a sparse apply touched (tasks; READY does not wait for them)."""
        positions = self._touched.pop(job.identity, None)
        hot = self._hot.pop(job.identity, [])
        self.forget(job.identity)
        maps, ready = self.store.spares.maps, self.store.ready_dir(job.identity)
        loop = asyncio.get_running_loop()

        def keep_hot() -> None:
            for p in hot:
                maps.drop(ready / p)
            self.store.spares.prime_tagged()

        self._spawn(loop.run_in_executor(self.pools.disk, keep_hot))
        if positions:
            self._spawn(self._check(job, positions))

    async def settle(self, m: Manifest, get: Callable[[str], buffers.Held | None]) -> None:
        """Before snapshot ``m`` (a delta or a full one) reserves its files: stop the background
        catch-up or seed in flight and wait for it to stop. It runs at the lowered priority
        (``background_nice``): on a node whose cores are busy it gets a tenth of what ``m``'s own
        work gets, so ``m`` never waits for more of it than the step in flight. A catch-up stops
        before its next file (the spares it did not reach keep their tag, one delta further behind:
        ``m`` brings them forward itself when it starts from them); a seed stops at its next chunk
        and gives the file it was copying to the page pool untagged (its allocated pages are what
        ``m``'s reservation takes like any spare's, or trims to the room it leaves); a delta that
        starts from the seeded snapshot copies what no spare holds then at full speed itself
        (:meth:`seed` with ``background=False``)."""
        busy = self._busy
        if busy is None:
            return
        self._cancel.set()
        self._hurry.set()  # (wakes a copy waiting on its rate bound, which then sees the cancel)
        # the background pool runs at a raised nice value: on busy cores the step in flight would
        # take as long as they stay busy (a priority inversion); its thread gets the loop's priority back
        if not busy.done():
            priority.boost_lowered()
        await asyncio.wait([busy])

    async def catch_up(self, m: Manifest, get: Callable[[str], buffers.Held | None]) -> int:
        """Bring the tagged spares that ready delta ``m`` (the snapshot now served) and its
        ancestors can reach forward to ``m``, in place, off the critical path: the next delta
        then applies only itself, through a mapping already populated. Each such spare is taken
        out of the pool (``Spares.claim_tagged``: its tag deleted first), brought forward
        (:func:`buffers.bring_forward`), the chunks it touched hashed against ``m``'s digests,
        and given back tagged with ``m`` (untagged on any failure: plain recycled pages). Returns
        the files brought forward."""
        if not self.cfg.sparse_apply or self._busy is not None:
            return 0
        chains = buffers.chains(m, get, self.store.stored_dir, self.cfg.sparse_max_chain)
        if not chains:
            return 0
        fut = asyncio.get_running_loop().run_in_executor(self.pools.background, self._catch_up, m, chains)
        return await self._in_flight(m.identity, fut)

    async def _in_flight(self, identity: str, aw: Awaitable[int]) -> int:
        """Await ``aw`` (a catch-up or a background seed to ``identity``) as the one in flight
        (:meth:`settle` waits for it); set before this yields."""
        fut = asyncio.ensure_future(aw)
        self._busy, self._busy_for = fut, identity
        try:
            return await fut
        finally:
            self._busy, self._busy_for = None, ""
            if not self._closed:  # (after close() a copy still running must go on seeing the cancel)
                self._hurry.clear()
                self._cancel.clear()

    def _catch_up(self, m: Manifest, chains: dict[str, list[tuple[str, Any]]]) -> int:
        spares, n = self.store.spares, 0
        files = [f for f in m.files if f.is_diff and f.result_size and f.path.endswith(".safetensors")]
        first = True
        for i, f in enumerate(files):
            if self._cancel.is_set():  # a snapshot waits (settle): it takes the spares from here
                log.info(
                    "catch-up to %s stopped before %d of %d file(s): a snapshot on its way takes their spares",
                    m.identity,
                    len(files) - i,
                    len(files),
                )
                break
            claimed = spares.claim_tagged(f.path, f.result_size, lambda tag: tag.get("identity") in chains)
            if claimed is None:
                continue
            hidden, tag = claimed
            failpoints.hold("catch_up.claimed", m.identity)
            if first:
                first = False
                failpoints.hold("catch_up.first_claimed", m.identity, until=self._hurry)
            if tag.get("adlers") is None:  # GC's tag of a file a seed copied knows none: the seed did
                tag["adlers"] = self._adlers.get((str(tag.get("identity")), f.path))
            t0 = time.monotonic()
            new_tag = None
            try:
                spares.maps.prime(hidden)
                fw = buffers.bring_forward(
                    f.path,
                    hidden,
                    tag,
                    chains[tag["identity"]],
                    f.result_size,
                    f.result_chunks,
                    m.chunk_size,
                    self.cfg.apply_workers,
                    spares.maps.get(hidden),
                )
                table = list(f.result_chunks)
                ok = set(fileops.verify_chunks(hidden, m.chunk_size, table, which=fw.touched))
                bad = [i for i in fw.touched if i not in ok]
                if bad:
                    self.stats.add("sparse_chunks_bad", len(bad))
                    log.error(
                        "catch-up of %s to %s: %d chunk(s) do not match (first chunk %d); the spare is untagged",
                        f.path,
                        m.identity,
                        len(bad),
                        bad[0],
                    )
                else:
                    new_tag = {
                        "identity": m.identity,
                        "path": f.path,
                        "size": f.result_size,
                        "chunks": table,
                        "adlers": fw.adlers,
                    }
                    n += 1
                    self.stats.add("sparse_caught_up")
                    log.info(
                        "catch-up: the spare of %s that held %s brought forward to %s in the background "
                        "(%d delta(s), %d bytes written, %d chunks hashed) in %.3f s",
                        f.path,
                        tag.get("identity"),
                        m.identity,
                        fw.steps,
                        fw.written,
                        len(fw.touched),
                        time.monotonic() - t0,
                    )
            except (ProtocolError, KeyError, OSError) as e:
                self.stats.add("sparse_fallbacks")
                log.warning(
                    "catch-up of %s to %s refused (the spare holds %s): %s; left untagged",
                    f.path,
                    m.identity,
                    tag.get("identity"),
                    e,
                )
            finally:
                spares.release(hidden, new_tag)
        return n

    async def seed(
        self, job: SnapshotJob, reach: Callable[[dict[str, Any]], bool], room: int | None, *, background: bool
    ) -> int:
        """Give the page pool a buffer of each safetensors file of ready snapshot ``job`` (a full
        one, or a ``bdn_planes_v1`` delta) that no tagged spare ``reach`` accepts holds: a new spare (``Spares.seed``) into which the file is
        copied and verified chunk by chunk (``bdn.daemon.apply.seed``), tagged ``job`` with every
        tensor's Adler-32, its mapping kept populated. ``background``: at ``sparse_seed_mbit``
        until a delta that starts from it waits (:meth:`settle`), and counted as in flight;
        otherwise at full speed (that delta is waiting). ``room``: bytes the shm budget leaves
        (None: no budget); files past it are not seeded. Returns the files seeded (0 with
        ``sparse_seed_mbit`` 0, or when the pool has no room: the delta then applies in full)."""
        m = job.manifest
        if not self.cfg.sparse_apply or self.cfg.sparse_seed_mbit <= 0 or m is None or job.state != "ready":
            return 0
        if m.is_delta and (m.compression_format or "").lower() != buffers.SPARSE_FORMAT:
            return 0  # its successor will not be a sparse delta either (a guess: the copy would be wasted)
        if not background:
            return await self._seed_job(job, reach, room, 0.0)
        if self._busy is not None:
            return 0
        # In flight from here, before the first await: a second background seed asked meanwhile
        # (a first snapshot's READY and its being served both ask for one) returns 0 instead of
        # copying the same files into a second buffer each (one model copy more in shm).
        rate = self.cfg.sparse_seed_mbit * 1e6 / 8
        return await self._in_flight(job.identity, self._seed_job(job, reach, room, rate))

    async def _seed_job(
        self, job: SnapshotJob, reach: Callable[[dict[str, Any]], bool], room: int | None, rate: float
    ) -> int:
        """:meth:`seed`'s copy of ``job``'s unheld files at ``rate`` bytes/s (0: full speed)."""
        m = job.manifest
        assert m is not None  # seed checked it
        loop = asyncio.get_running_loop()
        try:  # READY and the spares' tags are read on a disk thread (a huge snapshot: 100,000 files)
            want = await loop.run_in_executor(self.pools.disk, self._unseeded, job.identity, reach)
        except (OSError, ProtocolError):
            return 0
        if room is not None:  # within the shm budget, largest files first
            fits: list[dict[str, Any]] = []
            for t in sorted(want, key=lambda t: -t["size"]):
                if t["size"] <= room:
                    fits.append(t)
                    room -= t["size"]
            if len(fits) < len(want):
                log.info(
                    "seed: %d file(s) of %s not copied: the shm budget leaves %d bytes",
                    len(want) - len(fits),
                    job.identity,
                    room,
                )
            want = fits
        if not want:
            return 0
        # (the copy and its checks need no compiled kernel: it is loaded when a sparse delta's
        # buffers are held, ``held``, while its diffs download; a node that never applies one
        # never pays numba's import, ~1 CPU-s and ~55 MB)
        src = self.store.ready_dir(job.identity)
        # a background seed (rate > 0) on the lowered threads; one a delta waits for on ``apply``
        pool = self.pools.background if rate > 0 else self.pools.apply
        return await loop.run_in_executor(pool, self._seed, src, want, m.chunk_size, rate, self.store.spares)

    def _unseeded(self, identity: str, reach: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
        """The tags of ready ``identity``'s files that no tagged spare ``reach`` accepts holds (a
        disk thread). Raises OSError/ProtocolError (READY or a stored diff unreadable)."""
        tags = buffers.tags_of(self.store.read_ready(identity), self.store.stored_dir(identity))
        have = self.store.spares.tagged(reach)
        return [t for p, t in tags.items() if (p, t["size"]) not in have and t["size"]]

    def _seed(self, src: Any, want: list[dict[str, Any]], chunk_size: int, rate: float, spares: Spares) -> int:
        n = 0
        for tag in want:
            with logctx.snapshot(tag["identity"]):  # a worker thread: the loop's context is not here
                outcome = self._seed_one(src, tag, chunk_size, rate, spares)
            if outcome == "stop":
                break
            n += outcome == "seeded"
        return n

    def _seed_one(self, src: Any, tag: dict[str, Any], chunk_size: int, rate: float, spares: Spares) -> str:
        """Seed one file (``_seed``): ``"seeded"``, ``"failed"`` (logged; the next file may
        still be seeded) or ``"stop"`` (no room in the pool, or cancelled: the rest is not tried)."""
        path, t0 = tag["path"], time.monotonic()
        hidden = spares.seed(tag["size"])
        if hidden is None:
            return "stop"
        done = False
        t1 = time.monotonic()
        try:
            header = fileops.read_header(src / path)
            seed.copy_file(src / path, hidden, chunk_size, rate=rate, hurry=self._hurry, cancel=self._cancel)
            t2 = time.monotonic()
            spares.maps.prime(hidden)  # (pages written whole: only the page tables are made here)
            mapped = spares.maps.get(hidden)
            if mapped is None:
                raise OSError("the new buffer could not be mapped")
            adlers = seed.verify_copy(mapped, chunk_size, tag["chunks"], header, path)
            del mapped
            spares.release(hidden, dict(tag, adlers=adlers))
            done = True
            self._adlers[(tag["identity"], path)] = adlers
            while len(self._adlers) > ADLERS_KEPT:
                self._adlers.popitem(last=False)
            self.stats.add("sparse_seeded")
            log.info(
                "seed: a buffer of %s copied from %s and verified (%d bytes, %d chunks hashed) in %.3f s"
                " (pages %.3f s, copy %.3f s, mapping and hashes %.3f s)",
                path,
                tag["identity"],
                tag["size"],
                len(tag["chunks"]),
                time.monotonic() - t0,
                t1 - t0,
                t2 - t1,
                time.monotonic() - t2,
            )
            return "seeded"
        except seed.Cancelled as e:
            # its pages are allocated (Spares.seed): the pool keeps them untagged, plain recycled
            # pages for the snapshot that came (or trimmed by its reservation like any spare)
            spares.release(hidden, None)
            done = True
            log.info("seed: %s (a snapshot came while it copied %s); its pages kept as a spare", e, tag["identity"])
            return "stop"
        except (ProtocolError, OSError) as e:
            log.warning("seed: no buffer of %s copied from %s: %s", path, tag["identity"], e)
            return "failed"
        finally:
            if not done:
                spares.discard(hidden)

    def spawn(self, aw: Awaitable[Any]) -> None:
        """Run ``aw`` as a task this object keeps until it ends (after :meth:`close`: dropped)."""
        self._spawn(aw)

    async def close(self) -> None:
        """Shutdown: stop the seed copy in flight at its next chunk and cancel every background
        task (catch-ups, seeds, checks), awaited here, so that none asks a thread pool after the
        daemon shut the pools down. Later :meth:`spawn` calls are dropped."""
        self._closed = True
        self._cancel.set()
        self._hurry.set()  # (a copy waiting on its rate bound wakes and sees the cancel)
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _spawn(self, aw: Awaitable[Any]) -> None:
        if self._closed:
            if inspect.iscoroutine(aw):
                aw.close()  # never started: no "never awaited" warning
            return
        t = asyncio.ensure_future(aw)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _check(self, job: SnapshotJob, positions: list[int]) -> None:
        refs = list(job.result_refs)
        want = set(positions)
        good = await asyncio.get_running_loop().run_in_executor(
            self.pools.disk, lambda: diskio.verify_held(refs, want.__contains__, lambda fi: job.file_path(RESULT, fi))
        )
        await self._register(job, RESULT, (refs[i] for i in good))
        bad = sorted(want - set(good))
        if bad:
            self.stats.add("sparse_chunks_bad", len(bad))
            log.error(
                "snapshot %s: %d chunk(s) a sparse apply wrote do not match the manifest (first %s chunk %d)",
                job.identity,
                len(bad),
                refs[bad[0]].path,
                refs[bad[0]].index,
            )
            if job.state == "ready":
                await self._repair(job, bad)
