"""Delta folding: a node that lags several deltas behind rebuilds the target once
(docs/DESIGN.md "Folding a delta chain").

Every delta format bdn reads (``arc_v1``, ``arc_v2``, ``bdn_planes_v1``, and fireworks'
``arc_v2`` files, which are the same format) stores per tensor ``base XOR target``; nothing is
additive or a replaced value. XOR is associative, so for a chain ``A -> d1 -> ... -> dk`` the
target tensor is ``A ^ x1 ^ ... ^ xk``: applying the diffs in order *in place* on one copy of the
ancestor's file gives the same bytes as building every intermediate snapshot, and each in-place
apply still checks every tensor's Adler-32 against that diff's metadata (the intermediate's
tensor), so nothing is verified less. The final files are then hashed against the *target*
manifest's ``result`` digests before READY, exactly as a single delta.

What is saved against one by one (measured in BENCHMARKS.md, "Catching up several deltas"): k-1
full snapshot directories (fresh shm pages, the xxh3 pass over every rebuilt chunk, the header
check, READY), and their shm space. The diff files of all k deltas are fetched in parallel, each
through the ordinary fetch path (peers by address, the owner, the bucket), into a stored-only
job that exists only while the fold runs.

:class:`Folder` is called by the runner for a delta whose base is not ready here;
:func:`plan_fold` (pure) says whether a chain can be folded; :func:`fold_file` is the blocking
file work.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import mmap
import os
import shutil
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from bdn import fileops
from bdn.bucket import BucketError, ObjectNotFound
from bdn.daemon.apply.delta_config import check_delta_config
from bdn.daemon.config import Config
from bdn.daemon.fetch.bucketio import BucketIO
from bdn.daemon.fetch.fetcher import Fetcher
from bdn.daemon.process.executors import Executors
from bdn.daemon.snapshots.events import ManifestAttached, ReasonChanged, StateChanged
from bdn.daemon.snapshots.snapshot import STORED, TERMINAL, Jobs, SnapshotJob
from bdn.daemon.store import diskio
from bdn.daemon.store.index import ChunkIndex
from bdn.daemon.store.store import Store
from bdn.proto import arc
from bdn.proto.chunks import digest as xxh3_digest
from bdn.proto.errors import BdnError, ProtocolError
from bdn.proto.manifest import MANIFEST_NAME, Manifest
from bdn.proto.safetensors_fmt import parse_header

log = logging.getLogger("bdn.fold")
RECENT = 64  # manifests a chain walk read, kept for a job of the same identity started right after
T = TypeVar("T")


def plan_fold(chain: Sequence[Manifest]) -> str | None:
    """Why ``chain`` (oldest first, each the base of the next, the last the target) cannot be
    folded, or None when it can. Pure.

    Foldable: at least two deltas; every one of the target's diff files is a diff file in every
    earlier delta too, rebuilding the same size (the target keeps the base's header, so a step
    that changed a header was published as an anchor and never sits inside a chain).
    """
    if len(chain) < 2:
        return "fewer than two deltas"
    for a, b in zip(chain, chain[1:]):
        if b.base_identity != a.identity:
            return f"{b.identity!r} is not built on {a.identity!r}"
    target = chain[-1]
    for m in chain:
        if not m.is_delta:
            return f"{m.identity!r} is not a delta"
    for f in target.files:
        if not f.is_diff:
            continue
        for m in chain[:-1]:
            try:
                g = m.file(f.path)
            except KeyError:
                return f"{m.identity!r} has no {f.path!r}"
            if not g.is_diff or g.result_size != f.result_size:
                return f"{f.path!r} of {m.identity!r} is not a diff of the same size"
    return None


def stored_only(m: Manifest) -> Manifest:
    """``m`` with its diff files alone: what an intermediate delta of a fold needs on this node."""
    return replace(m, files=tuple(f for f in m.files if f.is_diff), _by_path={})


def _map_read(path: Path) -> tuple[Any, mmap.mmap | None]:
    """(open file, read-only map of all of it or None when empty)."""
    fh = open(path, "rb")
    size = os.fstat(fh.fileno()).st_size
    return fh, (mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_READ) if size else None)


def fold_file(
    base_path: Path,
    diffs: Sequence[tuple[Path, str]],
    out_path: Path,
    expected_size: int,
    *,
    workers: int = 1,
    name: str | None = None,
    steps: Sequence[str] | None = None,
) -> None:
    """Rebuild ``out_path`` from the ancestor file ``base_path`` and a chain of diff files.

    ``diffs``: ``(diff file, compression format)`` oldest first. The first diff is applied from
    the ancestor into ``out_path`` (created or resized to ``expected_size`` bytes), every later
    one in place (``bdn.proto.arc.apply_diff`` with ``out_buf`` = its base; tensors on ``workers``
    threads), each tensor's Adler-32 checked against each diff's metadata. The bytes equal those
    of applying the diffs one by one into separate files. Blocking.

    Raises ProtocolError / ChecksumError naming the file (``name``), the delta (its position and
    ``steps[i]``, default the diff's directory name) and the tensor; OSError.
    """
    label = name if name is not None else os.fspath(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    run = fileops.thread_map(workers)
    err: Exception | None = None
    with open(out_path, "a+b") as fo:
        fo.truncate(expected_size)
        if expected_size == 0:
            return
        bf, base = _map_read(base_path)
        try:
            with mmap.mmap(fo.fileno(), expected_size) as out:
                if base is None:
                    raise ProtocolError(f"{label}: the ancestor's file is empty")
                header = parse_header(base, len(base))
                src: Any = base
                for step, (diff_path, fmt) in enumerate(diffs, 1):
                    df, diff = _map_read(diff_path)
                    try:
                        if diff is None:
                            raise ProtocolError("the diff file is empty")
                        dh = arc.read_diff_header(diff, len(diff))
                        size = arc.target_size(header, dh)
                        if size != expected_size:
                            raise ProtocolError(f"rebuilds {size} bytes but the manifest says {expected_size}")
                        arc.apply_diff(src, header, diff, dh, out, fmt, map=run)
                        src = out  # every later diff applies in place
                    except ProtocolError as e:
                        which = steps[step - 1] if steps is not None else diff_path.parent.name
                        err = type(e)(f"{label}: delta {step} of {len(diffs)} ({which}): {e}")
                        break
                    finally:
                        if diff is not None:
                            diff.close()
                        df.close()
                src = None
                out.flush()
        finally:
            if base is not None:
                base.close()
            bf.close()
    if err is not None:
        raise err


def fold_chain(
    chain: Sequence[Manifest], anc_dir: Path, stored_dir: Callable[[str], Path], staging: Path, workers: int
) -> None:
    """Fold every diff file of ``chain[-1]`` (a chain :func:`plan_fold` accepts) on the files of the
    ancestor directory ``anc_dir`` into ``staging``; ``stored_dir(identity)`` holds each delta's
    diff files. Blocking. Raises BdnError (the ancestor lacks a file), ProtocolError, OSError."""
    target = chain[-1]
    for f in target.files:
        if not f.is_diff:
            continue
        base = anc_dir / f.path
        if not base.is_file():
            raise BdnError(f"snapshot {chain[0].base_identity!r} has no file {f.path!r} to fold {target.identity!r} on")
        diffs = [(stored_dir(d.identity) / f.path, d.compression_format or arc.DEFAULT_COMPRESSION) for d in chain]
        fold_file(
            base,
            diffs,
            staging / f.path,
            f.result_size,
            workers=workers,
            name=f.path,
            steps=[d.identity for d in chain],
        )


class _Part(SnapshotJob):
    """An intermediate delta of a fold: its diff files alone, in the fold's own directory ``dir``
    (so a catalog job of the same identity, or another fold, never shares its files)."""

    def __init__(self, identity: str, store: Store, where: Path) -> None:
        super().__init__(identity, store, requested_by="fold")
        self.dir = where

    def file_path(self, layer: str, file_index: int) -> Path:
        assert self.manifest is not None
        return self.dir / self.manifest.files[file_index].path


def refuse_loop(identity: str, base_id: str, jobs: Jobs) -> None:
    """Raise BdnError when waiting for ``base_id`` would be waiting for ``identity`` itself: the
    base identities of the snapshots this node knows lead from ``base_id`` back to ``identity``
    (a manifest names a snapshot built on it as its base). Applied one by one, every snapshot of
    such a loop would wait for the next forever; the one that closes the loop fails instead."""
    seen = [identity]
    cur: str | None = base_id
    while cur is not None:
        if cur in seen:
            raise BdnError(f"the delta chain of {identity} loops: {' -> '.join(seen)} -> {cur}")
        seen.append(cur)
        j = jobs.get(cur)
        cur = j.base_identity if j is not None else None


class Folder:
    """Folds the chain under a delta whose base is not ready here (see the module docstring)."""

    def __init__(
        self, cfg: Config, store: Store, bucket: BucketIO, index: ChunkIndex, fetcher: Fetcher, pools: Executors
    ) -> None:
        self.cfg = cfg
        self.store = store
        self.bucket = bucket
        self.index = index
        self.fetcher = fetcher
        self.pools = pools
        self._recent: dict[str, tuple[str, Manifest]] = {}
        #: identity -> the chain walk's bucket read of its manifest, while it is in flight
        self._reading: dict[str, asyncio.Task[Manifest]] = {}

    async def _on(self, pool: Executor, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    async def _manifest(self, identity: str) -> Manifest:
        read = asyncio.ensure_future(self._read_manifest(identity))
        self._reading[identity] = read
        try:
            return await read
        finally:
            if self._reading.get(identity) is read:
                del self._reading[identity]

    async def _read_manifest(self, identity: str) -> Manifest:
        data = await self.bucket.read(f"{identity}/{MANIFEST_NAME}")
        m = await self._on(self.pools.disk, functools.partial(Manifest.from_json, expect_identity=identity), data)
        self._recent[identity] = (xxh3_digest(data), m)
        while len(self._recent) > RECENT:
            self._recent.pop(next(iter(self._recent)))
        return m

    async def take_recent(self, identity: str) -> tuple[str, Manifest] | None:
        """``(digest of its bytes, manifest)`` of ``identity`` if a chain walk read it moments
        ago, else None. Taken once: a job of that identity started meanwhile (by a peer's hint)
        reads the bucket no second time. A chain walk's read still in flight is waited for
        (not raced: that was a second GET of the manifest by one daemon under load,
        tests/test_swarm.py::test_s3_bucket_no_stored_byte_fetched_twice); if it failed, None
        (the job reads the manifest itself and reports what the bucket said)."""
        read = self._reading.get(identity)
        if read is not None:
            await asyncio.wait((read,))  # a cancelled waiter leaves the chain walk's read running
        return self._recent.pop(identity, None)

    async def chain(self, m: Manifest, jobs: Jobs) -> tuple[str, list[Manifest]] | None:
        """``(ancestor, deltas oldest first ending with m)``: the ancestor is the first snapshot
        down ``m``'s chain that this node has or is loading, else the anchor. None when the chain
        cannot be folded (:func:`plan_fold`), is longer than ``max_delta_chain``, or a manifest
        cannot be read (the caller then goes one by one, which reports the error).

        Raises BdnError: the chain loops (a manifest names as its base a snapshot above it, or
        the target itself): no ancestor would ever be ready, so the target fails rather than
        waiting on itself (tests/test_adversarial_fold.py)."""
        chain = [m]
        while True:
            base_id = chain[0].base_identity
            assert base_id is not None
            if any(c.identity == base_id for c in chain):
                raise BdnError(
                    f"the delta chain of {m.identity} loops: {chain[0].identity} names {base_id}, "
                    "a snapshot built on it, as its base"
                )
            job = jobs.get(base_id)
            if job is not None and job.state != "failed":
                break
            if len(chain) > self.cfg.max_delta_chain:
                return None
            try:
                bm = await self._manifest(base_id)
            except (ObjectNotFound, BucketError, BdnError) as e:
                log.info("snapshot %s: no fold (manifest of %s: %s)", m.identity, base_id, e)
                return None
            if not bm.is_delta:
                break
            chain.insert(0, bm)
        why = plan_fold(chain)
        if why is not None:
            if len(chain) >= 2:
                log.info("snapshot %s: no fold: %s", m.identity, why)
            return None
        return base_id, chain

    async def fold(self, job: SnapshotJob, m: Manifest, jobs: Jobs) -> bool:
        """Rebuild delta ``job`` by folding its chain; False (nothing done) when it cannot be folded.

        Raises BdnError / ProtocolError (a diff, a digest, the ancestor failed), NotAvailable."""
        found = await self.chain(m, jobs)
        if found is None:
            return False
        ancestor_id, chain = found
        for inter in chain[:-1]:
            if jobs.get(inter.identity) is not None:
                return False  # someone asked for it: it is built on its own, the normal path waits for it
        ancestor = jobs.get(ancestor_id) or jobs.prefetch(ancestor_id, requested_by=f"ancestor of {job.identity}")
        log.info("snapshot %s: folding %d deltas on %s", job.identity, len(chain), ancestor_id)
        job.apply(ReasonChanged(f"folding {len(chain)} deltas on {ancestor_id}"))
        await job.notify()
        work = self.store.stored_dir(f".fold-{m.identity}")  # this fold's own: no catalog job's files
        parts = [await self._stored_job(inter, work / inter.identity) for inter in chain[:-1]]
        if any(jobs.get(p.identity) is not None for p in parts):  # one started meanwhile (a peer's hint)
            for p in parts:
                await self._drop(p, jobs)
            await self._on(self.pools.disk, functools.partial(shutil.rmtree, work, ignore_errors=True))
            return False
        try:
            fetches = [asyncio.ensure_future(self.fetcher.fetch_layer(p, STORED)) for p in [*parts, job]]
            try:
                await asyncio.gather(self._await(ancestor), *fetches)
            except BaseException:
                for f in fetches:
                    f.cancel()
                await asyncio.gather(*fetches, return_exceptions=True)
                raise
            if ancestor.state != "ready":
                raise BdnError(f"ancestor {ancestor_id} of {job.identity} failed: {ancestor.reason}")
            anc_dir = self.store.ready_dir(ancestor_id)
            staging = self.store.staging_dir(m.identity)
            await self._on(self.pools.disk, check_delta_config, m.identity, ancestor_id, anc_dir, staging)
            job.apply(StateChanged("applying", f"folding {len(chain)} deltas on {ancestor_id}"))
            await job.notify()
            stored = {p.identity: p.dir for p in parts} | {m.identity: self.store.stored_dir(m.identity)}
            await self._on(
                self.pools.apply, fold_chain, chain, anc_dir, stored.__getitem__, staging, self.cfg.apply_workers
            )
            job.apply(StateChanged("verifying"))
            await job.notify()
            await self._on(self.pools.apply, diskio.verify_results, m, staging)
        finally:
            for p in parts:
                await asyncio.shield(self._drop(p, jobs))
            await self._on(self.pools.disk, functools.partial(shutil.rmtree, work, ignore_errors=True))
        return True

    async def _stored_job(self, m: Manifest, where: Path) -> _Part:
        """A job holding only ``m``'s diff files under ``where``, fetched like any layer (not in
        the catalog)."""
        part = _Part(m.identity, self.store, where)
        part.apply(ManifestAttached.of(stored_only(m), ""))

        def allocate() -> None:
            m = part.manifest
            assert m is not None  # attached above
            for f in m.files:
                p = where / f.path
                p.parent.mkdir(parents=True, exist_ok=True)
                with open(p, "wb") as fh:
                    fh.truncate(f.size)

        await self._on(self.pools.disk, allocate)
        await self._on(self.pools.disk, self.index.add_pending, part, STORED, part.stored_refs)
        part.apply(StateChanged("downloading"))
        return part

    async def _drop(self, part: SnapshotJob, jobs: Jobs) -> None:
        await self._on(self.pools.disk, self.index.drop_pending_of, part)
        self.index.forget(part, jobs.all())
        part.apply(StateChanged("failed", "folded"))

    @staticmethod
    async def _await(job: SnapshotJob) -> None:
        while job.state not in TERMINAL:
            await job.wait_change(job.version, 5.0)
