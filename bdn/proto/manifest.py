"""``bdn.manifest.json``: the table of a snapshot's files and chunks (format ``bdn.snapshot/1``).

Source: DESIGN.md ("Bucket layout"). JSON object::

    {"format": "bdn.snapshot/1", "identity": "step000002", "kind": "full" | "delta",
     "policy_version": 2, "created_at": "2026-11-29T10:00:00Z", "chunk_size": 16777216,
     "base_identity": "step000001",            # delta only
     "compression_format": "arc_v2",           # delta only
     "checksum_format": "alder32",             # delta only
     "files": [{"path": "model.safetensors", "size": 1234, "chunks": ["<xxh3-128 hex>", ...],
                "result": {"size": 5678, "chunks": [...]}}]}   # result: delta diff files only

``size``/``chunks`` describe the stored object in the bucket; ``result`` the reconstructed file
(absent for full files and for plain copies inside a delta, where stored = result). The manifest
is written last by the publisher: its presence means the snapshot is complete. It comes from a
bucket, so ``Manifest.from_json`` treats it as untrusted and validates everything.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from bdn.proto.chunks import DIGEST_RE, MAX_CHUNK_SIZE, MIN_CHUNK_SIZE, Digests, num_chunks
from bdn.proto.errors import ManifestError, ProtocolError
from bdn.proto.identity import validate_identity, validate_relpath
from bdn.proto.reserved import reserved_path

MANIFEST_NAME = "bdn.manifest.json"
STARTUP_NAME = "STARTUP_SNAPSHOT"
FORMAT = "bdn.snapshot/1"
MAX_MANIFEST_BYTES = 64 << 20
MAX_FILES = 100_000
MAX_TOTAL_CHUNKS = 10_000_000
MAX_OBJECT_BYTES = 1 << 50


@dataclass(frozen=True)
class FileResult:
    """The reconstructed file of a delta diff: its size in bytes and chunk digests."""

    size: int
    chunks: Sequence[str]  # a tuple, or Digests (16 bytes per digest) when parsed


@dataclass(frozen=True)
class FileEntry:
    """One file of a snapshot: the stored object (``size``, ``chunks``) and, for a diff, ``result``."""

    path: str
    size: int
    chunks: Sequence[str]  # a tuple, or Digests (16 bytes per digest) when parsed
    result: FileResult | None = None

    @property
    def result_size(self) -> int:
        """Bytes of the file the snapshot rebuilds (a diff's target size; a stored file's own size)."""
        return self.result.size if self.result else self.size

    @property
    def result_chunks(self) -> Sequence[str]:
        """Digests of the rebuilt file's chunks (a stored file's own chunks when it is not a diff)."""
        return self.result.chunks if self.result else self.chunks

    @property
    def is_diff(self) -> bool:
        """True when the stored object is a diff file that rebuilds another (it has a ``result``)."""
        return self.result is not None


@dataclass(frozen=True)
class ChunkRef:
    """Chunk ``index`` of file ``file_index`` (``path``): bytes ``[offset, offset+length)``."""

    file_index: int
    path: str
    index: int
    offset: int
    length: int
    digest: str


@dataclass(frozen=True)
class Manifest:
    """A parsed, validated ``bdn.snapshot/1`` manifest."""

    identity: str
    kind: str
    policy_version: int
    chunk_size: int
    files: tuple[FileEntry, ...]
    created_at: str = ""
    base_identity: str | None = None
    compression_format: str | None = None
    checksum_format: str | None = None
    _by_path: dict[str, int] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._by_path.update({f.path: i for i, f in enumerate(self.files)})

    # ---- queries -------------------------------------------------------------------------
    @property
    def is_delta(self) -> bool:
        """True for a delta snapshot (``kind == "delta"``, with a ``base_identity``)."""
        return self.kind == "delta"

    def file(self, path: str) -> FileEntry:
        """The entry for ``path``; KeyError if the snapshot has no such file."""
        return self.files[self._by_path[path]]

    def stored_chunks(self) -> Iterator[ChunkRef]:
        """Every chunk of every stored object, in manifest order (the order of have-bitfields)."""
        for fi, f in enumerate(self.files):
            for ci, d in enumerate(f.chunks):
                off = ci * self.chunk_size
                yield ChunkRef(fi, f.path, ci, off, min(self.chunk_size, f.size - off), d)

    def result_chunks(self) -> Iterator[ChunkRef]:
        """Every chunk of every reconstructed file (equal to ``stored_chunks`` for a full snapshot)."""
        for fi, f in enumerate(self.files):
            size = f.result_size
            for ci, d in enumerate(f.result_chunks):
                off = ci * self.chunk_size
                yield ChunkRef(fi, f.path, ci, off, min(self.chunk_size, size - off), d)

    @property
    def stored_bytes(self) -> int:
        """Bytes of every stored object: what the swarm moves for this snapshot."""
        return sum(f.size for f in self.files)

    @property
    def result_bytes(self) -> int:
        """Bytes of every rebuilt file: what the snapshot occupies once ready."""
        return sum(f.result_size for f in self.files)

    # ---- serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The manifest as the JSON object of ``bdn.manifest.json`` (format ``FORMAT``, DESIGN.md's manifest section)."""
        d: dict[str, Any] = {
            "format": FORMAT,
            "identity": self.identity,
            "kind": self.kind,
            "policy_version": self.policy_version,
            "created_at": self.created_at,
            "chunk_size": self.chunk_size,
        }
        if self.is_delta:
            d["base_identity"] = self.base_identity
            d["compression_format"] = self.compression_format
            d["checksum_format"] = self.checksum_format
        files = []
        for f in self.files:
            fd: dict[str, Any] = {"path": f.path, "size": f.size, "chunks": list(f.chunks)}
            if f.result is not None:
                fd["result"] = {"size": f.result.size, "chunks": list(f.result.chunks)}
            files.append(fd)
        d["files"] = files
        return d

    def to_json(self) -> bytes:
        """Canonical UTF-8 JSON (sorted keys, 1-space indent, trailing newline)."""
        return (json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes | str, *, expect_identity: str | None = None) -> Manifest:
        """Parse and validate a manifest read from a bucket.

        Raises:
            ManifestError: one line naming the first rule broken (bad JSON, wrong format,
                bad identity, a path with ``..``, chunk count not matching the size, ...).
        """
        if len(data) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"manifest is {len(data)} bytes, over the {MAX_MANIFEST_BYTES} limit")
        obj = decode_manifest_json(data)
        try:
            m = cls.from_dict(obj)
        except ManifestError:
            raise
        except ProtocolError as e:
            raise ManifestError(f"manifest: {e}") from None
        if expect_identity is not None and m.identity != expect_identity:
            raise ManifestError(f"manifest names identity {m.identity!r} but lives under {expect_identity!r}")
        return m

    @classmethod
    def from_dict(cls, obj: Any) -> Manifest:
        """Validate a decoded JSON object (see ``from_json``; no size limit, no ``expect_identity`` here).

        Raises ManifestError for a broken rule, or the ProtocolError of a bad identity or path
        (IdentityError, PathError), which ``from_json`` rewraps as ManifestError.
        """
        if not isinstance(obj, dict):
            raise ManifestError("manifest must be a JSON object")
        if obj.get("format") != FORMAT:
            raise ManifestError(f"manifest format must be {FORMAT!r}, got {obj.get('format')!r}")
        identity = validate_identity(obj.get("identity"))
        kind = obj.get("kind")
        if kind not in ("full", "delta"):
            raise ManifestError(f"manifest kind must be 'full' or 'delta', got {kind!r}")
        pv = _int(obj, "policy_version", 0, 2**63 - 1)
        chunk_size = _int(obj, "chunk_size", MIN_CHUNK_SIZE, MAX_CHUNK_SIZE)
        created_at = obj.get("created_at", "")
        if not isinstance(created_at, str) or len(created_at) > 64:
            raise ManifestError("manifest created_at must be a string of at most 64 chars")
        base = comp = cksum = None
        if kind == "delta":
            try:
                base = validate_identity(obj.get("base_identity"))
            except ProtocolError as e:
                raise ManifestError(f"delta manifest base_identity: {e}") from None
            if base == identity:
                raise ManifestError(f"delta {identity!r} names itself as its base")
            comp = obj.get("compression_format")
            cksum = obj.get("checksum_format")
            # check_formats also serves hot-load requests, where an absent checksum_format is
            # fine; bdn's own manifest always names both.
            for k, v in (("compression_format", comp), ("checksum_format", cksum)):
                if not isinstance(v, str):
                    raise ManifestError(f"delta manifest {k} must be a string, got {v!r}"[:200])
            from bdn.proto.arc import check_formats  # arc owns the list of supported codecs

            assert isinstance(comp, str) and isinstance(cksum, str)  # checked just above
            check_formats(comp, cksum)
            comp = comp.lower()  # check_formats matches case-insensitively; store one spelling
        else:
            for k in ("base_identity", "compression_format", "checksum_format"):
                if obj.get(k) is not None:
                    raise ManifestError(f"full snapshot manifest must not have {k}")
        raw_files = obj.get("files")
        if not isinstance(raw_files, list) or not raw_files:
            raise ManifestError("manifest files must be a non-empty list")
        if len(raw_files) > MAX_FILES:
            raise ManifestError(f"manifest lists {len(raw_files)} files, over {MAX_FILES}")
        files: list[FileEntry] = []
        seen: set[str] = set()
        tree: dict[str, Any] = {}
        total = 0
        for i, rf in enumerate(raw_files):
            if not isinstance(rf, dict):
                raise ManifestError(f"manifest files[{i}] must be an object")
            path = validate_relpath(rf.get("path"))
            if path in seen:
                raise ManifestError(f"manifest lists {path!r} twice")
            if path == MANIFEST_NAME:
                raise ManifestError(f"manifest must not list itself ({MANIFEST_NAME})")
            if reserved_path(path):
                raise ManifestError(f"manifest path {reserved_path(path)}")
            if not _add_to_tree(tree, path):
                raise ManifestError(f"manifest path {path!r} clashes with another file (a file and a directory)")
            seen.add(path)
            size = _int(rf, "size", 0, MAX_OBJECT_BYTES, where=path)
            chunks = _chunks(rf.get("chunks"), size, chunk_size, path)
            result = None
            if rf.get("result") is not None:
                if kind != "delta":
                    raise ManifestError(f"{path}: only a delta's files may have a result")
                if not path.endswith(".safetensors"):
                    raise ManifestError(f"{path}: only a delta's safetensors files are diffs with a result")
                rr = rf["result"]
                if not isinstance(rr, dict):
                    raise ManifestError(f"{path}: result must be an object")
                rsize = _int(rr, "size", 0, MAX_OBJECT_BYTES, where=f"{path} result")
                result = FileResult(rsize, _chunks(rr.get("chunks"), rsize, chunk_size, f"{path} result"))
                total += len(result.chunks)
            elif kind == "delta" and path.endswith(".safetensors"):
                raise ManifestError(f"{path}: a delta's safetensors file must have a result")
            total += len(chunks)
            if total > MAX_TOTAL_CHUNKS:
                raise ManifestError(f"manifest lists more than {MAX_TOTAL_CHUNKS} chunks")
            files.append(FileEntry(path, size, chunks, result))
        return cls(
            identity=identity,
            kind=kind,
            policy_version=pv,
            chunk_size=chunk_size,
            files=tuple(files),
            created_at=created_at,
            base_identity=base,
            compression_format=comp,
            checksum_format=cksum,
        )


# ---- decoding without holding the GIL for long ---------------------------------------------
# A daemon parses manifests on a worker thread, but a C decoder keeps the GIL for the whole
# call: ``json.loads`` of a 36 MB manifest (10^6 chunks) held the event loop ~0.5 s, and
# no step may hold it for more than about 100 ms. So the structure is decoded by msgspec with every ``chunks`` list left as raw JSON
# bytes (one fast scan, no string objects), then each list is decoded in windows of
# ``DECODE_WINDOW`` bytes, a few milliseconds each, between which the loop runs. Own code
# because no JSON library decodes incrementally into a list; the windowing is exact (below).
DECODE_WINDOW = 1 << 20


class _RawResult(msgspec.Struct):
    size: Any = None
    chunks: msgspec.Raw = msgspec.Raw()


class _RawFile(msgspec.Struct):
    path: Any = None
    size: Any = None
    chunks: msgspec.Raw = msgspec.Raw()
    result: _RawResult | None | msgspec.UnsetType = msgspec.UNSET


class _RawManifest(msgspec.Struct):
    files: list[_RawFile]
    format: Any = msgspec.UNSET
    identity: Any = msgspec.UNSET
    kind: Any = msgspec.UNSET
    policy_version: Any = msgspec.UNSET
    chunk_size: Any = msgspec.UNSET
    created_at: Any = msgspec.UNSET
    base_identity: Any = msgspec.UNSET
    compression_format: Any = msgspec.UNSET
    checksum_format: Any = msgspec.UNSET


def _present(struct: msgspec.Struct) -> dict[str, Any]:
    return {k: v for k in struct.__struct_fields__ if (v := getattr(struct, k)) is not msgspec.UNSET}


def decode_manifest_json(data: bytes | str) -> Any:
    """The manifest's JSON as plain Python objects (dicts, lists, str, int) for
    ``Manifest.from_dict``, decoded in short steps (see above); a document of another shape
    (``files`` not a list of objects, ...) is decoded plainly and ``from_dict`` names what is
    wrong. Raises ManifestError("manifest is not valid JSON: ...")."""
    try:
        try:
            m = msgspec.json.decode(data, type=_RawManifest)
        except msgspec.ValidationError:
            return msgspec.json.decode(data)
        obj = _present(m)
        files = []
        for f in m.files:
            d = _present(f)
            d["chunks"] = _decode_list(f.chunks) if f.chunks else None
            if isinstance(f.result, _RawResult):
                r = _present(f.result)
                r["chunks"] = _decode_list(f.result.chunks) if f.result.chunks else None
                d["result"] = r
            files.append(d)
        obj["files"] = files
        return obj
    except (msgspec.DecodeError, UnicodeDecodeError) as e:
        if "surrogate" in str(e):  # "\ud800": valid JSON to some, but no UTF-8 path or key holds it
            raise ManifestError(
                "manifest is not valid JSON: a string (a file path?) holds a lone UTF-16 "
                f"surrogate, which is not valid UTF-8 ({e})"
            ) from None
        raise ManifestError(f"manifest is not valid JSON: {e}") from None
    except RecursionError:
        raise ManifestError("manifest is not valid JSON: nested too deeply") from None


def _decode_list(raw: bytes) -> Any:
    """A JSON value, decoded window by window when it is a large array.

    The array is cut at the first comma past each ``DECODE_WINDOW`` bytes and each piece is
    decoded as ``[piece]``. A cut inside a string leaves that piece with an unterminated string,
    and one inside a nested value leaves it unbalanced, so either fails to decode: when every
    piece decodes, their elements are exactly the whole array's (an empty piece is a stray
    comma, refused). The converse does not hold: a long list of strings holding commas (never
    chunk digests, which are hex) is refused as invalid JSON.
    """
    body = bytes(raw).strip()
    if len(body) <= DECODE_WINDOW or not (body.startswith(b"[") and body.endswith(b"]")):
        return msgspec.json.decode(body)
    out: list[Any] = []
    start, stop = 1, len(body) - 1
    while True:
        cut = body.find(b",", min(start + DECODE_WINDOW, stop), stop)
        piece = msgspec.json.decode(b"[" + body[start : cut if cut >= 0 else stop] + b"]")
        if not piece:
            raise msgspec.DecodeError("an empty element in an array (a stray comma)")
        out.extend(piece)
        if cut < 0:
            return out
        start = cut + 1


_FILE = object()  # leaf marker in the path tree


def _add_to_tree(tree: dict[str, Any], path: str) -> bool:
    """Add ``path`` to a tree of path segments; False if it clashes (``a`` beside ``a/b``).

    A tree rather than a set of prefixes keeps this linear in the path length: a 1 KiB path of
    500 segments has 500 prefixes of up to 1 KiB each.
    """
    parts = path.split("/")
    node = tree
    for seg in parts[:-1]:
        node = node.setdefault(seg, {})
        if node is _FILE:
            return False
    if parts[-1] in node:
        return False
    node[parts[-1]] = _FILE
    return True


def _int(obj: dict[str, Any], key: str, lo: int, hi: float, where: str = "manifest") -> int:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ManifestError(f"{where}: {key} must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def _chunks(raw: Any, size: int, chunk_size: int, where: str) -> Digests:
    if not isinstance(raw, list):
        raise ManifestError(f"{where}: chunks must be a list")
    want = num_chunks(size, chunk_size)
    if len(raw) != want:
        raise ManifestError(
            f"{where}: {len(raw)} chunks listed, {want} expected for {size} bytes at chunk_size {chunk_size}"
        )
    for d in raw:
        if not isinstance(d, str) or not DIGEST_RE.match(d):
            raise ManifestError(f"{where}: chunk digest {str(d)[:40]!r} is not 32 lowercase hex")
    return Digests.of(raw)  # 16 bytes per chunk, not a string object


def parse_startup(data: bytes) -> str:
    """The identity named by a ``STARTUP_SNAPSHOT`` object (text, identity plus newline).

    Raises:
        ProtocolError / IdentityError: not UTF-8, empty, or not a valid identity.
    """
    if len(data) > 1024:
        raise ProtocolError(f"{STARTUP_NAME} is {len(data)} bytes; expected one identity")
    try:
        text = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ProtocolError(f"{STARTUP_NAME} is not UTF-8 text") from None
    return validate_identity(text)
