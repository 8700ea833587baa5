"""Read a foreign snapshot's table from the bucket: one listing, then each safetensors header.

Only the :class:`bdn.bucket.Bucket` interface is used, and every read is conditional on the
version token the listing gave (``if_match``), so the headers and the table describe one version
of each object; an object replaced meanwhile raises :class:`bdn.bucket.ObjectChanged`.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from bdn.bucket import Bucket, ObjectChecksum
from bdn.proto.foreign import (
    HEADER_PROBE_BYTES,
    INDEX_SUFFIX,
    MAX_INDEX_BYTES,
    ForeignObject,
    ForeignSnapshotError,
    ForeignTable,
    derive_table,
    header_span,
    listed_objects,
)
from bdn.proto.identity import validate_identity
from bdn.proto.manifest import MAX_FILES, MAX_TOTAL_CHUNKS, ChunkRef, Manifest
from bdn.proto.safetensors_fmt import Header

#: Headers read at once (each is one or two ranged GETs).
HEADER_READERS = 8


def read_head(bucket: Bucket, obj: ForeignObject) -> bytes:
    """The first :func:`bdn.proto.foreign.header_span` bytes of safetensors object ``obj``, at its
    version token: one ranged read of up to :data:`HEADER_PROBE_BYTES`, a second one only for a
    larger header. Raises ``BucketError`` / ``ObjectChanged`` / ``ForeignSnapshotError``."""
    first = bytearray(min(obj.size, HEADER_PROBE_BYTES))
    if not first:
        raise ForeignSnapshotError(f"{obj.key} is empty, not a safetensors file")
    bucket.read_range_into(obj.key, 0, memoryview(first), if_match=obj.etag)
    need = header_span(first, obj.size)
    if need <= len(first):
        return bytes(first[:need])
    rest = bytearray(need - len(first))
    bucket.read_range_into(obj.key, len(first), memoryview(rest), if_match=obj.etag)
    return bytes(first + rest)


def read_foreign_table(
    bucket: Bucket,
    identity: str,
    *,
    chunk_size: int,
    policy_version: int,
    base_identity: str | None = None,
    base: Manifest | None = None,
    base_headers: dict[str, Header] | None = None,
    compression_format: str | None = None,
    max_files: int = MAX_FILES,
    max_chunks: int = MAX_TOTAL_CHUNKS,
) -> ForeignTable:
    """List ``<identity>/`` in ``bucket``, read what the table needs, and derive it.

    Arguments as :func:`bdn.proto.foreign.derive_table` (``base``: the table of
    ``base_identity``, a bdn manifest or a foreign table's ``manifest``). Reads: one listing
    (paged), per safetensors object one ranged GET of at most 256 KiB (two for a larger header),
    per ``*.safetensors.index.json`` one ranged GET; nothing else. Raises ``BucketError``
    (``ObjectChanged`` naming the object replaced meanwhile), ``IncompleteSnapshot`` (nothing
    listed, or a shard the index names is missing: list again later),
    ``ForeignSnapshotError``/``UnsupportedFormat``/``ManifestError`` (final).
    """
    identity = validate_identity(identity)
    objects = listed_objects(identity, bucket.list(identity + "/"))
    if len(objects) > max_files:  # before any header is read
        raise ForeignSnapshotError(f"{identity} has {len(objects)} files, over the limit of {max_files}")
    tensors = [o for o in objects if o.path.endswith(".safetensors")]
    indexes = [o for o in objects if o.path.endswith(INDEX_SUFFIX)]
    for o in indexes:
        if o.size > MAX_INDEX_BYTES:
            raise ForeignSnapshotError(f"{o.key} is {o.size} bytes, over the {MAX_INDEX_BYTES}-byte limit for an index")
    with ThreadPoolExecutor(max_workers=max(1, min(HEADER_READERS, len(tensors)))) as pool:
        heads = dict(zip((o.path for o in tensors), pool.map(lambda o: read_head(bucket, o), tensors)))
    index_bytes: dict[str, bytes] = {}
    for o in indexes:
        buf = bytearray(o.size)
        bucket.read_range_into(o.key, 0, memoryview(buf), if_match=o.etag)
        index_bytes[o.path] = bytes(buf)
    return derive_table(
        identity,
        objects,
        heads,
        chunk_size=chunk_size,
        policy_version=policy_version,
        base_identity=base_identity,
        base=base,
        base_headers=base_headers,
        compression_format=compression_format,
        indexes=index_bytes,
        max_files=max_files,
        max_chunks=max_chunks,
    )


def read_chunk(bucket: Bucket, table: ForeignTable, ref: ChunkRef, out: memoryview) -> None:
    """Fill ``out`` (``ref.length`` bytes) with stored chunk ``ref`` of ``table`` from the bucket,
    at the object's version token: the only way an owner should read a foreign chunk.

    Raises ``ObjectChanged`` (naming the key) when the object was replaced since the listing,
    ``BucketError`` otherwise. The bytes are not verified here: chunk ids are not digests.
    """
    obj = table.objects[ref.file_index]
    if memoryview(out).nbytes != ref.length:
        raise ValueError(f"chunk {ref.index} of {obj.key} is {ref.length} bytes, the buffer {memoryview(out).nbytes}")
    bucket.read_range_into(obj.key, ref.offset, out, if_match=obj.etag)


def object_checksum(bucket: Bucket, table: ForeignTable, path: str) -> ObjectChecksum:
    """What the bucket vouches for about file ``path`` of ``table`` (one HEAD, two for an S3
    multipart object); raises ``ObjectChanged`` when its version is gone."""
    obj = table.object(path)
    return bucket.checksum(obj.key, obj.etag)


def read_checksums(bucket: Bucket, table: ForeignTable) -> dict[str, ObjectChecksum]:
    """:func:`object_checksum` of every object of ``table``, by path (HEADs on a few threads).

    Call it once the table is derived: an object without a checksum
    (``not checksum.verifiable``: ``file://``, SSE-KMS) is then known before any chunk moves, so
    the daemon can read it from the bucket only (docs/TRUST.md, "When the bucket vouches for
    nothing"). Raises ``ObjectChanged`` / ``BucketError``.
    """
    paths = [o.path for o in table.objects]
    with ThreadPoolExecutor(max_workers=max(1, min(HEADER_READERS, len(paths)))) as pool:
        return dict(zip(paths, pool.map(lambda p: object_checksum(bucket, table, p), paths)))
