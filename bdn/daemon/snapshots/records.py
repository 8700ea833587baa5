"""What a restarted daemon needs to rebuild a ready snapshot's record exactly: the manifest it was
rebuilt from, kept in the store beside READY (DESIGN.md, "Progress files and restart").

``<root>/.manifests/<identity>`` is written just before the snapshot's directory is renamed into
place (``Store.publish``) and removed with the snapshot. It is msgpack (format ``bdn.record/1``)::

    {"format": "bdn.record/1", "manifest": <the manifest's canonical JSON bytes>,
     "digest": <xxh3-128 hex of the bytes read from the bucket>, "created": <epoch s the job
     started on this node>, "derived": <true: a table derived here, no bdn manifest>}

READY alone (``bdn.ready/1``) names the rebuilt files and the policy version, but not the
manifest's creation time, a delta's stored diff objects, its formats, nor the digest saved
progress is keyed to; a record rebuilt from READY alone answered a hot-load's claims with an
empty publish time, and the hot-load was refused after its 200. With the record, the
restarted daemon parses the manifest with the same parser (``Manifest.from_json``) and builds the
job with the same steps as a fresh download. The file is read from shared memory anyone on the
node may write, so it is parsed as untrusted input and must describe exactly the files READY
lists; a record that does not is ignored (READY alone, ``derived``: no claims are checked against it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgpack

from bdn.daemon.observe.packing import packb
from bdn.proto.chunks import DIGEST_RE
from bdn.proto.errors import ProtocolError
from bdn.proto.manifest import MAX_MANIFEST_BYTES, FileEntry, Manifest
from bdn.proto.ready import ReadyMarker

RECORD_FORMAT = "bdn.record/1"
#: Largest record read back: the largest manifest plus the few fields around it.
MAX_RECORD_BYTES = MAX_MANIFEST_BYTES + 4096


@dataclass(frozen=True)
class Record:
    """A parsed record: the manifest, its bucket digest, when the job started (epoch s), and
    whether the table was derived here (a snapshot without a bdn manifest)."""

    manifest: Manifest
    digest: str
    created: float
    derived: bool


def record_bytes(m: Manifest, digest: str, created: float, derived: bool) -> bytes:
    """The record of a snapshot rebuilt from ``m`` (msgpack bytes, ``bdn.record/1``)."""
    return packb(
        {
            "format": RECORD_FORMAT,
            "manifest": m.to_json(),
            "digest": digest,
            "created": float(created),
            "derived": bool(derived),
        }
    )


def parse_record(data: bytes, identity: str) -> Record:
    """Parse and validate the record of ``identity`` (blocking: parses a manifest of up to 64
    MiB, call it on a worker thread).

    Raises:
        ProtocolError: one line naming what is wrong (not msgpack, a bad field, a manifest that
            does not parse or names another identity).
    """
    if len(data) > MAX_RECORD_BYTES:
        raise ProtocolError(f"record is {len(data)} bytes, over {MAX_RECORD_BYTES}")
    try:
        obj: Any = msgpack.unpackb(data, raw=False)
    except (ValueError, msgpack.UnpackException) as e:
        raise ProtocolError(f"record is not msgpack: {e}") from None
    if not isinstance(obj, dict) or obj.get("format") != RECORD_FORMAT:
        raise ProtocolError(f"record format is not {RECORD_FORMAT!r}")
    raw, digest, created, derived = obj.get("manifest"), obj.get("digest"), obj.get("created"), obj.get("derived")
    if not isinstance(raw, bytes):
        raise ProtocolError("record 'manifest' must be bytes")
    if not isinstance(digest, str) or not (digest == "" or DIGEST_RE.match(digest)):
        raise ProtocolError("record 'digest' must be an xxh3-128 hex digest")
    if not isinstance(created, float) or not math.isfinite(created) or created < 0:
        raise ProtocolError("record 'created' must be a finite non-negative float")
    if not isinstance(derived, bool):
        raise ProtocolError("record 'derived' must be a boolean")
    m = Manifest.from_json(raw, expect_identity=identity)
    return Record(m, digest, created, derived)


def matches_ready(m: Manifest, info: ReadyMarker) -> str:
    """ "" if ``m``'s rebuilt files are exactly the files READY lists (paths, sizes, chunk
    digests, chunk size, kind, policy version, base), else the first difference (one line)."""
    if (m.identity, m.kind, m.policy_version, m.base_identity, m.chunk_size) != (
        info.identity,
        info.kind,
        info.policy_version,
        info.base_identity,
        info.chunk_size,
    ):
        return "identity, kind, policy version, base or chunk size differ from READY's"
    if len(m.files) != len(info.files):
        return f"{len(m.files)} files, READY lists {len(info.files)}"
    for f, r in zip(m.files, info.files):
        if f.path != r.path or f.result_size != r.size or list(f.result_chunks) != list(r.chunks):
            return f"{f.path}: not the file READY lists"
    return ""


def from_ready(info: ReadyMarker) -> Manifest:
    """The table READY alone gives (no record, or a record that does not match): the rebuilt
    files as a full snapshot's, with READY's policy version (no creation time, no stored diffs)."""
    return Manifest(
        identity=info.identity,
        kind="full",
        policy_version=info.policy_version,
        chunk_size=info.chunk_size,
        files=tuple(FileEntry(f.path, f.size, f.chunks) for f in info.files),
    )
