"""Snapshots without ``bdn.manifest.json`` in the daemon (``require_manifest = false``;
docs/TRUST.md "How the daemon loads a foreign snapshot", docs/OPERATIONS.md section 9).

:class:`ForeignLoader` is called by the runner when a snapshot has no manifest:

- :meth:`ForeignLoader.table` lists ``<identity>/`` and derives the table
  (:func:`bdn.foreign.read_foreign_table`, on the bucket threads), reads the bucket's checksum
  of every object, and attaches a :class:`ForeignState` to the job (``ForeignAttached``). A delta's
  base (the hot-load request's ``previous_snapshot_identity``, else ``foreign_base`` in the
  config) is brought to READY here first: its table is part of the delta's.
- :meth:`ForeignLoader.finish`, once the stored layer is fetched, verifies every object against
  the bucket's checksum (repairing bad parts from the bucket and penalising the peers that sent
  them), applies a delta (Adler-32 per tensor), runs :func:`bdn.foreign.ready.check_ready` and
  returns the manifest READY is written from, with real xxh3-128 digests of the files.

While a job has ``foreign`` set, the fetch path (``bdn.daemon.fetch``) asks
:meth:`ForeignState.bucket_only` (objects the bucket vouches nothing for are read from the
bucket by each daemon, unless ``allow_unverifiable``) and :meth:`SnapshotJob.servable` (chunks
received from peers are served on only after their object verified), and tells the job who sent
a chunk (``ForeignReceived``); :meth:`ForeignLoader.finish` sends ``ForeignVerified``. Received
chunks are never hashed against the ids: they are not digests.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol, TypeVar

from bdn import fileops
from bdn.bucket import BucketError, ObjectChanged, ObjectChecksum
from bdn.daemon.apply.delta_config import check_delta_config
from bdn.daemon.config import Config
from bdn.daemon.fetch.bucketio import BucketIO
from bdn.daemon.process.clock import Clock
from bdn.daemon.process.executors import Executors
from bdn.daemon.snapshots.events import ForeignAttached, ForeignVerified, LayerComplete, ReasonChanged, StateChanged
from bdn.daemon.snapshots.foreign_state import ForeignState, Hint
from bdn.daemon.snapshots.layers import RESULT, STORED
from bdn.daemon.snapshots.snapshot import Jobs, SnapshotJob
from bdn.daemon.store import diskio
from bdn.daemon.store.store import Store
from bdn.foreign import read_checksums, read_foreign_table
from bdn.foreign.checksum import UNVERIFIABLE, Verdict
from bdn.foreign.ready import check_ready
from bdn.foreign.repair import bad_chunks, verify_or_repair
from bdn.proto.errors import BdnError
from bdn.proto.foreign import IncompleteSnapshot, policy_version_from_identity
from bdn.proto.manifest import ChunkRef, FileEntry, FileResult, Manifest

log = logging.getLogger("bdn.foreign")
T = TypeVar("T")

#: Listings taken again when an object is replaced while the table is read.
RELIST_TRIES = 3


class Hints:
    """Per identity, the latest :class:`Hint` (set by the hot-load API and by peers' targets)."""

    MAX = 256

    def __init__(self) -> None:
        self._by_identity: dict[str, Hint] = {}

    def set(self, identity: str, hint: Hint) -> None:
        """Remember ``hint`` for ``identity`` (the newest ``MAX`` identities are kept)."""
        self._by_identity.pop(identity, None)
        self._by_identity[identity] = hint
        while len(self._by_identity) > self.MAX:
            self._by_identity.pop(next(iter(self._by_identity)))

    def get(self, identity: str) -> Hint:
        """The hint given for ``identity``, or an empty ``Hint``."""
        return self._by_identity.get(identity, Hint())


class Penalties(Protocol):
    """Where a peer that sent bad bytes is penalised (membership)."""

    def penalise(self, url: str, seconds: float) -> None:
        """Stop asking ``url`` for ``seconds``."""


class VerifyStats(Protocol):
    """Where failed chunk verifications are counted, by source (metrics)."""

    def verify_failed(self, source: str) -> None:
        """Count one chunk that failed its digest, from ``source`` (``bucket`` or ``peer``)."""


def verify_file(
    bucket: Any, checksum: ObjectChecksum, path: Path, chunk_size: int, workers: int
) -> tuple[Verdict, list[int]]:
    """Verify the assembled object at ``path`` against the bucket's ``checksum``, repairing bad
    parts in place from the bucket; ``(final verdict, stored chunk indices that were wrong)``.

    Blocking (run it on a worker thread). Raises ChecksumError (the bucket's own bytes fail),
    ObjectChanged, BucketError, OSError.
    """
    size = os.path.getsize(path)
    if size == 0:
        verdict, repair = verify_or_repair(bucket, checksum, b"", chunk_size=chunk_size, workers=workers)
        return (repair.verdict if repair else verdict), []
    with open(path, "r+b") as fh, mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_WRITE) as buf:
        verdict, repair = verify_or_repair(bucket, checksum, buf, chunk_size=chunk_size, workers=max(1, workers))
        if repair is None:
            return verdict, []
        buf.flush()
        return repair.verdict, bad_chunks(repair.bad_ranges, chunk_size)


def ready_manifest(m: Manifest, staging_dir: Path) -> Manifest:
    """``m`` with every file's rebuilt chunks replaced by the real xxh3-128 digests of the staged
    file (what READY carries, and ``bdnctl verify`` re-hashes against). Blocking."""
    files = []
    for f in m.files:
        real = tuple(fileops.chunk_digests(staging_dir / f.path, m.chunk_size)) if f.result_size else ()
        if f.is_diff:
            files.append(replace(f, result=FileResult(f.result_size, real)))
        else:
            files.append(FileEntry(f.path, f.size, real))
    return replace(m, files=tuple(files), _by_path={})


class ForeignLoader:
    """The no-manifest path of one snapshot (see the module docstring)."""

    def __init__(
        self,
        cfg: Config,
        bucket: BucketIO,
        store: Store,
        pools: Executors,
        clock: Clock,
        hints: Hints,
        membership: Penalties,
        stats: VerifyStats,
    ) -> None:
        self.cfg = cfg
        self.bucket = bucket
        self.store = store
        self.pools = pools
        self.clock = clock
        self.hints = hints
        self.membership = membership
        self.stats = stats

    async def _on(self, pool: Executor, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    def base_of(self, identity: str) -> str | None:
        """The base a foreign delta ``identity`` is rebuilt on: the request's, else the config's."""
        return self.hints.get(identity).base_identity or self.cfg.foreign_base or None

    def _saved(self, identity: str) -> dict[str, Any] | None:
        """The hint and ETags saved with an interrupted download of ``identity`` (validated), or None."""
        x = self.store.load_progress_extra(identity)
        if x is None:
            return None
        for key in ("base", "codec"):
            if x.get(key) is not None and (not isinstance(x[key], str) or len(x[key]) > 512):
                return None
        return x

    async def _ready_base(self, job: SnapshotJob, jobs: Jobs, base_id: str) -> SnapshotJob:
        base = jobs.get(base_id)
        if base is None or base.state == "failed":
            base = jobs.prefetch(base_id, requested_by=f"base of {job.identity}")
        if base.state != "ready":
            job.apply(
                ReasonChanged(
                    f"waiting for its base {base_id!r} to be ready here (a delta without a manifest is derived from its base)"
                )
            )
            await job.notify()
        while base.state not in ("ready", "failed"):
            await base.wait_change(base.version, 5.0)
        if base.state != "ready":
            raise BdnError(f"base snapshot {base_id!r} of {job.identity!r} failed: {base.reason}")
        job.apply(ReasonChanged(""))
        return base

    async def table(self, job: SnapshotJob, jobs: Jobs, wait_publish: bool = True) -> tuple[Manifest, str]:
        """Derive ``job``'s table and attach its :class:`ForeignState` (``ForeignAttached``);
        ``(the table's manifest, the table's id)``.

        ``wait_publish``: with nothing under the prefix, wait (reason set, polled every
        ``manifest_poll_s`` up to ``manifest_wait_s``) instead of failing at once. A shard the
        index names but the listing lacks always waits. Raises BdnError (one line, naming the
        object) on anything final.
        """
        saved = self._saved(job.identity)
        if saved is not None and self.hints.get(job.identity) == Hint():
            self.hints.set(job.identity, Hint(saved.get("base"), saved.get("codec")))
        hint = self.hints.get(job.identity)
        base_id = self.base_of(job.identity)
        base_m, base_headers = None, None
        if base_id is not None and base_id != job.identity:
            base = await self._ready_base(job, jobs, base_id)
            base_m = base.manifest
            assert base_m is not None  # a ready job has its manifest
            d = self.store.ready_dir(base_id)
            base_headers = {}
            for f in base_m.files:
                if f.path.endswith(".safetensors"):
                    base_headers[f.path] = await self._on(self.pools.disk, fileops.read_header, d / f.path)
        else:
            base_id = None
        pv = policy_version_from_identity(job.identity) or 0
        deadline = self.clock.monotonic() + self.cfg.manifest_wait_s
        changed = 0
        while True:
            try:
                table = await self._on(
                    self.pools.bucket,
                    lambda: read_foreign_table(
                        self.bucket.bucket,
                        job.identity,
                        chunk_size=self.cfg.foreign_chunk_size,
                        policy_version=pv,
                        base_identity=base_id,
                        base=base_m,
                        base_headers=base_headers,
                        compression_format=hint.compression_format,
                    ),
                )
                checksums = await self._on(self.pools.bucket, read_checksums, self.bucket.bucket, table)
                break
            except IncompleteSnapshot as e:
                nothing = str(e).startswith("nothing is published")
                if nothing and not wait_publish:
                    raise BdnError(f"snapshot {job.identity!r}: {e} in {self.bucket.url}") from None
                if self.clock.monotonic() >= deadline:
                    raise BdnError(
                        f"snapshot {job.identity!r} is not published: {e} (waited {self.cfg.manifest_wait_s:g} s)"
                    ) from None
                reason = f"waiting for publication: {e}"
                if job.reason != reason:
                    job.apply(ReasonChanged(reason))
                    await job.notify()
                await asyncio.sleep(self.cfg.manifest_poll_s)
            except ObjectChanged as e:
                changed += 1
                if changed >= RELIST_TRIES:
                    raise BdnError(f"snapshot {job.identity!r}: {e}") from None
                log.info("snapshot %s: %s; listing again", job.identity, e)
            except BucketError as e:
                raise BdnError(f"snapshot {job.identity!r}: cannot read its objects: {e}") from None
        state = ForeignState(table, checksums, self.cfg.allow_unverifiable, Hint(base_id, hint.compression_format))
        job.apply(ForeignAttached(state))
        if saved is not None and saved.get("table") != table.table_id:
            old = tags if isinstance(tags := saved.get("etags"), dict) else {}
            moved = [o.path for o in table.objects if old.get(o.path) != o.etag] + sorted(
                set(old) - {o.path for o in table.objects}
            )
            log.warning(
                "snapshot %s: the bucket changed since the interrupted download (%s); starting over",
                job.identity,
                ", ".join(moved[:3]) or "its table",
            )
        if state.unverifiable:
            log.info(
                "snapshot %s: %d object(s) without a bucket checksum, read from the bucket by this node",
                job.identity,
                len(state.unverifiable),
            )
        log.info(
            "snapshot %s: no manifest; table %s derived from the listing (%s, %d files)",
            job.identity,
            table.table_id,
            table.manifest.kind,
            len(table.objects),
        )
        return table.manifest, table.table_id

    async def finish(self, job: SnapshotJob, register: Callable[[str, ChunkRef], None]) -> Manifest:
        """After the stored layer is fetched: verify (and repair) every object, apply a delta,
        check before READY; the manifest READY is written from. ``register(layer, ref)`` puts a
        chunk held back from peers into the index once its object verified."""
        st = job.foreign
        assert st is not None  # attached by table()
        m = st.table.manifest
        verdicts: dict[str, Verdict] = {}
        for fi, obj in enumerate(st.table.objects):
            path = job.file_path(STORED, fi)
            try:
                verdict, bad = await self._on(
                    self.pools.apply,
                    verify_file,
                    self.bucket.bucket,
                    st.checksums[obj.path],
                    path,
                    m.chunk_size,
                    self.cfg.apply_workers or 1,
                )
            except ObjectChanged:
                raise  # the runner starts again on a fresh listing
            except BucketError as e:
                raise BdnError(f"snapshot {job.identity!r}: {e}") from None
            for ci in bad:
                sender = job.foreign_senders.get((fi, ci))
                if sender is not None:
                    url, node_id = sender
                    self.stats.verify_failed(node_id)
                    self.membership.penalise(url, self.cfg.penalty_s)
                    log.warning(
                        "snapshot %s: peer %s sent bad bytes for chunk %d of %s; penalised for %g s",
                        job.identity,
                        node_id,
                        ci,
                        obj.path,
                        self.cfg.penalty_s,
                        extra={"peer": node_id},
                    )
                else:
                    self.stats.verify_failed("bucket")
            if verdict.status == UNVERIFIABLE:
                log.debug("snapshot %s: %s unverifiable (%s)", job.identity, obj.key, verdict.reason)
            verdicts[obj.path] = verdict
        job.apply(ForeignVerified())
        for ref in job.stored_refs:
            if job.held_back(ref):
                register(STORED, ref)
        staging = self.store.staging_dir(m.identity)
        if m.is_delta:
            job.apply(StateChanged("applying"))
            await job.notify()
            assert m.base_identity is not None  # a delta names its base
            base_dir = self.store.ready_dir(m.base_identity)
            await self._on(self.pools.disk, check_delta_config, m.identity, m.base_identity, base_dir, staging)
            await self._on(
                self.pools.apply,
                diskio.apply_delta,
                m,
                base_dir,
                self.store.stored_dir(m.identity),
                staging,
                self.cfg.apply_workers,
            )
        job.apply(StateChanged("verifying"))
        await job.notify()
        # Objects without a checksum were read from the bucket by this node (bucket_only) unless
        # the configuration accepts peers' bytes for them: either way, policy allowed them.
        await self._on(self.pools.apply, lambda: check_ready(st.table, staging, verdicts, allow_unverifiable=True))
        final = await self._on(self.pools.apply, ready_manifest, m, staging)
        job.apply(LayerComplete(RESULT))
        return final
