"""The last step of a publish: the snapshot's manifest, written once every object is stored (its
presence is what publishes the snapshot), and the refusal to publish an identity twice.

Two publishers of one identity at once (two ``commit_step`` calls of a sharded step, a retry
while the first still runs) are told apart by the bucket's conditional write
(:meth:`bdn.bucket.Bucket.write_new`): the manifest is created only if absent, and a sharded
commit first creates its claim ``.bdn-parts/<identity>/commit.json``, so only the claim's holder
writes the step's extra files and manifest.
"""

from __future__ import annotations

import json
import os
import socket
from datetime import UTC, datetime

from bdn.bucket import Bucket, ObjectNotFound
from bdn.proto.manifest import MANIFEST_NAME, FileEntry, Manifest
from bdn.proto.parts import PARTS_DIR
from bdn.publish.errors import PublishError

#: The checksum format of every delta bdn writes, spelled as the hosted hot-load APIs spell it.
CHECKSUM_FORMAT = "alder32"


def now() -> str:
    """The current UTC time as RFC 3339 with seconds (``2026-12-01T14:22:25Z``), the manifest's ``published_at``."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def refuse_published(b: Bucket, identity: str, overwrite: bool) -> None:
    """Raise PublishError if ``identity``'s manifest is already in bucket ``b``, unless ``overwrite``."""
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


def commit(
    b: Bucket,
    identity: str,
    policy_version: int,
    chunk_size: int,
    entries: list[FileEntry],
    overwrite: bool,
    *,
    delta_of: tuple[str, str] | None = None,
) -> Manifest:
    """Build the snapshot's manifest and write it: the last object, whose presence publishes it.

    ``delta_of`` is ``(base identity, compression format)`` for a delta, None for a full
    snapshot; ``chunk_size`` in bytes, the one ``entries`` were cut with. Returns the manifest
    written. Raises PublishError if ``identity`` is already published (unless ``overwrite``),
    ManifestError if the manifest breaks a rule of ``bdn.snapshot/1``, BucketError from the write.
    """
    base, fmt = delta_of if delta_of is not None else (None, None)
    manifest = Manifest(
        identity=identity,
        kind="full" if delta_of is None else "delta",
        policy_version=policy_version,
        chunk_size=chunk_size,
        files=tuple(entries),
        created_at=now(),
        base_identity=base,
        compression_format=fmt,
        checksum_format=None if delta_of is None else CHECKSUM_FORMAT,
    )
    data = manifest.to_json()
    # Re-parse what we are about to publish: daemons will hold it to the same rules.
    Manifest.from_json(data, expect_identity=manifest.identity)
    key = f"{manifest.identity}/{MANIFEST_NAME}"
    if overwrite:
        b.write(key, data)
    elif not b.write_new(key, data):  # another publisher committed the same identity meanwhile
        refuse_published(b, manifest.identity, overwrite)
        raise PublishError(f"snapshot {identity!r} was published by another publisher meanwhile")
    return manifest


def claim_key(identity: str) -> str:
    """The bucket key of a sharded commit's claim on ``identity``."""
    return f"{PARTS_DIR}/{identity}/commit.json"


def claim_commit(b: Bucket, identity: str, overwrite: bool) -> None:
    """Become the one committer of ``identity``: create its claim (JSON: host, pid, start time)
    if absent. With ``overwrite`` the claim is written unconditionally. A claim left by a
    process of this host that no longer runs is taken over.

    Raises PublishError naming the holder when another commit holds the claim (one that may
    have died on another host: then commit again with ``overwrite=True``).
    """
    key = claim_key(identity)
    body = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": now()}).encode()
    if overwrite:
        b.write(key, body)
        return
    if b.write_new(key, body):
        return
    try:
        held = json.loads(b.read(key))
        host, pid, started = str(held["host"]), int(held["pid"]), str(held["started"])
    except ObjectNotFound:  # the holder's claim went away (an overwrite?): try once more
        if b.write_new(key, body):
            return
        host, pid, started = "?", 0, "?"
    except (ValueError, KeyError, TypeError):
        host, pid, started = "?", 0, "?"
    if host == socket.gethostname() and pid > 0 and pid != os.getpid() and not _alive(pid):
        b.write(key, body)
        return
    refuse_published(b, identity, overwrite)
    raise PublishError(
        f"step {identity!r} is being committed by another publisher ({host} pid {pid}, since {started}; "
        f"claim {key}); if that commit died, commit again with overwrite=True"
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
