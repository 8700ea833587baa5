"""The node's snapshot store in shared memory: layout, READY markers, and the chunk index.

Layout under ``root = <shm_dir>/<swarm_id>``::

    <identity>/            a complete, verified Hugging Face directory plus its READY marker
    .staging/<identity>/   reconstructed files while the snapshot is being built (never handed out)
    .stored/<identity>/    a delta's diff objects as stored in the bucket (kept to serve peers)

A snapshot is published on the node by writing READY into its staging directory and then renaming
the directory to ``<identity>/`` (one atomic rename): a directory under its identity is always
complete. READY is JSON (format ``bdn.ready/1``)::

    {"format": "bdn.ready/1", "identity": ..., "kind": ..., "policy_version": ...,
     "base_identity": ..., "chunk_size": ..., "files": [{"path", "size", "chunks"}]}

with the xxh3-128 digests of each reconstructed file's chunks.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bdn.proto.chunks import DIGEST_RE, MAX_CHUNK_SIZE, MIN_CHUNK_SIZE, num_chunks
from bdn.proto.errors import ProtocolError
from bdn.proto.identity import validate_identity, validate_relpath
from bdn.proto.manifest import Manifest

READY_NAME = "READY"
READY_FORMAT = "bdn.ready/1"
STAGING = ".staging"
STORED = ".stored"


@dataclass(frozen=True)
class ReadyInfo:
    """A parsed READY marker."""

    identity: str
    kind: str
    policy_version: int
    base_identity: str | None
    chunk_size: int
    files: tuple[tuple[str, int, tuple[str, ...]], ...]  # (path, size, chunk digests)

    @property
    def result_bytes(self) -> int:
        return sum(f[1] for f in self.files)


def ready_from_manifest(m: Manifest) -> dict[str, Any]:
    """The READY marker's JSON object for a snapshot rebuilt from manifest ``m``."""
    return {
        "format": READY_FORMAT,
        "identity": m.identity,
        "kind": m.kind,
        "policy_version": m.policy_version,
        "base_identity": m.base_identity,
        "chunk_size": m.chunk_size,
        "files": [
            {"path": f.path, "size": f.result_size, "chunks": list(f.result_chunks)} for f in m.files
        ],
    }


def parse_ready(data: bytes) -> ReadyInfo:
    """Parse a READY marker.

    Raises:
        ProtocolError: not JSON, wrong format, or a field breaks its rule.
    """
    try:
        obj = json.loads(data)
    except ValueError as e:
        raise ProtocolError(f"READY is not JSON: {e}") from None
    if not isinstance(obj, dict) or obj.get("format") != READY_FORMAT:
        raise ProtocolError(f"READY format must be {READY_FORMAT!r}")
    ident = validate_identity(obj.get("identity"))
    cs = obj.get("chunk_size")
    pv = obj.get("policy_version")
    if not isinstance(cs, int) or not MIN_CHUNK_SIZE <= cs <= MAX_CHUNK_SIZE:
        raise ProtocolError("READY chunk_size out of range")
    if not isinstance(pv, int) or isinstance(pv, bool):
        raise ProtocolError("READY policy_version must be an integer")
    base = obj.get("base_identity")
    if base is not None:
        validate_identity(base)
    files = []
    for f in obj.get("files") or []:
        if not isinstance(f, dict):
            raise ProtocolError("READY files must be objects")
        p = validate_relpath(f.get("path"))
        size, chunks = f.get("size"), f.get("chunks")
        if not isinstance(size, int) or size < 0 or not isinstance(chunks, list):
            raise ProtocolError(f"READY entry for {p} is malformed")
        if len(chunks) != num_chunks(size, cs) or not all(
            isinstance(c, str) and DIGEST_RE.match(c) for c in chunks
        ):
            raise ProtocolError(f"READY chunk list for {p} is malformed")
        files.append((p, size, tuple(chunks)))
    return ReadyInfo(ident, str(obj.get("kind")), pv, base, cs, tuple(files))


class Store:
    """Directories of one swarm's snapshots under ``<shm_dir>/<swarm_id>``."""

    def __init__(self, shm_dir: str | os.PathLike[str], swarm_id: str) -> None:
        self.root = Path(shm_dir) / swarm_id
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / STAGING).mkdir(exist_ok=True)
        (self.root / STORED).mkdir(exist_ok=True)

    def ready_dir(self, identity: str) -> Path:
        return self.root / identity

    def staging_dir(self, identity: str) -> Path:
        return self.root / STAGING / identity

    def stored_dir(self, identity: str) -> Path:
        return self.root / STORED / identity

    def is_ready(self, identity: str) -> bool:
        return (self.ready_dir(identity) / READY_NAME).is_file()

    def read_ready(self, identity: str) -> ReadyInfo:
        return parse_ready((self.ready_dir(identity) / READY_NAME).read_bytes())

    def list_ready(self) -> list[ReadyInfo]:
        """Every snapshot with a valid READY marker (a broken one is skipped, not fatal)."""
        out = []
        for d in sorted(self.root.iterdir()):
            if d.name.startswith(".") or not (d / READY_NAME).is_file():
                continue
            try:
                info = parse_ready((d / READY_NAME).read_bytes())
            except (OSError, ProtocolError):
                continue
            if info.identity == d.name:
                out.append(info)
        return out

    def prepare_staging(self, m: Manifest) -> None:
        """Create empty staging files of the reconstructed sizes (sparse until written).

        Raises:
            OSError: e.g. ENOSPC when shm cannot hold the snapshot.
        """
        st = self.staging_dir(m.identity)
        if st.exists():
            shutil.rmtree(st)
        stored = self.stored_dir(m.identity)
        if stored.exists():
            shutil.rmtree(stored)
        for f in m.files:
            p = st / f.path
            p.parent.mkdir(parents=True, exist_ok=True)
            with open(p, "wb") as fh:
                fh.truncate(f.result_size)
            if f.is_diff:
                q = stored / f.path
                q.parent.mkdir(parents=True, exist_ok=True)
                with open(q, "wb") as fh:
                    fh.truncate(f.size)

    def publish(self, m: Manifest) -> Path:
        """Write READY into the staging directory, then rename it into place (atomic)."""
        st = self.staging_dir(m.identity)
        tmp = st / (READY_NAME + ".tmp")
        with open(tmp, "wb") as fh:
            fh.write(json.dumps(ready_from_manifest(m), indent=1).encode())
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, st / READY_NAME)
        final = self.ready_dir(m.identity)
        if final.exists():
            shutil.rmtree(final)
        os.replace(st, final)
        return final

    def discard(self, identity: str) -> None:
        """Remove a snapshot's staging and stored data (never its ready directory)."""
        shutil.rmtree(self.staging_dir(identity), ignore_errors=True)
        shutil.rmtree(self.stored_dir(identity), ignore_errors=True)

    def remove(self, identity: str) -> None:
        """Remove everything of a snapshot (GC)."""
        self.discard(identity)
        shutil.rmtree(self.ready_dir(identity), ignore_errors=True)
