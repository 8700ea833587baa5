"""botocore's errors mapped onto the bucket errors of :mod:`bdn.bucket.base` (S3 and GCS codes).

Every failure of an S3 API call leaves :mod:`bdn.bucket.s3` and :mod:`bdn.bucket.s3_reads` as
one of :class:`ObjectNotFound`, :class:`AccessDenied`, :class:`BucketUnavailable` (throttled or
failing after the retries) or :class:`BucketError`, with a one-line message naming the
operation and the object. The codes are S3's (``NoSuchKey``, ``SlowDown``, ...) and the
spellings GCS's XML API and S3-compatible stores answer with; the HTTP status decides where the
code is unknown. Pure: no client, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import botocore.exceptions as bex

from bdn.bucket.base import AccessDenied, BucketError, BucketUnavailable, ObjectNotFound, one_line

_NOT_FOUND_CODES = {"NoSuchKey", "NotFound", "404"}
_DENIED_CODES = {
    "AccessDenied",
    "403",
    "Forbidden",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "AllAccessDisabled",
}
_UNAVAILABLE_STATUS = {429, 500, 502, 503, 504}
_UNAVAILABLE_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "TooManyRequests",
    "TooManyRequestsException",
    "InternalError",
    "ServiceUnavailable",
    "RequestTimeout",
}


def status_and_code(exc: bex.ClientError) -> tuple[Any, str]:
    """The HTTP status and the S3 error code (``""`` if none) of a botocore ClientError."""
    response: Mapping[str, Any] = exc.response or {}
    return (response.get("ResponseMetadata") or {}).get("HTTPStatusCode"), str(
        (response.get("Error") or {}).get("Code") or ""
    )


def map_error(op: str, where: str, exc: Exception, *, bucket: str, max_attempts: int) -> BucketError:
    """The bucket error for ``exc`` raised by operation ``op`` (``"stat"``, ``"read"``, ...) on
    ``where`` (the object's or the bucket's URL); ``bucket`` is the bucket's name and
    ``max_attempts`` the attempts botocore made at most, both for the message."""
    if isinstance(exc, bex.ClientError):
        status, code = status_and_code(exc)
        response: Mapping[str, Any] = exc.response or {}
        meta = response.get("ResponseMetadata") or {}
        message = one_line((response.get("Error") or {}).get("Message") or "")
        what = f"{code or 'HTTP'} ({status})" + (f": {message}" if message else "")
        if code == "NoSuchBucket":
            return BucketError(f"{op} {where}: bucket {bucket!r} does not exist")
        if code in _NOT_FOUND_CODES or status == 404:
            return ObjectNotFound(f"object not found: {where}")
        if code in _DENIED_CODES or status == 403:
            return AccessDenied(f"{op} {where}: access denied: {what}")
        if isinstance(status, int) and 300 <= status < 400:
            # bdn never follows a redirect (it could lead to other bytes); a bucket that answers
            # one now may not on the next try, which the caller may make
            return BucketUnavailable(f"{op} {where}: answered a redirect, which bdn does not follow: {what}")
        if code in _UNAVAILABLE_CODES or status in _UNAVAILABLE_STATUS:
            attempts = int(meta.get("RetryAttempts", 0)) + 1
            return BucketUnavailable(f"{op} {where}: gave up after {attempts} attempts: {what}")
        return BucketError(f"{op} {where}: {what}")
    if isinstance(exc, (bex.ConnectionError, bex.HTTPClientError)):
        return BucketUnavailable(f"{op} {where}: gave up after up to {max_attempts} attempts: {one_line(exc)}")
    if isinstance(exc, bex.NoCredentialsError):
        return BucketError(f"{op} {where}: no credentials found (AWS standard chain)")
    if isinstance(exc, bex.BotoCoreError):
        return BucketError(f"{op} {where}: {one_line(exc)}")
    return BucketError(f"{op} {where}: {type(exc).__name__}: {one_line(exc)}")
