"""The last step of a publish: the snapshot's manifest, written once every object is stored (its
presence is what publishes the snapshot), and the refusal to publish an identity twice."""

from __future__ import annotations

from datetime import UTC, datetime

from bdn.bucket import Bucket, ObjectNotFound
from bdn.proto.manifest import MANIFEST_NAME, FileEntry, Manifest
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
    b: Bucket, identity: str, policy_version: int, chunk_size: int, entries: list[FileEntry], overwrite: bool,
    *, delta_of: tuple[str, str] | None = None,
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
    # Checked again because another publisher may have committed the same identity meanwhile;
    # the bucket interface has no conditional put, so a narrow race remains.
    refuse_published(b, manifest.identity, overwrite)
    data = manifest.to_json()
    # Re-parse what we are about to publish: daemons will hold it to the same rules.
    Manifest.from_json(data, expect_identity=manifest.identity)
    b.write(f"{manifest.identity}/{MANIFEST_NAME}", data)
    return manifest
