"""Rebuild a published snapshot's files from the bucket, verified chunk by chunk.

The publisher needs a delta's base files when the trainer no longer has them (neither
``base_dir`` nor ``base_state_dict`` given). The base may itself be a delta, so this walks the
chain back to the nearest full snapshot, applying each diff on the way (``target = base XOR
diff``, DESIGN.md "On the node"), and checks every downloaded chunk and every rebuilt file
against the manifests' xxh3-128 digests. Only the files asked for are fetched.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bdn.bucket import Bucket, ObjectNotFound
from bdn.fileops import apply_delta_file, first_mismatch, write_verified
from bdn.proto.errors import ChecksumError, ManifestError
from bdn.proto.manifest import MANIFEST_NAME, FileEntry, Manifest
from bdn.publish.errors import BaseNotPublished

#: Longest base chain followed before giving up (a loop in the bucket would otherwise recurse).
MAX_CHAIN = 256


def read_manifest(bucket: Bucket, identity: str) -> Manifest:
    """The validated manifest of ``identity``.

    Raises:
        BaseNotPublished: the manifest object does not exist.
        ManifestError: it does not parse or names another identity.
        BucketError: the bucket failed.
    """
    try:
        data = bucket.read(f"{identity}/{MANIFEST_NAME}")
    except ObjectNotFound:
        raise BaseNotPublished(f"base snapshot {identity!r} is not published (no {MANIFEST_NAME})") from None
    return Manifest.from_json(data, expect_identity=identity)


def check_local_file(local: Path, entry: FileEntry, chunk_size: int, what: str) -> None:
    """Check that the file at ``local`` is the reconstructed file ``entry`` describes.

    Raises:
        ChecksumError: size or a chunk digest differs (names ``what`` and the chunk).
    """
    try:
        size = os.stat(local).st_size
    except OSError as e:
        raise ChecksumError(f"{what}: cannot read {str(local)!r}: {e.strerror or e}") from None
    if size != entry.result_size:
        raise ChecksumError(f"{what}: {size} bytes, the snapshot has {entry.result_size}")
    try:
        bad = first_mismatch(local, chunk_size, entry.result_chunks)
    except OSError as e:
        raise ChecksumError(f"{what}: cannot read {str(local)!r}: {e.strerror or e}") from None
    if bad is not None:
        raise ChecksumError(f"{what}: chunk {bad[0]} differs from the snapshot")


def download_file(bucket: Bucket, key: str, entry: FileEntry, chunk_size: int, dest: Path, workers: int) -> None:
    """Download the stored object ``key`` (described by ``entry``) to ``dest``, chunks in parallel.

    Raises:
        ChecksumError: the object's size or a chunk's digest differs from ``entry``.
        BucketError: the bucket failed.
    """
    info = bucket.stat(key)
    if info.size != entry.size:
        raise ChecksumError(f"{key}: object is {info.size} bytes, the manifest says {entry.size}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(dest, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, entry.size)
    finally:
        os.close(fd)

    def one(i: int) -> None:
        off = i * chunk_size
        # One buffer per chunk: simple and safe under cancellation; this path only runs when the
        # trainer lost its base, so one extra copy is acceptable.
        buf = bytearray(min(chunk_size, entry.size - off))
        bucket.read_range_into(key, off, memoryview(buf))
        if not write_verified(buf, entry.chunks[i], dest, off):
            raise ChecksumError(f"{key}: chunk {i} does not match the manifest digest")

    with ThreadPoolExecutor(max(1, workers)) as ex:
        for f in [ex.submit(one, i) for i in range(len(entry.chunks))]:
            f.result()


def materialize(
    bucket: Bucket,
    manifest: Manifest,
    paths: Iterable[str],
    dest: Path,
    *,
    workers: int = 8,
    _depth: int = 0,
) -> None:
    """Write the reconstructed files ``paths`` of snapshot ``manifest`` under ``dest``.

    Raises:
        ManifestError: a path is not in the snapshot, or the base chain is too long.
        BaseNotPublished: a base along the chain has no manifest.
        ChecksumError: downloaded or rebuilt bytes differ from the manifests.
        TensorMismatch / ProtocolError: a diff file does not fit its base.
        BucketError: the bucket failed.
    """
    paths = list(paths)
    if _depth > MAX_CHAIN:
        raise ManifestError(f"base chain of {manifest.identity!r} is longer than {MAX_CHAIN} snapshots")
    entries: dict[str, FileEntry] = {}
    for p in paths:
        try:
            entries[p] = manifest.file(p)
        except KeyError:
            raise ManifestError(f"snapshot {manifest.identity!r} has no file {p!r}") from None
    plain = [p for p in paths if not entries[p].is_diff]
    diffs = [p for p in paths if entries[p].is_diff]
    for p in plain:
        download_file(bucket, f"{manifest.identity}/{p}", entries[p], manifest.chunk_size, dest / p, workers)
    if not diffs:
        return
    assert manifest.base_identity is not None  # a diff entry exists only in a delta manifest
    base_manifest = read_manifest(bucket, manifest.base_identity)
    dest.mkdir(parents=True, exist_ok=True)
    # Scratch beside dest (same file system), never inside it: snapshot paths may be anything.
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".bdn-chain-") as scratch:
        base_dir = Path(scratch) / "base"
        diff_dir = Path(scratch) / "diff"
        materialize(bucket, base_manifest, diffs, base_dir, workers=workers, _depth=_depth + 1)
        for p in diffs:
            e = entries[p]
            download_file(bucket, f"{manifest.identity}/{p}", e, manifest.chunk_size, diff_dir / p, workers)
            out = dest / p
            out.parent.mkdir(parents=True, exist_ok=True)
            assert manifest.compression_format is not None
            assert e.result is not None
            apply_delta_file(
                base_dir / p,
                diff_dir / p,
                out,
                manifest.compression_format,
                e.result.size,
                workers=workers,
                name=f"{manifest.identity}/{p}",
            )
            check_local_file(out, e, manifest.chunk_size, f"{manifest.identity}/{p} rebuilt from its diff")
            os.unlink(diff_dir / p)
            os.unlink(base_dir / p)
