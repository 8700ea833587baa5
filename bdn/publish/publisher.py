"""Publish snapshots to a bucket: full (anchor) and delta checkpoints, and ``STARTUP_SNAPSHOT``.

Source: DESIGN.md ("Bucket layout", "Surfaces"). A snapshot is the directory
``<root>/<identity>/`` plus ``<root>/<identity>/bdn.manifest.json``, which is written *last*,
after every other object was stored: its presence is what tells daemons the snapshot is
complete. Uploads run in parallel (one task per file; the bucket splits large files into
parallel multipart parts), and each file's xxh3-128 chunk digests are computed on the same
worker threads (xxhash releases the GIL).

A delta holds, for each ``*.safetensors`` file of the target, an ``arc_v1``/``arc_v2`` diff file
with the same name (per tensor ``zstd|zlib(base XOR target)``, see :mod:`bdn.proto.arc`), and a
plain copy of every other file. Its manifest records the diff's own size and digests and, under
``result``, those of the target file the node will rebuild.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from bdn.bucket import Bucket, ObjectNotFound, open_bucket, validate_key
from bdn import fileops
from bdn.proto import arc
from bdn.proto.chunks import DEFAULT_CHUNK_SIZE, MAX_CHUNK_SIZE, MIN_CHUNK_SIZE
from bdn.proto.errors import PathError, TensorMismatch
from bdn.proto.identity import validate_identity, validate_relpath
from bdn.proto.manifest import MANIFEST_NAME, STARTUP_NAME, FileEntry, FileResult, Manifest
from bdn.proto.reserved import reserved_path
from bdn.publish.errors import PublishError
from bdn.publish.fetch import check_local_file, materialize, read_manifest
from bdn.publish.tree import LocalFile, scan_dir

#: The checksum format of every delta bdn writes, spelled as the hosted hot-load APIs spell it.
CHECKSUM_FORMAT = "alder32"
#: The file a state dict is written to (a single-file Hugging Face checkpoint).
STATE_DICT_FILE = "model.safetensors"
#: ``__metadata__`` of a state dict's file, as ``safetensors.torch.save_file`` writes it.
STATE_DICT_METADATA = {"format": "pt"}

#: Called with a number of bytes each time that many more bytes were stored in the bucket.
ProgressFn = Callable[[int], None]
PathLike = str | os.PathLike[str]


@dataclass(frozen=True)
class _Upload:
    """One object to store: snapshot ``path``, the local file to send, and for a diff the result."""

    path: str
    local: Path
    result: FileResult | None = None


# ---- public API -------------------------------------------------------------------------------


def publish_full(
    bucket: str | Bucket,
    identity: str,
    policy_version: int,
    *,
    dir: PathLike | None = None,
    state_dict: Mapping[str, np.ndarray] | None = None,
    extra_files: Mapping[str, bytes] | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    workers: int = 8,
    overwrite: bool = False,
    progress: ProgressFn | None = None,
    tmp_dir: PathLike | None = None,
) -> Manifest:
    """Publish a full snapshot (an anchor) as ``<bucket>/<identity>/``.

    Give exactly one of ``dir`` (a Hugging Face checkpoint directory; every file under it is
    published, recursively) or ``state_dict`` (``{tensor name: ndarray}``, written as
    ``model.safetensors`` with ``__metadata__ {"format": "pt"}`` in a temporary directory under
    ``tmp_dir``, next to ``extra_files`` such as ``{"config.json": b"..."}``).

    ``chunk_size`` (bytes) is recorded in the manifest; ``workers`` files are stored at a time.
    ``progress(n)`` is called (serialised, from worker threads) as each file's ``n`` bytes are
    stored. A published identity is refused unless ``overwrite``; overwriting replaces objects in
    place and the old manifest stays until the new one is written, so a daemon fetching it
    meanwhile sees digest mismatches and fails that snapshot rather than loading mixed bytes.
    If any upload fails, the ones already running finish, the rest are not started, and no
    manifest is written (objects already stored stay, unpublished).

    Returns the manifest that was written.

    Raises:
        IdentityError: ``identity`` breaks the identity rule.
        PublishError: the snapshot is already published (and not ``overwrite``), a local file
            cannot be read or changed during the upload, or an argument is out of range.
        PathError: the directory holds an unsafe path, symlink or special file.
        BucketError: the bucket failed; the manifest is then not written.
    """
    validate_identity(identity)
    _check_args(policy_version, chunk_size, workers)
    with _opened(bucket) as b:
        _refuse_published(b, identity, overwrite)
        with _source_dir(dir, state_dict, extra_files, tmp_dir) as src:
            files = scan_dir(src)
            entries = _store_all(
                b, identity, [_Upload(f.path, f.local) for f in files], chunk_size, workers, progress
            )
        return _commit(b, identity, policy_version, chunk_size, entries, overwrite)


def publish_delta(
    bucket: str | Bucket,
    identity: str,
    policy_version: int,
    base: str,
    *,
    dir: PathLike | None = None,
    state_dict: Mapping[str, np.ndarray] | None = None,
    extra_files: Mapping[str, bytes] | None = None,
    base_dir: PathLike | None = None,
    base_state_dict: Mapping[str, np.ndarray] | None = None,
    compression_format: str = "arc_v2",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    workers: int = 8,
    overwrite: bool = False,
    progress: ProgressFn | None = None,
    tmp_dir: PathLike | None = None,
) -> Manifest:
    """Publish snapshot ``identity`` as a delta against the published snapshot ``base``.

    The target is ``dir`` or ``state_dict`` (+ ``extra_files``) as for :func:`publish_full`. The
    base's files come from ``base_dir`` (the trainer's previous checkpoint directory) or
    ``base_state_dict``, or, when neither is given, are downloaded from ``<bucket>/<base>/``
    (following the base's own chain if it is a delta). Local base files are checked against the
    base manifest's digests first, so a diff is never made against bytes the nodes do not have.

    Every ``*.safetensors`` file of the target becomes a diff file of the same name in
    ``compression_format`` (``arc_v1`` or ``arc_v2``); every other file is stored as is.

    Returns the manifest that was written.

    Raises:
        IdentityError: ``identity`` or ``base`` breaks the identity rule.
        UnsupportedFormat: ``compression_format`` is not one bdn writes (the message lists them).
        BaseNotPublished: ``base`` has no ``bdn.manifest.json`` in the bucket.
        PublishError: the snapshot is already published, a target ``*.safetensors`` file has no
            counterpart in the base, or an argument is out of range.
        ChecksumError: a local base file differs from what ``base`` published.
        TensorMismatch: a tensor's name, shape or dtype differs between base and target.
        PathError, BucketError: as for :func:`publish_full`.
    """
    validate_identity(identity)
    validate_identity(base)
    if base == identity:
        raise PublishError(f"delta {identity!r} cannot be its own base")
    _check_args(policy_version, chunk_size, workers)
    arc.check_formats(compression_format, CHECKSUM_FORMAT)
    # Accepted case-insensitively (as the hot-load services do); recorded in its canonical form.
    compression_format = compression_format.lower()
    if base_dir is not None and base_state_dict is not None:
        raise PublishError("give base_dir or base_state_dict, not both")
    with _opened(bucket) as b:
        _refuse_published(b, identity, overwrite)
        base_manifest = read_manifest(b, base)
        with (
            _source_dir(dir, state_dict, extra_files, tmp_dir) as src,
            tempfile.TemporaryDirectory(dir=tmp_dir, prefix="bdn-delta-") as work_s,
        ):
            work = Path(work_s)
            files = scan_dir(src)
            tensors = [f for f in files if f.path.endswith(".safetensors")]
            for f in tensors:
                try:
                    base_manifest.file(f.path)
                except KeyError:
                    raise PublishError(
                        f"target file {f.path!r} has no counterpart in base snapshot {base!r}"
                    ) from None
            base_root = _base_files(
                b, base_manifest, [f.path for f in tensors], base_dir, base_state_dict, work, workers
            )
            uploads = _make_diffs(
                base_root, tensors, work / "diff", compression_format, chunk_size, workers
            )
            diffed = {f.path for f in tensors}
            uploads += [_Upload(f.path, f.local) for f in files if f.path not in diffed]
            uploads.sort(key=lambda u: u.path)
            entries = _store_all(b, identity, uploads, chunk_size, workers, progress)
        return _commit(b, identity, policy_version, chunk_size, entries, overwrite, delta_of=(base, compression_format))


def publish_startup(bucket: str | Bucket, identity: str) -> None:
    """Write ``<bucket>/STARTUP_SNAPSHOT`` = ``"<identity>\\n"``: what new replicas load first.

    Raises:
        IdentityError: ``identity`` breaks the identity rule.
        PublishError: ``identity`` is not published (no ``<identity>/bdn.manifest.json``).
        BucketError: the bucket failed.
    """
    validate_identity(identity)
    with _opened(bucket) as b:
        try:
            b.stat(f"{identity}/{MANIFEST_NAME}")
        except ObjectNotFound:
            raise PublishError(
                f"snapshot {identity!r} is not published (no {MANIFEST_NAME}); publish it first"
            ) from None
        b.write(STARTUP_NAME, f"{identity}\n".encode())


# ---- helpers ----------------------------------------------------------------------------------


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _check_args(policy_version: int, chunk_size: int, workers: int) -> None:
    if isinstance(policy_version, bool) or not isinstance(policy_version, int) or not (
        0 <= policy_version <= 2**63 - 1
    ):
        raise PublishError(f"policy version must be an integer in [0, 2**63-1], got {policy_version!r}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or not (
        MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE
    ):
        raise PublishError(
            f"chunk size must be an integer in [{MIN_CHUNK_SIZE}, {MAX_CHUNK_SIZE}] bytes, got {chunk_size!r}"
        )
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise PublishError(f"workers must be a positive integer, got {workers!r}")


@contextlib.contextmanager
def _opened(bucket: str | Bucket) -> Iterator[Bucket]:
    """The bucket object; one opened here from a URL is closed again on the way out."""
    if isinstance(bucket, Bucket):
        yield bucket
        return
    b = open_bucket(bucket)
    try:
        yield b
    finally:
        b.close()


def _refuse_published(b: Bucket, identity: str, overwrite: bool) -> None:
    if overwrite:
        return
    try:
        b.stat(f"{identity}/{MANIFEST_NAME}")
    except ObjectNotFound:
        return
    raise PublishError(
        f"snapshot {identity!r} is already published ({identity}/{MANIFEST_NAME} exists); "
        "choose a new identity, or overwrite it (--overwrite, overwrite=True)"
    )


def _commit(
    b: Bucket, identity: str, policy_version: int, chunk_size: int, entries: list[FileEntry], overwrite: bool,
    *, delta_of: tuple[str, str] | None = None,
) -> Manifest:
    """Build the snapshot's manifest and write it: the last object, whose presence publishes it.

    ``delta_of`` is ``(base identity, compression format)`` for a delta, None for a full
    snapshot. Returns the manifest written.
    """
    base, fmt = delta_of if delta_of is not None else (None, None)
    manifest = Manifest(
        identity=identity,
        kind="full" if delta_of is None else "delta",
        policy_version=policy_version,
        chunk_size=chunk_size,
        files=tuple(entries),
        created_at=_now(),
        base_identity=base,
        compression_format=fmt,
        checksum_format=None if delta_of is None else CHECKSUM_FORMAT,
    )
    # Checked again because another publisher may have committed the same identity meanwhile;
    # the bucket interface has no conditional put, so a narrow race remains.
    _refuse_published(b, manifest.identity, overwrite)
    data = manifest.to_json()
    # Re-parse what we are about to publish: daemons will hold it to the same rules.
    Manifest.from_json(data, expect_identity=manifest.identity)
    b.write(f"{manifest.identity}/{MANIFEST_NAME}", data)
    return manifest


@contextlib.contextmanager
def _source_dir(
    dir: PathLike | None,
    state_dict: Mapping[str, np.ndarray] | None,
    extra_files: Mapping[str, bytes] | None,
    tmp_dir: PathLike | None,
) -> Iterator[Path]:
    """The directory to publish: ``dir`` itself, or a temporary one holding the state dict."""
    if (dir is None) == (state_dict is None):
        raise PublishError("give exactly one of dir or state_dict")
    if dir is not None:
        if extra_files:
            raise PublishError("extra_files go with state_dict; put them in dir instead")
        yield Path(dir)
        return
    assert state_dict is not None
    with tempfile.TemporaryDirectory(dir=tmp_dir, prefix="bdn-publish-") as t:
        root = Path(t)
        _write_state_dict(root / STATE_DICT_FILE, state_dict)
        for name, data in (extra_files or {}).items():
            validate_relpath(name)
            if name in (STATE_DICT_FILE, MANIFEST_NAME):
                raise PathError(f"extra file {name!r} would replace a file bdn writes itself")
            if reserved_path(name):
                raise PathError(f"extra file {reserved_path(name)}")
            if not isinstance(data, (bytes, bytearray, memoryview)):
                raise PublishError(f"extra file {name!r} must be bytes, got {type(data).__name__}")
            p = root / name
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
        yield root


def _write_state_dict(path: Path, state_dict: Mapping[str, np.ndarray]) -> None:
    if not state_dict:
        raise PublishError("state dict is empty")
    fileops.save(path, state_dict, dict(STATE_DICT_METADATA))


def _base_files(
    b: Bucket,
    base_manifest: Manifest,
    paths: list[str],
    base_dir: PathLike | None,
    base_state_dict: Mapping[str, np.ndarray] | None,
    work: Path,
    workers: int,
) -> Path:
    """A directory holding the base's reconstructed ``paths``, checked against its manifest."""
    base = base_manifest.identity
    if base_dir is None and base_state_dict is None:
        root = work / "base"
        materialize(b, base_manifest, paths, root, workers=workers)
        return root
    if base_state_dict is not None:
        root = work / "base"
        root.mkdir()
        _write_state_dict(root / STATE_DICT_FILE, base_state_dict)
        what = "base_state_dict"
    else:
        root = Path(base_dir)  # type: ignore[arg-type]
        what = "base_dir"
        if not root.is_dir():
            raise PathError(f"base_dir {str(root)!r} is not a directory")
    for p in paths:
        local = root / p
        if not local.is_file():
            raise PublishError(f"{what} has no {p!r}, which the target and base snapshot {base!r} have")
        check_local_file(
            local,
            base_manifest.file(p),
            base_manifest.chunk_size,
            f"{what} file {p!r} is not what base snapshot {base!r} published",
        )
    return root


def _make_diffs(
    base_root: Path,
    tensors: list[LocalFile],
    out_root: Path,
    compression_format: str,
    chunk_size: int,
    workers: int,
) -> list[_Upload]:
    """Write one diff file per target safetensors file; return them as uploads with results."""

    # Diffing holds a shard's base and target mapped plus its compressed output: bound the files
    # in flight by cores, not by upload workers, and give each file's tensors the cores left.
    cores = os.cpu_count() or 1
    n = max(1, min(workers, cores, len(tensors)))
    per_file = max(1, cores // n)

    def one(f: LocalFile) -> _Upload:
        out = out_root / f.path
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            fileops.write_diff_file(
                base_root / f.path, f.local, out, compression_format, workers=per_file
            )
        except TensorMismatch as e:
            raise TensorMismatch(f"{f.path}: {e}") from None
        result = FileResult(f.local.stat().st_size, tuple(_digests(f.local, chunk_size, f.path)))
        return _Upload(f.path, out, result)

    return _run_all(one, tensors, n)


def _digests(local: Path, chunk_size: int, path: str) -> list[str]:
    try:
        return fileops.chunk_digests(local, chunk_size)
    except OSError as e:
        raise PublishError(f"cannot read {path!r}: {e.strerror or e}") from None


def _store_all(
    b: Bucket,
    identity: str,
    uploads: list[_Upload],
    chunk_size: int,
    workers: int,
    progress: ProgressFn | None,
) -> list[FileEntry]:
    """Store every upload under ``<identity>/`` in parallel; their entries, in upload order."""
    for u in uploads:
        # Before the first byte moves: a path too long for a bucket key should not fail midway.
        validate_key(f"{identity}/{u.path}")
    lock = threading.Lock()

    def one(u: _Upload) -> FileEntry:
        try:
            before = os.stat(u.local)
        except OSError as e:
            raise PublishError(f"cannot read {u.path!r}: {e.strerror or e}") from None
        chunks = _digests(u.local, chunk_size, u.path)
        b.write_file(f"{identity}/{u.path}", u.local)
        after = os.stat(u.local)
        if (before.st_size, before.st_mtime_ns) != (after.st_size, after.st_mtime_ns):
            raise PublishError(f"{u.path!r} changed while it was being published")
        if progress is not None:
            with lock:
                progress(after.st_size)
        return FileEntry(u.path, after.st_size, tuple(chunks), u.result)

    return _run_all(one, uploads, workers)


def _run_all(fn: Callable, items: list, workers: int) -> list:  # type: ignore[type-arg]
    """``[fn(x) for x in items]`` on ``workers`` threads; the first error cancels what has not
    started and is raised once the running calls have finished."""
    if not items:
        return []
    ex = ThreadPoolExecutor(max_workers=max(1, min(workers, len(items))), thread_name_prefix="bdn-publish")
    try:
        futures: list[Future] = [ex.submit(fn, x) for x in items]  # type: ignore[type-arg]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        for f in done:
            if f.exception() is not None:
                ex.shutdown(wait=True, cancel_futures=True)
                raise f.exception()  # type: ignore[misc]
        return [f.result() for f in futures]
    finally:
        ex.shutdown(wait=True, cancel_futures=True)
