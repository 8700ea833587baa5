"""Snapshots without ``bdn.manifest.json`` ("foreign" snapshots): listing + headers -> table.

Source: docs/TRUST.md. A trainer that publishes with the hosted services' tools (the
Fireworks library ``fireworks-delta-compression`` plus its own upload code, or the hosted RL
service's reference publisher) writes under ``<root>/<identity>/`` either

* a **full** snapshot: a Hugging Face directory (``*.safetensors`` shards, ``config.json``,
  tokenizer files, an optional ``model.safetensors.index.json``), or
* a **delta**: for each ``*.safetensors`` shard of the target a diff file of the same name (a
  safetensors file of 1-D ``U8`` streams of ``base XOR target`` whose ``__metadata__`` maps every
  tensor to the decimal Adler-32 of the target tensor; see :mod:`bdn.proto.arc`), and a copy of
  every other file (``delta_compress_dirs``).

This module holds the pure rules (no I/O; :mod:`bdn.foreign.reader` feeds it through the bucket
interface). :func:`derive_table` turns the objects listed under the prefix and the first bytes of
each safetensors object into a :class:`ForeignTable`: a :class:`~bdn.proto.manifest.Manifest` that
the daemon loads like a bdn one, plus the version token (ETag / generation / file token) of every
object. The table is a function of the listing, the headers, the configured chunk size and the
arguments only (sorted paths, no clock), so every daemon that sees the same objects derives the
same table, byte for byte, and the same :attr:`ForeignTable.table_id`.

Chunk ids. No trusted content digest exists for a foreign object, so a chunk's 32-hex "digest" is
an **id**: the XXH3-128 of ``bdn.foreign/1``, the object's key, version token, size, the chunk size
and the chunk index (and, for a rebuilt diff file, the base file's chunk ids). Equal ids mean the
same bytes of the same object version, so peers can still address and share chunks by id, but a
receiver cannot check bytes against an id: ``ForeignTable.content_digests`` is False and the bytes
are verified per object instead (:mod:`bdn.foreign.checksum`, docs/TRUST.md).
"""

from __future__ import annotations

import functools
import json
import re
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import xxhash

from bdn.proto.arc import COMPRESSION_FORMATS, diff_tensors
from bdn.proto.chunks import MAX_CHUNK_SIZE, MIN_CHUNK_SIZE, num_chunks
from bdn.proto.errors import ProtocolError, UnsupportedFormat
from bdn.proto.identity import validate_identity, validate_relpath
from bdn.proto.manifest import (
    MANIFEST_NAME,
    MAX_FILES,
    MAX_TOTAL_CHUNKS,
    Manifest,
)
from bdn.proto.safetensors_fmt import Header, SafetensorsError, _q, parse_header

FOREIGN_FORMAT = "bdn.foreign/1"
#: The safetensors library refuses headers of 100,000,000 bytes and more (``MAX_HEADER_SIZE``);
#: a foreign file must load in the engine, so the same limit holds here.
MAX_HEADER_BYTES = 100_000_000
#: The first read of each safetensors object: the whole header of every real checkpoint shard
#: (a few KB to ~1 MB) plus the first bytes of the first stream, in one ranged GET.
HEADER_PROBE_BYTES = 256 << 10
#: Bytes of a diff file's first stream that tell its codec apart.
SNIFF_BYTES = 4
#: Largest ``*.safetensors.index.json`` read to check that every shard it names is listed.
MAX_INDEX_BYTES = 16 << 20
INDEX_SUFFIX = ".safetensors.index.json"
CHECKSUM_FORMAT = "alder32"

_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_PLANES_MAGIC = b"BDNP"
_TRAILING_INT = re.compile(r"([0-9]+)\Z")


class ForeignSnapshotError(ProtocolError):
    """A foreign snapshot's objects cannot make a table (message: one line naming the object)."""


class IncompleteSnapshot(ForeignSnapshotError):
    """The listing is not (yet) a whole snapshot: nothing under the prefix, or a shard that the
    index names is missing. The daemon may wait and list again; every other error is final."""


class ListedLike(Protocol):
    """What a bucket listing gives per object (:class:`bdn.bucket.ObjectInfo` has it)."""

    @property
    def key(self) -> str:
        """The object's key, relative to the bucket root."""

    @property
    def size(self) -> int:
        """The object's size, bytes."""

    @property
    def etag(self) -> str:
        """The object's version token."""


@dataclass(frozen=True)
class ForeignObject:
    """One object of a foreign snapshot: ``path`` inside the snapshot, the bucket ``key``
    (``"<identity>/<path>"``), ``size`` in bytes and the version token ``etag`` that every read
    of it must match (``If-Match``)."""

    path: str
    key: str
    size: int
    etag: str


@dataclass(frozen=True)
class ForeignTable:
    """The table of a foreign snapshot.

    ``manifest``: a validated ``bdn.snapshot/1`` manifest (``kind`` full or delta; for a delta
    ``base_identity``, ``compression_format``, ``checksum_format`` "alder32" and, per diff file,
    ``result`` with the rebuilt size) whose chunk "digests" are ids, not content digests.
    ``objects``: one per manifest file, same order. ``table_id``: 32 hex, the XXH3-128 of the
    canonical table (equal on every daemon that derived the same table). ``content_digests`` is
    always False: received chunks cannot be checked against the ids (docs/TRUST.md).
    """

    manifest: Manifest
    objects: tuple[ForeignObject, ...]
    table_id: str
    content_digests: bool = False

    def object(self, path: str) -> ForeignObject:
        """The object of file ``path``; KeyError if the snapshot has none."""
        return self.objects[self.manifest._by_path[path]]

    def to_json(self) -> bytes:
        """Canonical JSON of the whole table (what ``table_id`` hashes)."""
        return _canonical(self.manifest, self.objects)


def listed_objects(identity: str, listing: Iterable[ListedLike]) -> list[ForeignObject]:
    """The objects of snapshot ``identity`` from a bucket listing of ``"<identity>/"``, sorted.

    Keys outside the prefix are ignored; every path must pass the snapshot path rule. Raises
    :class:`ForeignSnapshotError` when the prefix holds ``bdn.manifest.json`` (read that instead),
    :class:`IncompleteSnapshot` when it holds nothing, and for a bad path or size.
    """
    identity = validate_identity(identity)
    prefix = identity + "/"
    out: list[ForeignObject] = []
    for info in listing:
        if not info.key.startswith(prefix):
            continue
        path = info.key[len(prefix) :]
        try:
            validate_relpath(path)
        except ProtocolError as e:
            raise ForeignSnapshotError(f"{identity}: unusable object name: {e}") from None
        if path == MANIFEST_NAME:
            raise ForeignSnapshotError(f"{identity} has a {MANIFEST_NAME}: it is a bdn snapshot, read its manifest")
        if isinstance(info.size, bool) or not isinstance(info.size, int) or info.size < 0:
            raise ForeignSnapshotError(f"{info.key}: bad object size {info.size!r}")
        if not isinstance(info.etag, str) or not info.etag or len(info.etag) > 256:
            raise ForeignSnapshotError(f"{info.key}: the bucket gave no usable version token")
        out.append(ForeignObject(path, info.key, info.size, info.etag))
    if not out:
        raise IncompleteSnapshot(f"nothing is published under {prefix}")
    out.sort(key=lambda o: o.path)
    for a, b in zip(out, out[1:]):
        if a.path == b.path:
            raise ForeignSnapshotError(f"{identity}: the listing names {a.path!r} twice")
    return out


def header_span(first: bytes | bytearray | memoryview, size: int) -> int:
    """How many leading bytes of a ``size``-byte safetensors object :func:`derive_table` needs:
    ``8 + N`` plus :data:`SNIFF_BYTES` of the first stream (capped at ``size``).

    ``first``: at least the object's first 8 bytes. Raises :class:`ForeignSnapshotError` when the
    object is shorter than 8 bytes or N is over :data:`MAX_HEADER_BYTES` or past the end.
    """
    if size < 8 or len(first) < 8:
        raise ForeignSnapshotError(f"safetensors object of {size} bytes is shorter than its 8-byte length prefix")
    (n,) = struct.unpack_from("<Q", first, 0)
    if n > MAX_HEADER_BYTES:
        raise ForeignSnapshotError(
            f"safetensors header length {n} is over the {MAX_HEADER_BYTES}-byte limit of the safetensors library"
        )
    if 8 + n > size:
        raise ForeignSnapshotError(f"safetensors header length {n} runs past the end of the {size}-byte object")
    return min(size, 8 + n + SNIFF_BYTES)


def sniff_compression(stream_head: bytes | bytearray | memoryview) -> str | None:
    """The delta format whose stream starts with ``stream_head`` (>= 4 bytes), or None.

    zstd frame magic ``28 b5 2f fd`` (RFC 8878): ``arc_v2``; a zlib header (RFC 1950: CM 8, CINFO
    <= 7, ``(CMF*256 + FLG) % 31 == 0``, no preset dictionary): ``arc_v1``; ``BDNP``:
    ``bdn_planes_v1``.
    """
    head = bytes(stream_head[:SNIFF_BYTES])
    if head.startswith(_ZSTD_MAGIC):
        return "arc_v2"
    if head.startswith(_PLANES_MAGIC):
        return "bdn_planes_v1"
    if len(head) >= 2:
        cmf, flg = head[0], head[1]
        if cmf & 0x0F == 8 and cmf >> 4 <= 7 and (cmf * 256 + flg) % 31 == 0 and not flg & 0x20:
            return "arc_v1"
    return None


def policy_version_from_identity(identity: str) -> int | None:
    """The integer an identity ends with (``"step000002"`` -> 2), or None: a default policy version
    for snapshots whose publisher wrote none (the hot-load request's value wins)."""
    m = _TRAILING_INT.search(identity)
    return int(m.group(1)) if m and len(m.group(1)) <= 18 else None


def chunk_id(key: str, etag: str, size: int, chunk_size: int, index: int) -> str:
    """The id of chunk ``index`` of version ``etag`` of object ``key`` (32 lowercase hex)."""
    return xxhash.xxh3_128_hexdigest(
        f"{FOREIGN_FORMAT}\0stored\0{key}\0{etag}\0{size}\0{chunk_size}\0{index}".encode("utf-8", "surrogatepass")
    )


def ids_digest(ids: Sequence[str]) -> str:
    """One digest of a file's chunk ids (what a rebuilt file's ids fold in of its base file)."""
    h = xxhash.xxh3_128()
    for i in ids:
        h.update(i.encode())
        h.update(b"\0")
    return h.hexdigest()


def result_chunk_id(
    key: str, etag: str, base_identity: str, base_digest: str, size: int, chunk_size: int, index: int
) -> str:
    """The id of chunk ``index`` of the file rebuilt from diff ``key``@``etag`` on the base file
    whose result chunk ids have :func:`ids_digest` ``base_digest`` (another base, other ids)."""
    return xxhash.xxh3_128_hexdigest(
        f"{FOREIGN_FORMAT}\0result\0{key}\0{etag}\0{base_identity}\0{base_digest}\0{size}\0{chunk_size}\0{index}".encode(
            "utf-8", "surrogatepass"
        )
    )


def _ids(n: int, make: Callable[[int], str]) -> list[str]:
    return [make(i) for i in range(n)]


def check_index(identity: str, index_path: str, data: bytes, paths: set[str]) -> None:
    """Check a ``*.safetensors.index.json``: every shard its ``weight_map`` names is listed.

    Raises :class:`IncompleteSnapshot` naming the first missing shard, :class:`ForeignSnapshotError`
    when the index does not parse.
    """
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise ForeignSnapshotError(f"{identity}/{index_path} is not valid JSON") from None
    weight_map = obj.get("weight_map") if isinstance(obj, dict) else None
    if not isinstance(weight_map, dict):
        raise ForeignSnapshotError(f"{identity}/{index_path} has no weight_map object")
    folder = index_path.rpartition("/")[0]
    for shard in sorted({v for v in weight_map.values() if isinstance(v, str)}):
        path = f"{folder}/{shard}" if folder else shard
        try:
            validate_relpath(path)
        except ProtocolError as e:
            raise ForeignSnapshotError(f"{identity}/{index_path} names an unusable shard: {e}") from None
        if path not in paths:
            raise IncompleteSnapshot(
                f"{identity}/{index_path} names the shard {shard!r}, which is not (yet) in the bucket"
            )
    if any(not isinstance(v, str) for v in weight_map.values()):
        raise ForeignSnapshotError(f"{identity}/{index_path}: weight_map values must be file names")


def _classify(obj: ForeignObject, head: bytes | None) -> tuple[Header, bool, str | None]:
    """Parse a safetensors object's header: (header, is a diff file, sniffed codec or None)."""
    if head is None:
        raise ForeignSnapshotError(f"{obj.key}: its header was not read")
    try:
        header_span(head, obj.size)
        header = parse_header(head, obj.size)
    except (SafetensorsError, ForeignSnapshotError) as e:
        raise ForeignSnapshotError(f"{obj.key}: {e}") from None
    if not header.tensors:
        return header, False, None
    try:
        streams = diff_tensors(header)
    except ProtocolError:
        return header, False, None
    first = min(streams.values(), key=lambda s: s.frame_start)
    probe = head[first.frame_start : first.frame_start + SNIFF_BYTES]
    if first.frame_end - first.frame_start < SNIFF_BYTES or len(probe) < SNIFF_BYTES:
        raise ForeignSnapshotError(f"{obj.key}: the diff stream of tensor {_q(first.name)} is too short to be one")
    codec = sniff_compression(probe)
    if codec is None:
        raise UnsupportedFormat(
            f"{obj.key}: the diff stream of tensor {_q(first.name)} starts with {bytes(probe).hex()}, which is"
            f" none of {', '.join(COMPRESSION_FORMATS)} (zstd frame, zlib stream, BDNP)"
        )
    return header, True, codec


def derive_table(
    identity: str,
    objects: Sequence[ForeignObject],
    heads: Mapping[str, bytes],
    *,
    chunk_size: int,
    policy_version: int,
    base_identity: str | None = None,
    base: Manifest | None = None,
    base_headers: Mapping[str, Header] | None = None,
    compression_format: str | None = None,
    indexes: Mapping[str, bytes] | None = None,
    max_files: int = MAX_FILES,
    max_chunks: int = MAX_TOTAL_CHUNKS,
) -> ForeignTable:
    """Derive the table of foreign snapshot ``identity``.

    ``objects``: :func:`listed_objects` of the prefix. ``heads``: for every ``*.safetensors`` path,
    the object's first :func:`header_span` bytes (or more), read at its version token.
    ``chunk_size`` (bytes): from the daemon's config, the same on every daemon. ``policy_version``:
    from the hot-load request, else :func:`policy_version_from_identity`. ``indexes``: the bytes of
    each ``*.safetensors.index.json`` (see :func:`check_index`).

    The snapshot is a **delta** when its safetensors files are diff files (1-D ``U8`` tensors,
    ``__metadata__`` the Adler-32 of every tensor), a **full** one when none is; both kinds mixed
    is an error. A delta needs ``base_identity`` (the hot-load request's
    ``previous_snapshot_identity``, or the config) and ``base``, that snapshot's table: each diff
    file's rebuilt size is the base file's size (the target keeps the base's header), and with
    ``base_headers`` (the base files' parsed headers) the tensor names are checked now rather
    than at apply time. ``compression_format``, when given (the request's), must agree with the
    codec sniffed from the diff streams; all diff files must use one codec.

    Every safetensors header is validated (:func:`bdn.proto.safetensors_fmt.parse_header`: the
    format's rules, coverage of the whole object, N <= 100,000,000). Raises
    :class:`ForeignSnapshotError` / :class:`IncompleteSnapshot` / ``UnsupportedFormat`` (one line
    naming the object), ``ManifestError`` for limits (files, chunks).
    """
    identity = validate_identity(identity)
    if not MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE:
        raise ForeignSnapshotError(f"chunk_size {chunk_size} is outside [{MIN_CHUNK_SIZE}, {MAX_CHUNK_SIZE}]")
    if not objects:
        raise IncompleteSnapshot(f"nothing is published under {identity}/")
    if len(objects) > max_files:
        raise ForeignSnapshotError(f"{identity} has {len(objects)} files, over the limit of {max_files}")
    objects = sorted(objects, key=lambda o: o.path)  # the table never depends on listing order
    paths = {o.path for o in objects}
    if len(paths) != len(objects):
        raise ForeignSnapshotError(f"{identity}: the listing names a path twice")
    for path, data in sorted((indexes or {}).items()):
        check_index(identity, path, data, paths)

    kinds: dict[str, tuple[Header, bool, str | None]] = {}
    for o in objects:
        if o.path.endswith(".safetensors"):
            kinds[o.path] = _classify(o, heads.get(o.path))
    diffs = [p for p, (_, is_diff, _) in kinds.items() if is_diff]
    plain = [p for p, (h, is_diff, _) in kinds.items() if not is_diff and h.tensors]
    if diffs and plain:
        raise ForeignSnapshotError(
            f"{identity} mixes diff files ({diffs[0]!r}) and full safetensors files ({plain[0]!r})"
        )
    is_delta = bool(diffs)

    codec: str | None = None
    if is_delta:
        codecs = sorted({c for p in diffs if (c := kinds[p][2]) is not None})
        if len(codecs) > 1:
            raise ForeignSnapshotError(f"{identity}: diff files use more than one codec ({', '.join(codecs)})")
        codec = codecs[0]
        if compression_format is not None and compression_format.lower() != codec:
            raise UnsupportedFormat(
                f"{identity}: the request names compression_format {_q(compression_format)}, but the diff files are {codec}"
            )
        if base_identity is None:
            raise ForeignSnapshotError(
                f"{identity} is a delta (diff files with Adler-32 metadata) and no base was given:"
                " name it as previous_snapshot_identity in the hot-load request"
            )
        base_identity = validate_identity(base_identity)
        if base_identity == identity:
            raise ForeignSnapshotError(f"delta {identity!r} names itself as its base")
        if base is None or base.identity != base_identity:
            raise ForeignSnapshotError(f"{identity}: the table of its base {base_identity!r} is needed to derive it")

    files: list[dict[str, Any]] = []
    total = 0
    for o in objects:
        stored = _ids(num_chunks(o.size, chunk_size), functools.partial(chunk_id, o.key, o.etag, o.size, chunk_size))
        entry: dict[str, Any] = {"path": o.path, "size": o.size, "chunks": stored}
        total += len(stored)
        if is_delta and o.path.endswith(".safetensors"):
            assert base is not None and base_identity is not None
            try:
                base_file = base.file(o.path)
            except KeyError:
                raise ForeignSnapshotError(
                    f"{o.key} is a diff file, but the base {base_identity!r} has no {o.path!r}"
                ) from None
            if base_headers is not None and o.path in base_headers:
                _check_names(o, kinds[o.path][0], base_headers[o.path])
            rsize = base_file.result_size
            rids = ids_digest(base_file.result_chunks)
            entry["result"] = {
                "size": rsize,
                "chunks": _ids(
                    num_chunks(rsize, chunk_size),
                    functools.partial(result_chunk_id, o.key, o.etag, base_identity, rids, rsize, chunk_size),
                ),
            }
            total += len(entry["result"]["chunks"])
        if total > max_chunks:
            raise ForeignSnapshotError(f"{identity} has more than {max_chunks} chunks at chunk_size {chunk_size}")
        files.append(entry)

    doc: dict[str, Any] = {
        "format": "bdn.snapshot/1",
        "identity": identity,
        "kind": "delta" if is_delta else "full",
        "policy_version": policy_version,
        "created_at": "",
        "chunk_size": chunk_size,
        "files": files,
    }
    if is_delta:
        doc.update(base_identity=base_identity, compression_format=codec, checksum_format=CHECKSUM_FORMAT)
    manifest = Manifest.from_dict(doc)  # the same validation as a manifest read from a bucket
    objs = tuple(objects)
    return ForeignTable(manifest, objs, xxhash.xxh3_128_hexdigest(_canonical(manifest, objs)))


def _check_names(obj: ForeignObject, diff_header: Header, base_header: Header) -> None:
    for name in base_header.tensors:
        if name not in diff_header.tensors:
            raise ForeignSnapshotError(f"{obj.key} has no stream for tensor {_q(name)} of the base")
    for name in diff_header.tensors:
        if name not in base_header.tensors:
            raise ForeignSnapshotError(f"{obj.key} has a stream for tensor {_q(name)}, which the base lacks")


def _canonical(manifest: Manifest, objects: Sequence[ForeignObject]) -> bytes:
    doc = {
        "format": FOREIGN_FORMAT,
        "manifest": manifest.to_dict(),
        "objects": [{"path": o.path, "key": o.key, "size": o.size, "etag": o.etag} for o in objects],
    }
    return (json.dumps(doc, sort_keys=True, separators=(",", ":")) + "\n").encode()
