"""Sharded publish from the trainer's ranks: each rank stores its own tensors, one commit publishes.

The pattern of ``torch.distributed.checkpoint``: every rank writes its shards, then one metadata
write commits the step. Here:

1. Every rank ``r`` of ``world_size`` calls :func:`publish_part` with the tensors it owns
   (``{name: numpy array or torch tensor}``, straight from memory: no local file is written).
   Its tensors are grouped into safetensors files by ``file_of(name)`` (default
   :func:`bdn.publish.layout.layer_file`: one file per transformer layer, ``model.layers.12`` ->
   ``model.layers.12.safetensors``, everything else in ``model-rest.safetensors``); each file is
   built in memory, encoded (a delta: one diff stream per tensor against ``base_tensors``) on
   ``workers`` threads and uploaded (multipart, ``uploads`` files at a time) while the next file
   encodes. Last, the rank writes its **part record** ``<root>/.bdn-parts/<identity>/part-RRRRR-of-WWWWW.json``
   (format :mod:`bdn.proto.parts`): its presence says that rank's files are all in the bucket.
2. Once every rank returned (the trainer's own barrier, e.g. ``torch.distributed.barrier()``),
   one process calls :func:`commit_step`: it reads the ``world_size`` part records, checks them
   together, writes ``model.safetensors.index.json`` (when there is more than one safetensors
   file) and ``extra_files`` (``config.json``, ...), then ``<identity>/bdn.manifest.json``, the
   commit marker nodes wait for (format ``bdn.snapshot/1``, as every bdnd reads it).

The snapshot's files depend only on the tensors and ``file_of``, never on how the tensors were
spread over ranks: a step published by 4 ranks and by 1 rank rebuilds byte-identical files on
the nodes. A file is written by one rank: every tensor of a file must be owned by the same rank.

A rank that dies leaves its files without a part record: :func:`commit_step` refuses the step
(nothing is published; its objects stay under ``<identity>/``, unreferenced), and later steps
publish as usual. Source: DESIGN.md, "Sharded publish".
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from bdn.bucket import Bucket, ObjectNotFound, validate_key
from bdn.fileops import thread_map
from bdn.proto import arc
from bdn.proto.chunks import DEFAULT_CHUNK_SIZE, buffer_digests
from bdn.proto.errors import PathError, TensorMismatch
from bdn.proto.identity import validate_identity, validate_relpath
from bdn.proto.manifest import MANIFEST_NAME, FileEntry, Manifest
from bdn.proto.parts import (
    MAX_PART_BYTES,
    MAX_WORLD_SIZE,
    PARTS_DIR,
    PartError,
    PartRecord,
    Step,
    merge_parts,
    part_key,
)
from bdn.proto.reserved import reserved_path
from bdn.proto.safetensors_fmt import DTYPE_BITS, safetensors_dtype
from bdn.publish.commit import CHECKSUM_FORMAT, claimed, commit, refuse_published
from bdn.publish.errors import PublishError
from bdn.publish.fetch import read_manifest
from bdn.publish.layout import INDEX_NAME, as_numpy, group, layer_file
from bdn.publish.memfile import Built, delta_file, full_file
from bdn.publish.publisher import check_args, opened

__all__ = ["PartError", "PartRecord", "commit_step", "publish_part"]

#: The delta format of a sharded publish unless asked otherwise: bdn's own (smaller than arc_v2,
#: encoded and decoded on every core); ``"arc_v2"`` for engines that read the hosted format.
SHARDED_COMPRESSION = "bdn_planes_v1"


def publish_part(
    bucket: str | Bucket,
    identity: str,
    tensors: Mapping[str, Any],
    *,
    rank: int,
    world_size: int,
    base: str | None = None,
    base_tensors: Mapping[str, Any] | None = None,
    compression_format: str = SHARDED_COMPRESSION,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    file_of: Callable[[str], str] = layer_file,
    workers: int | None = None,
    uploads: int = 2,
    overwrite: bool = False,
    stats: dict[str, float] | None = None,
) -> PartRecord:
    """Store rank ``rank``'s part of step ``identity``: its files, then its part record.

    ``tensors``: ``{name: array}``, numpy arrays (ml_dtypes bfloat16/float8 included) or torch
    tensors (any device; copied to host memory one at a time, bf16 viewed without conversion).
    ``base``: for a delta, the identity of the published base snapshot; then ``base_tensors``
    must hold the base's values of exactly the names in ``tensors`` (the trainer's previous
    step, or the anchor), and each rebuilt base file is checked against the base manifest's chunk
    digests before anything is uploaded, so a diff is never made against bytes nodes do not
    have. ``compression_format``: ``bdn_planes_v1`` (default), ``arc_v2`` or ``arc_v1``.
    ``chunk_size`` (bytes) must be the same on every rank. ``workers``: encode threads (default:
    the cores); ``uploads``: files uploaded at once while the next ones encode. ``stats``, when
    given, receives seconds of wall time: ``encode_s`` (building files: layout, digests, diff
    streams), ``upload_s`` (from the first upload's start to the last one's end), ``record_s``
    (the part record), and ``stored_bytes``.

    Returns the part record written (files with sizes and chunk digests, tensors with their file,
    dtype and shape).

    Raises:
        IdentityError: ``identity`` or ``base`` breaks the identity rule.
        PublishError: a bad argument (rank outside ``[0, world_size)``, empty ``tensors``, a
            tensor of an unsupported type, ``file_of`` giving a path that is not a
            ``*.safetensors`` file), ``identity`` already published or this rank's part already
            stored (unless ``overwrite``), ``base_tensors`` missing or not naming the same tensors.
        BaseNotPublished: ``base`` has no manifest in the bucket.
        TensorMismatch: a tensor's dtype or shape differs from the base's (naming it), or the
            base has a file this rank's tensors do not rebuild.
        ChecksumError: ``base_tensors`` are not what ``base`` published (naming the file).
        UnsupportedFormat: an unknown ``compression_format``.
        BucketError: the bucket failed; no part record is written then.
    """
    validate_identity(identity)
    _check_rank(rank, world_size)
    check_args(0, chunk_size, max(1, uploads))
    workers = _workers(workers)
    if base is not None:
        validate_identity(base)
        if base == identity:
            raise PublishError(f"delta {identity!r} cannot be its own base")
        arc.check_formats(compression_format, CHECKSUM_FORMAT)
        compression_format = compression_format.lower()
        if base_tensors is None:
            raise PublishError("a delta part needs base_tensors: the base's values of this rank's tensors")
    elif base_tensors is not None:
        raise PublishError("base_tensors go with base (the identity of the published base)")
    if not tensors:
        raise PublishError(f"rank {rank} has no tensors to publish")
    arrays = {n: as_numpy(n, v) for n, v in tensors.items()}
    files = group(arrays, file_of)
    base_arrays = {n: as_numpy(n, v) for n, v in (base_tensors or {}).items()}
    if base is not None and set(base_arrays) != set(arrays):
        extra = min(set(arrays) ^ set(base_arrays))
        raise PublishError(
            f"base_tensors must name exactly this rank's tensors; {extra!r} is in "
            f"{'tensors' if extra in arrays else 'base_tensors'} only"
        )
    with opened(bucket) as b:
        refuse_published(b, identity, overwrite)
        key = part_key(identity, rank, world_size)
        if not overwrite and _exists(b, key):
            raise PublishError(
                f"rank {rank} of {world_size} already stored its part of step {identity!r} ({key}); "
                "a rank publishes each step once (overwrite=True replaces it)"
            )
        base_manifest = read_manifest(b, base) if base is not None else None
        if base_manifest is not None:
            for path in files:
                try:
                    base_manifest.file(path)
                except KeyError:
                    raise TensorMismatch(
                        f"{path}: base snapshot {base!r} has no such file (file_of gives the same files at every "
                        "step: a step with other tensors is a new anchor)"
                    ) from None
        for path in files:
            validate_key(f"{identity}/{path}")
        mapper = thread_map(workers)

        def build(path: str) -> Built:
            if base_manifest is None:
                return full_file(path, files[path], chunk_size, mapper)
            return delta_file(
                path,
                files[path],
                {n: base_arrays[n] for n in files[path]},
                base_manifest.file(path),
                base_manifest.chunk_size,
                base_manifest.identity,
                compression_format,
                chunk_size,
                mapper,
            )

        times: dict[str, float] = {}
        entries = pipeline(b, identity, list(files), build, uploads, times)
        record = PartRecord(
            identity=identity,
            rank=rank,
            world_size=world_size,
            kind="full" if base is None else "delta",
            chunk_size=chunk_size,
            files=tuple(entries),
            tensors={
                n: (path, safetensors_dtype(a), tuple(a.shape)) for path, ts in files.items() for n, a in ts.items()
            },
            base_identity=base,
            compression_format=compression_format if base is not None else None,
        )
        t0 = time.perf_counter()
        b.write(key, record.to_json())
        if stats is not None:
            stats.update(times, record_s=time.perf_counter() - t0, stored_bytes=sum(e.size for e in entries))
    return record


def commit_step(
    bucket: str | Bucket,
    identity: str,
    policy_version: int,
    *,
    world_size: int,
    extra_files: Mapping[str, bytes] | None = None,
    wait_s: float = 0.0,
    overwrite: bool = False,
) -> Manifest:
    """Publish step ``identity`` once all ``world_size`` ranks stored their parts.

    Reads every part record (polling up to ``wait_s`` seconds for missing ones), checks them
    together (:func:`bdn.proto.parts.merge_parts`), writes ``model.safetensors.index.json`` when
    the step has more than one safetensors file, stores ``extra_files`` (``{relative path:
    bytes}``, e.g. ``config.json``; a delta is a whole checkpoint too, so give them at every
    step), and writes the manifest last. Returns the manifest written.

    Raises:
        PartError (a BdnError): a part is missing after ``wait_s`` ("the part of rank 2 of 4
            is not in the bucket"), ranks disagree (world size, kind, base, compression format,
            chunk size), a tensor or a file is published by two ranks, or a delta's files are
            not the base's. Nothing is published then.
        PublishError: ``identity`` already published (unless ``overwrite``), another commit of
            it holds the step's claim (:func:`bdn.publish.commit.claim_commit`), the object at the
            claim's key is not a claim, bad arguments.
        PathError: a bad ``extra_files`` path.
        BucketError: the bucket failed; the manifest is then not written.
    """
    validate_identity(identity)
    _check_rank(0, world_size)
    check_args(policy_version, DEFAULT_CHUNK_SIZE, 1)
    extras = _extra_files(extra_files)
    with opened(bucket) as b:
        refuse_published(b, identity, overwrite)
        step = merge_parts(identity, world_size, _read_parts(b, identity, world_size, wait_s))
        if step.kind == "delta":
            assert step.base_identity is not None
            base = read_manifest(b, step.base_identity)
            want = sorted(f.path for f in base.files if f.path.endswith(".safetensors"))
            have = [f.path for f in step.files]
            if want != have:
                gone = sorted(set(want) - set(have)) or sorted(set(have) - set(want))
                raise PartError(
                    f"step {identity!r}: file {gone[0]!r} is in {'the base' if gone[0] in want else 'the parts'} "
                    f"only: a delta's parts must rebuild every safetensors file of base {base.identity!r}"
                )
        if len(step.files) > 1:
            extras[INDEX_NAME] = index_json(step)
        entries = list(step.files)
        # Right before the first write (the wait for the parts above can be long): only the
        # holder of the step's claim writes its extra files and manifest, so a commit racing
        # this one never replaces the files under the other's manifest.
        with claimed(b, identity, overwrite):
            for path, data in sorted(extras.items()):
                b.write(f"{identity}/{path}", data)
                entries.append(FileEntry(path, len(data), tuple(buffer_digests(data, step.chunk_size))))
            entries.sort(key=lambda e: e.path)
            delta_of = None
            if step.kind == "delta":
                assert step.base_identity is not None and step.compression_format is not None  # checked by merge_parts
                delta_of = (step.base_identity, step.compression_format)
            return commit(b, identity, policy_version, step.chunk_size, entries, overwrite, delta_of=delta_of)


# ---- helpers ----------------------------------------------------------------------------------


def _check_rank(rank: Any, world_size: Any) -> None:
    if type(world_size) is not int or not 1 <= world_size <= MAX_WORLD_SIZE:
        raise PublishError(f"world_size must be an integer in [1, {MAX_WORLD_SIZE}], got {world_size!r}")
    if type(rank) is not int or not 0 <= rank < world_size:
        raise PublishError(f"rank must be an integer in [0, {world_size}), got {rank!r}")


def _workers(workers: int | None) -> int:
    if workers is None:
        return os.cpu_count() or 1
    if type(workers) is not int or workers < 1:
        raise PublishError(f"workers must be a positive integer, got {workers!r}")
    return workers


def _exists(b: Bucket, key: str) -> bool:
    try:
        b.stat(key)
    except ObjectNotFound:
        return False
    return True


def _extra_files(extra_files: Mapping[str, bytes] | None) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for name, data in (extra_files or {}).items():
        validate_relpath(name)
        if name in (MANIFEST_NAME, INDEX_NAME) or reserved_path(name):
            raise PathError(f"extra file {name!r} is a name bdn writes itself")
        if name.endswith(".safetensors"):
            raise PathError(f"extra file {name!r}: safetensors files come from the ranks' parts")
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise PublishError(f"extra file {name!r} must be bytes, got {type(data).__name__}")
        out[name] = bytes(data)
    return out


def _read_parts(b: Bucket, identity: str, world_size: int, wait_s: float) -> list[PartRecord | None]:
    """Every rank's record (None where missing after ``wait_s`` seconds of polling)."""
    deadline = time.monotonic() + max(0.0, wait_s)
    parts: list[PartRecord | None] = [None] * world_size
    while True:
        for r in range(world_size):
            if parts[r] is None:
                key = part_key(identity, r, world_size)
                try:
                    data = b.read(key, MAX_PART_BYTES)
                except ObjectNotFound:
                    continue
                parts[r] = PartRecord.from_json(data, where=key)
        if all(p is not None for p in parts) or time.monotonic() >= deadline:
            break
        time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
    if any(p is None for p in parts):
        others = sorted(
            o.key.rsplit("/", 1)[-1]
            for o in b.list(f"{PARTS_DIR}/{identity}/")
            if o.key.rsplit("/", 1)[-1].startswith("part-") and not o.key.endswith(f"-of-{world_size:05d}.json")
        )
        if others:
            raise PartError(
                f"step {identity!r}: committed for a world size of {world_size}, but the bucket holds {others[0]}: "
                "the ranks and the commit disagree on world_size; nothing was published"
            )
    return parts


def index_json(step: Step) -> bytes:
    """``model.safetensors.index.json`` of a step, as Hugging Face writes it (sorted, indent 2)."""
    total = sum(math.prod(shape) * DTYPE_BITS[dtype] // 8 for _, dtype, shape in step.tensors.values())
    obj = {"metadata": {"total_size": total}, "weight_map": {n: f for n, (f, _, _) in sorted(step.tensors.items())}}
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def pipeline(
    b: Bucket, identity: str, paths: list[str], build: Callable[[str], Built], uploads: int, times: dict[str, float]
) -> list[FileEntry]:
    """Build each file (on this thread) and upload it on ``uploads`` threads while the next builds.

    At most ``uploads`` built files wait or upload at once (a built delta file holds its streams
    in memory). The first error stops building; uploads under way finish; it is raised.
    ``times`` receives ``encode_s`` and ``upload_s`` (see :func:`publish_part`).
    """
    spans: list[tuple[float, float]] = []
    encode = 0.0
    slots = threading.BoundedSemaphore(uploads)
    pool = ThreadPoolExecutor(max_workers=uploads, thread_name_prefix="bdn-part-upload")
    futures: list[Future[FileEntry]] = []

    def up(f: Built) -> FileEntry:
        t0 = time.perf_counter()
        try:
            b.write_buffers(f"{identity}/{f.entry.path}", f.buffers)
            return f.entry
        finally:
            spans.append((t0, time.perf_counter()))
            slots.release()

    try:
        for path in paths:
            slots.acquire()
            if any(fu.done() and fu.exception() is not None for fu in futures):
                slots.release()
                break
            t0 = time.perf_counter()
            try:
                built = build(path)
            except BaseException:
                slots.release()
                raise
            encode += time.perf_counter() - t0
            futures.append(pool.submit(up, built))
        entries = [fu.result() for fu in futures]
        times["encode_s"] = encode
        times["upload_s"] = max(e for _, e in spans) - min(s for s, _ in spans) if spans else 0.0
        return entries
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
