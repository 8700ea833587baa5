"""Re-read from the bucket only what failed verification, and find which bytes were wrong.

Used after :func:`bdn.foreign.checksum.verify_object` said ``bad``: the parts it names (or every
part, when it could not locate them) are read again from the bucket, at the object's version
token, one chunk at a time into a scratch buffer of ``chunk_size`` bytes, compared with the
assembled copy, and copied over it where they differ. The ranges that differed are returned,
chunk by chunk, so the caller can tell which peer sent them (and penalise it); the copy is then
verified again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bdn.bucket import Bucket, ObjectChecksum
from bdn.foreign.checksum import Verdict, verify_object
from bdn.proto.errors import ChecksumError


@dataclass(frozen=True)
class Repair:
    """What :func:`repair_from_bucket` did.

    ``parts``: part indices re-read. ``bad_ranges``: ``(offset, length)`` byte ranges, at most
    ``chunk_size`` long and chunk-aligned when the parts are, whose bytes differed from the
    bucket's and were replaced. ``bytes_read``: bytes read from the bucket. ``verdict``: the
    verification of the repaired copy (always ok: otherwise ChecksumError was raised).
    """

    parts: tuple[int, ...]
    bad_ranges: tuple[tuple[int, int], ...]
    bytes_read: int
    verdict: Verdict


def repair_from_bucket(
    bucket: Bucket,
    checksum: ObjectChecksum,
    buf: Any,
    verdict: Verdict,
    *,
    chunk_size: int,
    certified_parts: Sequence[str] | None = None,
) -> Repair:
    """Re-read the bad parts of ``buf`` (object ``checksum.key`` at ``checksum.etag``) from
    ``bucket`` and fix them in place (``buf`` writable, ``checksum.size`` bytes).

    ``verdict``: what :func:`verify_object` said of ``buf``; its ``bad_parts`` are re-read, or all
    parts when it is ``None``. Raises ``ObjectChanged`` when the object was replaced (the table
    is stale: derive it again), ``BucketError`` for a failed read, and ChecksumError when even
    the bucket's own bytes do not match its checksum (an ETag that is not an MD5, such as
    SSE-KMS's, or a faulty bucket): nothing can vouch for that object then.
    """
    if verdict.ok:
        return Repair((), (), 0, verdict)
    indices = verdict.bad_parts if verdict.bad_parts is not None else tuple(p.index for p in verdict.parts)
    scratch = bytearray(min(chunk_size, max((verdict.parts[i].length for i in indices), default=0)))
    bad: list[tuple[int, int]] = []
    read = 0
    with (
        memoryview(buf) as whole,
        whole.cast("B") if whole.format != "B" else whole as view,
        memoryview(scratch) as tmp,
    ):
        for i in indices:
            part = verdict.parts[i]
            end = part.offset + part.length
            for offset in range(part.offset, end, chunk_size):
                n = min(chunk_size, end - offset)
                bucket.read_range_into(checksum.key, offset, tmp[:n], if_match=checksum.etag)
                read += n
                if view[offset : offset + n] != tmp[:n]:
                    view[offset : offset + n] = tmp[:n]
                    bad.append((offset, n))
    after = verify_object(buf, checksum, certified_parts=certified_parts)
    if not after.ok and checksum.parts is not None and checksum.parts > 2 and checksum.part_sizes is None:
        # The layout was inferred from the first and last parts; an uploader may have cut the
        # middle ones differently. Ask every part, once, before blaming the bucket.
        exact = bucket.checksum(checksum.key, checksum.etag, exact_parts=True)
        after = verify_object(buf, exact)
    if not after.ok:
        raise ChecksumError(
            f"{checksum.key}: the bucket's own bytes do not match its {after.method} checksum"
            " (an ETag that is not an MD5, such as SSE-KMS's, or a faulty bucket)"
        )
    return Repair(tuple(indices), tuple(bad), read, after)


def verify_or_repair(
    bucket: Bucket,
    checksum: ObjectChecksum,
    buf: Any,
    *,
    chunk_size: int,
    certified_parts: Sequence[str] | None = None,
    workers: int = 1,
) -> tuple[Verdict, Repair | None]:
    """:func:`verify_object`, then :func:`repair_from_bucket` when the copy is bad.

    Returns ``(verdict of the copy as assembled, repair or None)``; after it, ``buf`` holds the
    bucket's bytes, unless the verdict is ``unverifiable`` (nothing was checked or changed).
    Raises as :func:`repair_from_bucket`.
    """
    verdict = verify_object(buf, checksum, certified_parts=certified_parts, workers=workers)
    if verdict.status != "bad":
        return verdict, None
    return verdict, repair_from_bucket(
        bucket, checksum, buf, verdict, chunk_size=chunk_size, certified_parts=certified_parts
    )


def bad_chunks(bad_ranges: Sequence[tuple[int, int]], chunk_size: int) -> list[int]:
    """The stored chunk indices that the byte ranges of :attr:`Repair.bad_ranges` touch, sorted:
    the chunks to blame on the peers that sent them."""
    out: set[int] = set()
    for offset, length in bad_ranges:
        out.update(range(offset // chunk_size, (offset + max(length, 1) - 1) // chunk_size + 1))
    return sorted(out)
