"""Verify an object assembled from peers against the bucket's own checksum (docs/TRUST.md).

Pure functions over a buffer and a :class:`bdn.bucket.ObjectChecksum`; no I/O.

What the bucket vouches for (the root of trust of a foreign snapshot, as the manifest is for a bdn
one):

* S3 single-part object (no SSE-KMS / SSE-C): ETag = MD5 of the object (RFC 1321).
* S3 multipart object: ETag = ``MD5(md5(part 1) || ... || md5(part N))`` in hex, then ``-N``,
  where ``md5(part)`` is the 16-byte binary digest. ``HeadObject`` with ``PartNumber=1`` gives the
  first part's size; uploaders (s3transfer, the AWS CLI, boto3) cut every part but the last to
  that size, which :func:`part_ranges` assumes and a mismatch reports.
* S3 additional checksums (``x-amz-checksum-crc32`` / ``-crc32c`` / ``-sha1`` / ``-sha256``, sent
  by current AWS SDKs on every upload): of the whole object, or (multipart ``COMPOSITE``) of the
  parts' concatenated binary checksums. Used when there is no MD5 (SSE-KMS, SSE-C).
* GCS: ``x-goog-hash``: ``md5`` for non-composite objects, ``crc32c`` (Castagnoli, RFC 3720 B.4)
  for all.

The list of a multipart object's part MD5s is **self-certifying**: anyone can check it against the
ETag (:func:`certify_part_md5s`), so a daemon whose copy verified can hand its list to a daemon
whose copy did not, and that one then knows exactly which parts are bad without reading the
bucket and without trusting the sender.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import google_crc32c

from bdn.bucket import ObjectChecksum
from bdn.proto.errors import ChecksumError

#: Verdict statuses.
OK, BAD, UNVERIFIABLE = "ok", "bad", "unverifiable"


@dataclass(frozen=True)
class Part:
    """Part ``index`` of an object: bytes ``[offset, offset + length)``."""

    index: int
    offset: int
    length: int


@dataclass(frozen=True)
class Verdict:
    """The result of :func:`verify_object`.

    ``status``: ``"ok"`` (the bytes are the bucket's), ``"bad"`` or ``"unverifiable"`` (the bucket
    vouches for nothing: ``file://``, SSE-KMS, a GCS object without hashes). ``method``: ``"md5"``,
    ``"multipart-md5"``, ``"crc32c"`` or ``"none"``. ``parts``: the ranges checked (one covering
    the object unless multipart). ``part_md5s``: hex MD5 of each part (multipart only; certified
    when ``status`` is ok). ``bad_parts``: indices of parts known to be wrong, or ``None`` when the
    object is wrong but the parts are not located (multipart without a certified list).
    ``reason``: one line for logs and snapshot reasons.
    """

    key: str
    status: str
    method: str
    parts: tuple[Part, ...]
    part_md5s: tuple[str, ...] = ()
    bad_parts: tuple[int, ...] | None = ()
    reason: str = ""

    @property
    def ok(self) -> bool:
        """True when the verdict's status is ``OK`` (the bytes matched what the bucket vouches for)."""
        return self.status == OK


def part_ranges(size: int, part_size: int, parts: int, part_sizes: Sequence[int] | None = None) -> tuple[Part, ...]:
    """The parts of a ``size``-byte multipart object of ``parts`` parts.

    With ``part_sizes`` (every part's size, as the bucket reported them) those; else every part
    but the last has the first's ``part_size`` (what uploaders do). Raises ChecksumError when the
    layout cannot describe ``parts`` parts covering ``size`` bytes.
    """
    if part_sizes is not None:
        if len(part_sizes) != parts or sum(part_sizes) != size or any(n <= 0 for n in part_sizes):
            raise ChecksumError(
                f"bad multipart layout: part sizes {list(part_sizes)[:8]} for {parts} parts of {size} bytes"
            )
        out, offset = [], 0
        for i, n in enumerate(part_sizes):
            out.append(Part(i, offset, n))
            offset += n
        return tuple(out)
    if part_size <= 0 or parts <= 0 or size < 0:
        raise ChecksumError(f"bad multipart layout: {parts} parts of {part_size} bytes for {size} bytes")
    want = max(1, -(-size // part_size))
    if want != parts:
        raise ChecksumError(
            f"a {size}-byte object with a first part of {part_size} bytes has {want} equal parts,"
            f" but its ETag names {parts}: its parts have several sizes"
        )
    return tuple(Part(i, i * part_size, min(part_size, size - i * part_size)) for i in range(parts))


def _md5(view: memoryview) -> bytes:
    return hashlib.md5(view).digest()  # hashlib releases the GIL on large buffers


def part_md5s(buf: Any, parts: Sequence[Part], *, workers: int = 1) -> list[bytes]:
    """The binary MD5 of each part of ``buf`` (parts hashed on ``workers`` threads)."""
    with memoryview(buf) as whole, whole.cast("B") if whole.format != "B" else whole as view:
        slices = [view[p.offset : p.offset + p.length] for p in parts]
        try:
            if workers > 1 and len(slices) > 1:
                with ThreadPoolExecutor(max_workers=min(workers, len(slices))) as pool:
                    return list(pool.map(_md5, slices))
            return [_md5(s) for s in slices]
        finally:
            for s in slices:
                s.release()


#: google_crc32c takes only ``bytes``: objects are checked through copies of this size.
_CRC_PIECE = 4 << 20


def crc32c(buf: Any) -> int:
    """CRC-32C (Castagnoli) of ``buf``, as GCS's ``x-goog-hash`` carries it; memory bounded."""
    crc = 0
    with memoryview(buf) as whole, whole.cast("B") if whole.format != "B" else whole as view:
        for offset in range(0, len(view), _CRC_PIECE):
            crc = google_crc32c.extend(crc, bytes(view[offset : offset + _CRC_PIECE]))
    return crc


def certify_part_md5s(md5s: Sequence[str], checksum: ObjectChecksum) -> bool:
    """True when ``md5s`` (hex, one per part) are the parts of the object ``checksum`` describes:
    their count is the ETag's N and the MD5 of their binary concatenation is its digest."""
    if checksum.composite_md5 is None or checksum.parts is None or len(md5s) != checksum.parts:
        return False
    try:
        joined = b"".join(bytes.fromhex(m) for m in md5s)
    except ValueError:
        return False
    if len(joined) != 16 * checksum.parts:
        return False
    return hashlib.md5(joined).hexdigest() == checksum.composite_md5


def verify_object(
    buf: Any,
    checksum: ObjectChecksum,
    *,
    certified_parts: Sequence[str] | None = None,
    workers: int = 1,
) -> Verdict:
    """Check the object's bytes in ``buf`` (exactly ``checksum.size`` bytes) against the bucket.

    The first checksum the bucket gave is used: the ETag's MD5, the multipart ETag's part MD5s,
    S3's additional checksum (whole or composite), GCS's CRC-32C; none: ``unverifiable``.
    ``certified_parts``: another daemon's list of part MD5s (hex) for this object version; it is
    used only if :func:`certify_part_md5s` accepts it, and then names every bad part. Without it,
    a wrong multipart object comes back with ``bad_parts=None`` (re-read to locate:
    :func:`bdn.foreign.repair.repair_from_bucket`). A single-part object is one part: a mismatch
    names part 0. ``workers``: threads hashing parts. Never raises for wrong bytes; raises
    ChecksumError for an unusable multipart layout, ValueError for a buffer of the wrong size.
    """
    size = memoryview(buf).nbytes
    if size != checksum.size:
        raise ValueError(f"{checksum.key}: buffer has {size} bytes, the object {checksum.size}")
    whole = (Part(0, 0, size),)
    if checksum.md5 is not None:
        got = part_md5s(buf, whole)[0].hex()
        if got == checksum.md5:
            return Verdict(checksum.key, OK, "md5", whole, reason="MD5 matches the bucket's")
        return Verdict(
            checksum.key,
            BAD,
            "md5",
            whole,
            bad_parts=(0,),
            reason=f"{checksum.key}: MD5 {got} of the assembled object is not the bucket's {checksum.md5}",
        )
    if checksum.composite_md5 is not None and checksum.parts is not None and checksum.part_size:
        parts = part_ranges(size, checksum.part_size, checksum.parts, checksum.part_sizes)
        md5s = tuple(d.hex() for d in part_md5s(buf, parts, workers=workers))
        if certify_part_md5s(md5s, checksum):
            return Verdict(checksum.key, OK, "multipart-md5", parts, md5s, reason="every part matches the ETag")
        trusted = list(certified_parts) if certified_parts is not None else None
        if trusted is not None and certify_part_md5s(trusted, checksum):
            bad = tuple(i for i, (a, b) in enumerate(zip(md5s, trusted)) if a != b.lower())
            names = ", ".join(
                f"part {i + 1} (bytes {parts[i].offset}-{parts[i].offset + parts[i].length - 1})" for i in bad
            )
            return Verdict(
                checksum.key,
                BAD,
                "multipart-md5",
                parts,
                md5s,
                bad,
                reason=f"{checksum.key}: {names} differ from the bucket's",
            )
        return Verdict(
            checksum.key,
            BAD,
            "multipart-md5",
            parts,
            md5s,
            None,
            reason=f"{checksum.key}: the MD5 of its {checksum.parts} part MD5s is not the ETag's {checksum.composite_md5}",
        )
    if checksum.sdk_checksum is not None:
        return _verify_sdk(buf, checksum, size, whole, workers)
    if checksum.crc32c is not None:
        got_crc = crc32c(buf)
        if got_crc == checksum.crc32c:
            return Verdict(checksum.key, OK, "crc32c", whole, reason="CRC-32C matches the bucket's")
        return Verdict(
            checksum.key,
            BAD,
            "crc32c",
            whole,
            bad_parts=(0,),
            reason=f"{checksum.key}: CRC-32C {got_crc:08x} of the assembled object is not the bucket's {checksum.crc32c:08x}",
        )
    return Verdict(
        checksum.key,
        UNVERIFIABLE,
        "none",
        whole,
        reason=f"{checksum.key}: the bucket keeps no checksum of this object",
    )


def sdk_digest(algorithm: str, buf: Any) -> bytes:
    """The raw digest S3 keeps for ``algorithm`` (``crc32``, ``crc32c``: 4 bytes big-endian;
    ``sha1``, ``sha256``) of ``buf``. Raises ValueError for another algorithm."""
    if algorithm == "crc32":
        return zlib.crc32(memoryview(buf).cast("B") if memoryview(buf).format != "B" else buf).to_bytes(4, "big")
    if algorithm == "crc32c":
        return crc32c(buf).to_bytes(4, "big")
    if algorithm in ("sha1", "sha256"):
        return hashlib.new(algorithm, buf).digest()
    raise ValueError(f"unsupported checksum algorithm {algorithm!r}")


def _verify_sdk(buf: Any, checksum: ObjectChecksum, size: int, whole: tuple[Part, ...], workers: int) -> Verdict:
    sdk = checksum.sdk_checksum
    assert sdk is not None
    method = f"{sdk.algorithm}{'-composite' if sdk.composite else ''}"
    if not sdk.composite:
        got = sdk_digest(sdk.algorithm, buf)
        if got == sdk.digest:
            return Verdict(checksum.key, OK, method, whole, reason=f"{sdk.algorithm} matches the bucket's")
        return Verdict(
            checksum.key,
            BAD,
            method,
            whole,
            bad_parts=(0,),
            reason=f"{checksum.key}: {sdk.algorithm} {got.hex()} of the assembled object is not the bucket's {sdk.digest.hex()}",
        )
    if checksum.parts is None or not checksum.part_size:
        return Verdict(
            checksum.key,
            UNVERIFIABLE,
            method,
            whole,
            reason=f"{checksum.key}: a composite {sdk.algorithm} without a part layout",
        )
    parts = part_ranges(size, checksum.part_size, checksum.parts, checksum.part_sizes)
    with memoryview(buf) as mv, mv.cast("B") if mv.format != "B" else mv as view:
        slices = [view[p.offset : p.offset + p.length] for p in parts]
        try:
            if workers > 1 and len(slices) > 1:
                with ThreadPoolExecutor(max_workers=min(workers, len(slices))) as pool:
                    digests = list(pool.map(lambda v: sdk_digest(sdk.algorithm, v), slices))
            else:
                digests = [sdk_digest(sdk.algorithm, v) for v in slices]
        finally:
            for v in slices:
                v.release()
    if sdk_digest(sdk.algorithm, b"".join(digests)) == sdk.digest:
        return Verdict(checksum.key, OK, method, parts, reason=f"every part matches the composite {sdk.algorithm}")
    if not sdk.typed and sdk_digest(sdk.algorithm, buf) == sdk.digest:
        # The store gave no checksum type: a full-object checksum is as good an answer.
        return Verdict(checksum.key, OK, sdk.algorithm, whole, reason=f"{sdk.algorithm} matches the bucket's")
    return Verdict(
        checksum.key,
        BAD,
        method,
        parts,
        bad_parts=None,
        reason=f"{checksum.key}: the {sdk.algorithm} of its {len(parts)} part checksums is not the bucket's",
    )
