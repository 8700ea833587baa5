"""The ``READY`` marker of a snapshot directory (format ``bdn.ready/1``): pure parsing and building.

Source: FORMATS.md ("READY, `bdn.ready/1`") and README.md ("How a chunk moves").
The daemon writes ``<shm_dir>/<swarm_id>/<identity>/READY`` last, inside a directory that appears
by atomic rename, as JSON::

    {"format": "bdn.ready/1", "identity": "step000002", "kind": "full" | "delta",
     "policy_version": 2, "base_identity": "step000001" | null, "chunk_size": 16777216,
     "files": [{"path": "model.safetensors", "size": 1234, "chunks": ["<xxh3-128 hex>", ...]}]}

``files`` describes the *reconstructed* files (what is on disk), chunked by ``chunk_size``. The
marker is read from a directory the caller names, so it is parsed as untrusted input.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bdn.proto.chunks import DIGEST_RE, MAX_CHUNK_SIZE, MIN_CHUNK_SIZE, Digests, num_chunks
from bdn.proto.errors import BdnError, ProtocolError
from bdn.proto.identity import validate_identity, validate_relpath
from bdn.proto.reserved import READY_NAME, RESERVED_NAMES, reserved_path

__all__ = [
    "KINDS",
    "MAX_FILE_BYTES",
    "MAX_READY_BYTES",
    "READY_FORMAT",
    "READY_NAME",
    "RESERVED_NAMES",
    "ReadyFile",
    "ReadyMarker",
    "parse_ready",
    "ready_json",
    "reserved_path",
]

if TYPE_CHECKING:
    from bdn.proto.manifest import Manifest

READY_FORMAT = "bdn.ready/1"
KINDS = ("full", "delta")
MAX_READY_BYTES = 64 << 20
MAX_FILE_BYTES = 1 << 50


@dataclass(frozen=True)
class ReadyFile:
    """One reconstructed file: relative ``path``, ``size`` in bytes, xxh3-128 hex per chunk."""

    path: str
    size: int
    chunks: Sequence[str]  # Digests when parsed (16 bytes per digest, bdn.proto.chunks)


@dataclass(frozen=True)
class ReadyMarker:
    """The parsed ``READY`` marker of a snapshot directory."""

    identity: str
    kind: str
    policy_version: int
    base_identity: str | None
    chunk_size: int
    files: tuple[ReadyFile, ...]

    @property
    def total_bytes(self) -> int:
        """Bytes of every file the marker lists."""
        return sum(f.size for f in self.files)


def _int(obj: dict[str, Any], key: str, where: str, lo: int, hi: int) -> int:
    value = obj.get(key)
    # bool is an int subclass; JSON true must not pass for 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ProtocolError(f"{where}: {key!r} must be an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise ProtocolError(f"{where}: {key!r} = {value} is outside [{lo}, {hi}]")
    return value


def parse_ready(data: bytes, where: str = READY_NAME) -> ReadyMarker:
    """Parse and validate the bytes of a ``READY`` marker.

    Args:
        data: the file's bytes (UTF-8 JSON).
        where: how to name the marker in error messages (e.g. its path).

    Raises:
        ProtocolError: one line naming what is wrong (bad JSON, wrong format, a bad field, a file
            path that breaks the path rule, a chunk list that does not match the size).
    """
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if obj.get("format") != READY_FORMAT:
        raise ProtocolError(f"{where}: format is {str(obj.get('format'))[:60]!r}, expected {READY_FORMAT!r}")
    try:
        identity = validate_identity(obj.get("identity"))
        base = obj.get("base_identity")
        if base is not None:
            base = validate_identity(base)
    except BdnError as exc:
        raise ProtocolError(f"{where}: {exc}") from None
    kind = obj.get("kind")
    if kind not in KINDS:
        raise ProtocolError(f"{where}: kind is {str(kind)[:60]!r}, expected one of {', '.join(KINDS)}")
    policy_version = _int(obj, "policy_version", where, 0, (1 << 63) - 1)
    chunk_size = _int(obj, "chunk_size", where, MIN_CHUNK_SIZE, MAX_CHUNK_SIZE)
    raw_files = obj.get("files")
    if not isinstance(raw_files, list):
        raise ProtocolError(f"{where}: 'files' must be a list")
    files: list[ReadyFile] = []
    seen: set[str] = set()
    for i, entry in enumerate(raw_files):
        fwhere = f"{where}: files[{i}]"
        if not isinstance(entry, dict):
            raise ProtocolError(f"{fwhere} must be an object")
        try:
            path = validate_relpath(entry.get("path"))
        except BdnError as exc:
            raise ProtocolError(f"{fwhere}: {exc}") from None
        if reserved_path(path):
            raise ProtocolError(f"{fwhere}: {reserved_path(path)}")
        if path in seen:
            raise ProtocolError(f"{fwhere}: duplicate path {path!r}")
        seen.add(path)
        size = _int(entry, "size", f"{fwhere} ({path})", 0, MAX_FILE_BYTES)
        chunks = entry.get("chunks")
        if not isinstance(chunks, list) or not all(isinstance(c, str) and DIGEST_RE.match(c) for c in chunks):
            raise ProtocolError(f"{fwhere} ({path}): 'chunks' must be a list of 32-char lowercase hex xxh3-128 digests")
        if len(chunks) != num_chunks(size, chunk_size):
            raise ProtocolError(
                f"{fwhere} ({path}): {len(chunks)} chunk digests for {size} bytes at chunk_size "
                f"{chunk_size} (expected {num_chunks(size, chunk_size)})"
            )
        files.append(ReadyFile(path, size, Digests.of(chunks)))
    return ReadyMarker(identity, kind, policy_version, base, chunk_size, tuple(files))


def ready_json(m: Manifest) -> bytes:
    """The READY marker for a snapshot rebuilt from manifest ``m`` (UTF-8 JSON bytes)."""
    obj = {
        "format": READY_FORMAT,
        "identity": m.identity,
        "kind": m.kind,
        "policy_version": m.policy_version,
        "base_identity": m.base_identity,
        "chunk_size": m.chunk_size,
        "files": [{"path": f.path, "size": f.result_size, "chunks": list(f.result_chunks)} for f in m.files],
    }
    return json.dumps(obj, indent=1).encode()
