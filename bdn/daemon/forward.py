"""The runner's sparse step (DESIGN.md, "Sparse apply"): before a delta's files are reserved, which
spares may become them (:meth:`Forward.accept`); once its base is ready and its diffs verified,
bring those buffers forward in place (:meth:`Forward.apply`, a refused one falls back to the full
apply); after READY, hash the chunks the sparse applies touched (:meth:`Forward.after_ready`) and
only then index them, a bad one going to the repair path (quarantined, no longer offered).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from bdn.daemon import buffers, diskio
from bdn.daemon.config import Config
from bdn.daemon.executors import Executors
from bdn.daemon.layers import RESULT
from bdn.daemon.snapshot import SnapshotJob
from bdn.daemon.stats import Stats
from bdn.daemon.store import Store
from bdn.proto.errors import ProtocolError
from bdn.proto.manifest import ChunkRef, Manifest

log = logging.getLogger("bdn.runner")


class Forward:
    """Sparse applies of one daemon: ``accept`` -> ``apply`` -> ``after_ready`` per delta job."""

    def __init__(self, cfg: Config, store: Store, stats: Stats, pools: Executors,
                 register: Callable[[SnapshotJob, str, Iterable[ChunkRef]], Awaitable[None]],
                 repair: Callable[[SnapshotJob, list[int]], Awaitable[Any]]) -> None:
        self.cfg, self.store, self.stats, self.pools = cfg, store, stats, pools
        self._register, self._repair = register, repair
        self._chains: dict[str, dict[str, list[tuple[str, Any]]]] = {}
        self._held: dict[str, dict[str, dict[str, Any]]] = {}
        self._touched: dict[str, list[int]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._hot_used = 0
        self._hot: dict[str, list[str]] = {}  # identity -> its files whose buffer mapping to drop after READY

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
        """Record the buffers ``prepare_staging`` kept for ``identity`` (path -> tag)."""
        if held:
            self._held[identity] = held

    def forget(self, identity: str) -> None:
        """Drop what is known of ``identity``'s buffers (it failed, or is rebuilt another way)."""
        for p in self._hot.pop(identity, []):
            self.store.spares.maps.drop(self.store.staging_dir(identity) / p)
        self._chains.pop(identity, None)
        self._held.pop(identity, None)
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
                done.append(buffers.bring_forward(path, staging / path, tag, chains[tag["identity"]], f.result_size,
                                                  f.result_chunks, m.chunk_size, self.cfg.apply_workers, hot))
            except (ProtocolError, KeyError) as e:
                self.stats.add("sparse_fallbacks")
                log.warning("snapshot %s: sparse apply of %s refused (the buffer holds %s, the delta's base is %s): "
                            "%s; full apply", m.identity, path, tag.get("identity"), m.base_identity, e,
                            extra={"snapshot": m.identity})
        return done

    async def apply(self, job: SnapshotJob, m: Manifest) -> set[str]:
        """Bring ``job``'s held buffers forward; the paths done (the full apply skips them)."""
        if m.identity not in self._held:
            self._chains.pop(m.identity, None)
            return set()
        done = await asyncio.get_running_loop().run_in_executor(self.pools.apply, self._apply, m)
        where = {(r.path, r.index): i for i, r in enumerate(job.result_refs)}
        self._touched[m.identity] = sorted(where[(f.path, c)] for f in done for c in f.touched if (f.path, c) in where)
        for f in done:
            self.stats.add("sparse_applies")
            self.stats.add("sparse_bytes_written", f.written)
        if done:
            log.info("snapshot %s: %d file(s) brought forward sparsely (%d delta(s), %d bytes written, %d chunks touched,"
                     " %d through a mapping populated ahead)", m.identity, len(done), max(f.steps for f in done),
                     sum(f.written for f in done), len(self._touched[m.identity]), self._hot_used)
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

    def _spawn(self, aw: Awaitable[Any]) -> None:
        t = asyncio.ensure_future(aw)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _check(self, job: SnapshotJob, positions: list[int]) -> None:
        refs = list(job.result_refs)
        want = set(positions)
        good = await asyncio.get_running_loop().run_in_executor(
            self.pools.disk, lambda: diskio.verify_held(refs, want.__contains__, lambda fi: job.file_path(RESULT, fi)))
        await self._register(job, RESULT, (refs[i] for i in good))
        bad = sorted(want - set(good))
        if bad:
            self.stats.add("sparse_chunks_bad", len(bad))
            log.error("snapshot %s: %d chunk(s) a sparse apply wrote do not match the manifest (first %s chunk %d)",
                      job.identity, len(bad), refs[bad[0]].path, refs[bad[0]].index)
            if job.state == "ready":
                await self._repair(job, bad)
