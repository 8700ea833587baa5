"""Publish snapshots to a bucket: full (anchor) and delta checkpoints, and ``STARTUP_SNAPSHOT``.

Source: DESIGN.md ("Bucket layout", "Surfaces"). A snapshot is the directory
``<root>/<identity>/`` plus ``<root>/<identity>/bdn.manifest.json``, which is written *last*,
after every other object was stored: its presence is what tells daemons the snapshot is
complete. Uploads run in parallel (one task per file; the bucket splits large files into
parallel multipart parts), and each file's xxh3-128 chunk digests are computed on the same
worker threads (xxhash releases the GIL).

This module is the public API and the order of the steps; the steps are :mod:`bdn.publish.sources`
(the local files), :mod:`bdn.publish.diffs`, :mod:`bdn.publish.uploads` and
:mod:`bdn.publish.commit` (the manifest).

A delta holds, for each ``*.safetensors`` file of the target, an ``arc_v1``/``arc_v2`` diff file
with the same name (per tensor ``zstd|zlib(base XOR target)``, see :mod:`bdn.proto.arc`), and a
plain copy of every other file. Its manifest records the diff's own size and digests and, under
``result``, those of the target file the node will rebuild.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

from bdn.bucket import Bucket, ObjectNotFound, open_bucket
from bdn.daemon.apply.headers import SUFFIX, HeaderRefused, check_file
from bdn.proto import arc
from bdn.proto.chunks import DEFAULT_CHUNK_SIZE, MAX_CHUNK_SIZE, MIN_CHUNK_SIZE
from bdn.proto.identity import validate_identity
from bdn.proto.manifest import MANIFEST_NAME, STARTUP_NAME, Manifest
from bdn.publish.commit import CHECKSUM_FORMAT, claimed, commit, refuse_published
from bdn.publish.diffs import make_diffs
from bdn.publish.errors import PublishError
from bdn.publish.fetch import read_manifest
from bdn.publish.sources import PathLike, base_files, source_dir
from bdn.publish.tree import LocalFile, scan_dir
from bdn.publish.uploads import ProgressFn, Upload, store_all

__all__ = ["CHECKSUM_FORMAT", "ProgressFn", "publish_delta", "publish_full", "publish_startup"]


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
    check_headers: bool = True,
) -> Manifest:
    """Publish a full snapshot (an anchor) as ``<bucket>/<identity>/``.

    Give exactly one of ``dir`` (a Hugging Face checkpoint directory; every file under it is
    published, recursively) or ``state_dict`` (``{tensor name: ndarray}``, written as
    ``model.safetensors`` with ``__metadata__ {"format": "pt"}`` in a temporary directory under
    ``tmp_dir``, next to ``extra_files`` such as ``{"config.json": b"..."}``).

    ``chunk_size`` (bytes) is recorded in the manifest; ``workers`` files are stored at a time.
    ``progress(n)`` is called (serialised, from worker threads) as each file's ``n`` bytes are
    stored. Every ``*.safetensors`` file must open in the safetensors library, as every daemon
    checks before READY (``check_headers=False`` skips that: the daemons' own check is tested
    with files the library refuses). A published identity is refused unless ``overwrite``; overwriting replaces objects in
    place and the old manifest stays until the new one is written, so a daemon fetching it
    meanwhile sees digest mismatches and fails that snapshot rather than loading mixed bytes.
    If any upload fails, the ones already running finish, the rest are not started, and no
    manifest is written (objects already stored stay, unpublished).

    Returns the manifest that was written.

    Raises:
        IdentityError: ``identity`` breaks the identity rule.
        PublishError: the snapshot is already published (and not ``overwrite``), another publish
            of it holds its claim (:func:`bdn.publish.commit.claim_commit`: nothing uploaded), a local file
            cannot be read or changed during the upload, a ``*.safetensors`` file does not open
            in the safetensors library (checked before any upload), or an argument is out of range.
        PathError: the directory holds an unsafe path, symlink or special file.
        BucketError: the bucket failed; the manifest is then not written.
    """
    validate_identity(identity)
    check_args(policy_version, chunk_size, workers)
    with opened(bucket) as b:
        refuse_published(b, identity, overwrite)
        with source_dir(dir, state_dict, extra_files, tmp_dir) as src:
            files = scan_dir(src)
            if check_headers:
                _check_headers(files)
            with claimed(b, identity, overwrite):  # before the first write: one publisher stores objects
                entries = store_all(
                    b, identity, [Upload(f.path, f.local) for f in files], chunk_size, workers, progress
                )
                return commit(b, identity, policy_version, chunk_size, entries, overwrite)


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
        PublishError: the snapshot is already published, another publish of it holds its claim,
            a target ``*.safetensors`` file has no
            counterpart in the base or does not open in the safetensors library, or an argument
            is out of range.
        ChecksumError: a local base file differs from what ``base`` published.
        TensorMismatch: a tensor's name, shape or dtype differs between base and target.
        PathError, BucketError: as for :func:`publish_full`.
    """
    validate_identity(identity)
    validate_identity(base)
    if base == identity:
        raise PublishError(f"delta {identity!r} cannot be its own base")
    check_args(policy_version, chunk_size, workers)
    arc.check_formats(compression_format, CHECKSUM_FORMAT)
    # Accepted case-insensitively (as the hot-load services do); recorded in its canonical form.
    compression_format = compression_format.lower()
    if base_dir is not None and base_state_dict is not None:
        raise PublishError("give base_dir or base_state_dict, not both")
    with opened(bucket) as b:
        refuse_published(b, identity, overwrite)
        base_manifest = read_manifest(b, base)
        with (
            source_dir(dir, state_dict, extra_files, tmp_dir) as src,
            tempfile.TemporaryDirectory(dir=tmp_dir, prefix="bdn-delta-") as work_s,
        ):
            work = Path(work_s)
            files = scan_dir(src)
            _check_headers(files)
            tensors = [f for f in files if f.path.endswith(".safetensors")]
            for f in tensors:
                try:
                    base_manifest.file(f.path)
                except KeyError:
                    raise PublishError(f"target file {f.path!r} has no counterpart in base snapshot {base!r}") from None
            base_root = base_files(
                b, base_manifest, [f.path for f in tensors], base_dir, base_state_dict, work, workers
            )
            uploads = make_diffs(base_root, tensors, work / "diff", compression_format, chunk_size, workers)
            diffed = {f.path for f in tensors}
            uploads += [Upload(f.path, f.local) for f in files if f.path not in diffed]
            uploads.sort(key=lambda u: u.path)
            with claimed(b, identity, overwrite):  # before the first write: one publisher stores objects
                entries = store_all(b, identity, uploads, chunk_size, workers, progress)
                return commit(
                    b, identity, policy_version, chunk_size, entries, overwrite, delta_of=(base, compression_format)
                )


def publish_startup(bucket: str | Bucket, identity: str) -> None:
    """Write ``<bucket>/STARTUP_SNAPSHOT`` = ``"<identity>\\n"``: what new replicas load first.

    Raises:
        IdentityError: ``identity`` breaks the identity rule.
        PublishError: ``identity`` is not published (no ``<identity>/bdn.manifest.json``).
        BucketError: the bucket failed.
    """
    validate_identity(identity)
    with opened(bucket) as b:
        try:
            b.stat(f"{identity}/{MANIFEST_NAME}")
        except ObjectNotFound:
            raise PublishError(
                f"snapshot {identity!r} is not published (no {MANIFEST_NAME}); publish it first"
            ) from None
        b.write(STARTUP_NAME, f"{identity}\n".encode())


# ---- helpers ----------------------------------------------------------------------------------


def _check_headers(files: list[LocalFile]) -> None:
    """Refuse, before anything is uploaded, a ``*.safetensors`` file that the safetensors library
    does not open (a truncated copy, a bad header): every daemon would fail the snapshot at its
    last check before READY (``bdn.daemon.apply.headers``, the same rule), after the fleet fetched it.

    Raises:
        PublishError: "<path>: the safetensors library refuses its header: <its reason> ...".
    """
    for f in files:
        if f.path.endswith(SUFFIX):
            try:
                check_file(f.local, f.path)
            except HeaderRefused as e:
                raise PublishError(f"{e}; every bdnd would fail this snapshot, so nothing was uploaded") from None


def check_args(policy_version: int, chunk_size: int, workers: int) -> None:
    """PublishError unless the policy version, chunk size (bytes) and worker count are in range."""
    if (
        isinstance(policy_version, bool)
        or not isinstance(policy_version, int)
        or not (0 <= policy_version <= 2**63 - 1)
    ):
        raise PublishError(f"policy version must be an integer in [0, 2**63-1], got {policy_version!r}")
    if (
        isinstance(chunk_size, bool)
        or not isinstance(chunk_size, int)
        or not (MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE)
    ):
        raise PublishError(
            f"chunk size must be an integer in [{MIN_CHUNK_SIZE}, {MAX_CHUNK_SIZE}] bytes, got {chunk_size!r}"
        )
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise PublishError(f"workers must be a positive integer, got {workers!r}")


@contextlib.contextmanager
def opened(bucket: str | Bucket) -> Iterator[Bucket]:
    """The bucket object; one opened here from a URL is closed again on the way out."""
    if isinstance(bucket, Bucket):
        yield bucket
        return
    b = open_bucket(bucket)
    try:
        yield b
    finally:
        b.close()
