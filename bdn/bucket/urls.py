"""Bucket URLs and :func:`open_bucket`, the one way the rest of bdn gets a :class:`Bucket`.

Accepted URLs (the design's "bucket")::

    file:///abs/path            a local directory (the embedded default)
    s3://bucket[/prefix]        Amazon S3 (or any S3 API: AWS_ENDPOINT_URL / endpoint_url)
    gs://bucket[/prefix]        Google Cloud Storage through its S3-compatible XML API
"""

from __future__ import annotations

import re
from urllib.parse import unquote, urlsplit

from bdn.bucket.base import (
    DEFAULT_MULTIPART_CHUNKSIZE,
    DEFAULT_MULTIPART_THRESHOLD,
    Bucket,
    BucketError,
    validate_key,
)
from bdn.bucket.credentials import load_credentials_file
from bdn.bucket.file import FileBucket
from bdn.proto.errors import PathError

# S3's bucket-name rule (3-63 chars of a-z 0-9 . -), widened to GCS's (underscores, and up to
# 222 chars when dotted); the service has the last word, this only keeps junk out of URLs.
_BUCKET_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{1,221}[a-z0-9]")


def open_bucket(
    url: str,
    *,
    credentials_file: str | None = None,
    endpoint_url: str | None = None,
    max_concurrency: int = 16,
    max_attempts: int = 8,
    multipart_threshold: int = DEFAULT_MULTIPART_THRESHOLD,
    multipart_chunksize: int = DEFAULT_MULTIPART_CHUNKSIZE,
    retry_backoff_scale: float = 1.0,
) -> Bucket:
    """Open the bucket at ``url``.

    ``credentials_file``: a ``reader.json`` (see :mod:`bdn.bucket.credentials`) to use instead of
    the standard AWS credential chain (s3/gs only). ``endpoint_url``: the S3 API endpoint; for s3
    boto3 otherwise honours ``AWS_ENDPOINT_URL``, for gs ``BDN_GCS_ENDPOINT_URL`` overrides
    ``https://storage.googleapis.com``. ``max_concurrency``: requests in flight at once;
    ``max_attempts``: attempts per request including the first (botocore standard retries).
    ``multipart_threshold``/``multipart_chunksize`` (bytes) and ``retry_backoff_scale``: see
    :class:`bdn.bucket.s3.S3Bucket`; the file backend ignores them.

    Raises :class:`BucketError` for an unusable URL or credentials file.
    """
    scheme, where, prefix = check_bucket_url(url)
    if scheme == "file":
        return FileBucket(url, where)
    # imported here, not at the top: boto3 and botocore are ~0.3 s CPU of the ~1.5 s a file://
    # daemon spends importing at start
    from bdn.bucket.s3 import S3Bucket

    credentials = load_credentials_file(credentials_file) if credentials_file else None
    return S3Bucket(
        url,
        bucket=where,
        prefix=prefix,
        gcs=scheme == "gs",
        credentials=credentials,
        endpoint_url=endpoint_url,
        max_concurrency=max_concurrency,
        max_attempts=max_attempts,
        multipart_threshold=multipart_threshold,
        multipart_chunksize=multipart_chunksize,
        retry_backoff_scale=retry_backoff_scale,
    )


def check_bucket_url(url: str) -> tuple[str, str, str]:
    """Validate a bucket URL without opening anything: ``(scheme, root or bucket, prefix)``.

    ``file:///abs/path`` -> ``("file", "/abs/path", "")``; ``s3://b/p`` -> ``("s3", "b", "p")``.
    Raises :class:`BucketError` naming what is wrong (bdnd's config check calls this at load).
    """
    if not isinstance(url, str) or not url:
        raise BucketError("bucket URL is empty")
    if any(ord(c) < 0x20 for c in url):
        raise BucketError(f"bucket URL contains a control character: {url!r}")
    try:
        parts = urlsplit(url)
        _ = parts.port  # raises ValueError on a port that is not a number in 0-65535
    except ValueError as exc:  # "Invalid IPv6 URL" (an unclosed '['), a bad port
        raise BucketError(f"bad bucket URL {url!r}: {exc}") from None
    scheme = parts.scheme.lower()
    if parts.query or parts.fragment:
        raise BucketError(f"bucket URL must not have a query or fragment: {url!r}")
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise BucketError(f"file bucket URL must be file:///absolute/path, got {url!r}")
        root = unquote(parts.path)
        if not root.startswith("/"):
            raise BucketError(f"file bucket URL must be file:///absolute/path, got {url!r}")
        if "\x00" in root:
            raise BucketError(f"file bucket URL contains NUL: {url!r}")
        return scheme, root, ""
    if scheme in ("s3", "gs"):
        bucket = parts.netloc
        if not _BUCKET_NAME.fullmatch(bucket):
            raise BucketError(f"bad bucket name {bucket!r} in {url!r}")
        prefix = parts.path.strip("/")
        if prefix:
            try:
                validate_key(prefix)
            except PathError as exc:
                raise BucketError(f"bad prefix in bucket URL {url!r}: {exc}") from None
        return scheme, bucket, prefix
    raise BucketError(f"unsupported bucket URL {url!r}: use file:///path, s3://bucket/prefix or gs://bucket/prefix")
