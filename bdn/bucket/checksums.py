"""What an S3 or GCS bucket vouches for about an object (:class:`ObjectChecksum`): the MD5 in a
single-part ETag, a multipart ETag's composite MD5, part count and part layout, S3's additional
checksums (``x-amz-checksum-*``) and GCS's ``x-goog-hash``.

Sources: S3's ``HeadObject`` (``PartNumber``, ``ChecksumMode``, ``x-amz-mp-parts-count``,
``x-amz-checksum-type``), "Checking object integrity" in the S3 user guide, GCS's ``x-goog-hash``
header. Everything read here is untrusted header text from the bucket; a value that does not parse
is left out (None), never guessed. No boto3 here: :mod:`bdn.bucket.s3` hands in its HEAD and stat.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable

from bdn.bucket.base import ObjectChanged, ObjectChecksum, ObjectInfo, SdkChecksum, one_line

#: ``head(part, checksums) -> (Content-Length, raw response headers)``: a HEAD of the object with
#: ``If-Match`` on its ETag (``part`` None) or of part ``part`` (1-based); ``checksums`` asks for the
#: additional checksums. Raises ObjectChanged when the version or the part is gone, BucketError.
HeadFn = Callable[[int | None, bool], tuple[int, dict[str, str]]]


def object_checksum(
    key: str,
    etag: str,
    *,
    head: HeadFn,
    stat: Callable[[], ObjectInfo],
    gcs: bool,
    exact_parts: bool = False,
    where: str,
) -> ObjectChecksum:
    """S3: the MD5 in a single-part ETag, or the composite MD5, part count and part layout of
    a multipart one, and the object's additional checksum if it was uploaded with one; GCS:
    ``x-goog-hash``.

    The layout of a multipart object: ``HeadObject`` with ``PartNumber=1`` and ``PartNumber=N``
    give the first and last parts' sizes; when they fit parts of one size but the last, that
    is the layout (every AWS uploader cuts parts so), else (or with ``exact_parts``) every
    part is asked for its size (``part_sizes``). SSE-KMS/SSE-C objects
    (``x-amz-server-side-encryption: aws:kms`` or a customer key) have an ETag that is not an
    MD5; their additional checksum (``x-amz-checksum-*`` with ``ChecksumMode=ENABLED``, which
    current AWS SDKs send on every upload) is then all the bucket vouches for.
    """
    md5, parts = parse_s3_etag(etag)
    multipart = parts is not None and not gcs
    # A HEAD with PartNumber answers the *part's* additional checksum (S3 user guide, "Checking
    # object integrity": a part's checksum is read with GetObject/HeadObject and its part
    # number; moto >= 5.2 does the same), so a multipart object's own checksum comes from a
    # HEAD without one, below.
    first_size, headers = head(1 if multipart else None, not gcs and not multipart)
    if headers.get("x-amz-server-side-encryption") == "aws:kms" or headers.get(
        "x-amz-server-side-encryption-customer-algorithm"
    ):
        md5 = None
    if gcs:
        # GCS's ETag is an MD5 only for non-composite objects; x-goog-hash says which.
        goog_md5, crc = goog_hash(headers.get("x-goog-hash"))
        return ObjectChecksum(key=key, etag=etag, size=first_size, md5=goog_md5, crc32c=crc)
    if not multipart or parts is None:
        sdk = sdk_checksum(headers, False)
        return ObjectChecksum(key=key, etag=etag, size=first_size, md5=md5, sdk_checksum=sdk)
    count = headers.get("x-amz-mp-parts-count")
    if count is not None and str(count) != str(parts):
        raise ObjectChanged(
            f"object changed while it was read: {where} (ETag names {parts}"
            f" parts, the bucket now reports {one_line(count, 20)})",
            key,
        )
    sdk = sdk_checksum(head(None, True)[1], True)
    info = stat()
    if info.etag != etag:
        raise ObjectChanged(
            f"object changed while it was read: {where} (version {etag!r} is gone)",
            key,
        )
    sizes: tuple[int, ...] | None = None
    if parts > 1:
        last = head(parts, False)[0]
        if exact_parts or not uniform_parts(first_size, last, parts, info.size):
            middle = [head(k, False)[0] for k in range(2, parts)]
            sizes = (first_size, *middle, last)
            if sum(sizes) != info.size:
                raise ObjectChanged(
                    f"object changed while it was read: {where} (its parts add up to"
                    f" {sum(sizes)} bytes, not {info.size})",
                    key,
                )
    if stat().etag != etag:  # the part HEADs carry no If-Match
        raise ObjectChanged(
            f"object changed while it was read: {where} (version {etag!r} is gone)",
            key,
        )
    return ObjectChecksum(
        key=key,
        etag=etag,
        size=info.size,
        parts=parts,
        part_size=first_size,
        composite_md5=md5,
        part_sizes=sizes,
        sdk_checksum=sdk,
    )


def uniform_parts(first_size: int, last_size: int, parts: int, size: int) -> bool:
    """Whether ``parts`` parts of ``first_size`` bytes but the last (``last_size``) make up the
    object's ``size`` bytes: the layout every AWS uploader cuts, so the middle parts need no HEAD.
    Sizes in bytes, ``parts >= 2``."""
    return last_size <= first_size and first_size * (parts - 1) + last_size == size


_MD5_HEX = re.compile(r"[0-9a-f]{32}")
_MULTIPART_ETAG = re.compile(r"([0-9a-f]{32})-([1-9][0-9]{0,4})")


def parse_s3_etag(etag: str) -> tuple[str | None, int | None]:
    """``(md5 hex, None)`` for a single-part ETag, ``(composite md5 hex, N)`` for ``<hex>-N``
    (1 <= N <= 10000, S3's part limit), ``(None, None)`` for anything else. Quotes are ignored."""
    text = etag.strip('"').lower()
    if _MD5_HEX.fullmatch(text):
        return text, None
    m = _MULTIPART_ETAG.fullmatch(text)
    if m and int(m.group(2)) <= 10000:
        return m.group(1), int(m.group(2))
    return None, None


#: S3's additional checksum algorithms that bdn can check (CRC64NVME has no well-kept binding).
SDK_ALGORITHMS = ("crc32", "crc32c", "sha1", "sha256")


def sdk_checksum(headers: dict[str, str], multipart: bool) -> SdkChecksum | None:
    """The ``x-amz-checksum-<algorithm>`` of a HEAD answer: ``<base64>`` (a full-object checksum)
    or ``<base64>-N`` / ``x-amz-checksum-type: COMPOSITE`` (the checksum of the parts' binary
    checksums, concatenated); a multipart object's checksum without a type is taken as composite
    (S3's default for every algorithm but CRC64NVME) and marked untyped (``typed=False``).
    ``headers`` must be those of a HEAD without ``PartNumber``: with one, S3 answers the part's."""
    kind = str(headers.get("x-amz-checksum-type") or "").upper()
    for algorithm in SDK_ALGORITHMS:
        value = headers.get(f"x-amz-checksum-{algorithm}")
        if not isinstance(value, str):
            continue
        b64, dash, count = value.strip().partition("-")
        try:
            digest = base64.b64decode(b64, validate=True)
        except (ValueError, binascii.Error):
            return None
        typed = bool(dash) or kind in ("COMPOSITE", "FULL_OBJECT") or not multipart
        composite = bool(dash) or kind == "COMPOSITE" or (multipart and kind != "FULL_OBJECT")
        return SdkChecksum(algorithm, digest, composite, typed)
    return None


def goog_hash(value: object) -> tuple[str | None, int | None]:
    """``(md5 hex, crc32c)`` from GCS's ``x-goog-hash: crc32c=<b64>,md5=<b64>`` (either may lack)."""
    md5: str | None = None
    crc: int | None = None
    if not isinstance(value, str):
        return md5, crc
    for item in value.split(","):
        name, _, b64 = item.strip().partition("=")
        try:
            raw = base64.b64decode(b64, validate=True)
        except (ValueError, binascii.Error):
            continue
        if name == "md5" and len(raw) == 16:
            md5 = raw.hex()
        elif name == "crc32c" and len(raw) == 4:
            crc = int.from_bytes(raw, "big")
    return md5, crc
