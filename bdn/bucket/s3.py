"""``s3://bucket/prefix`` and ``gs://bucket/prefix`` (GCS's S3-compatible XML API) with boto3.

Retries are botocore's own "standard" mode (jittered exponential backoff on throttling codes such
as ``SlowDown``, on 429, on 500/502/503/504 and on connection errors, with the SDKs' shared retry
quota) rather than a loop of ours: it is what every AWS SDK does and is well kept. We wrap its
``needs-retry`` handler only to count retries in :class:`BucketStats` and, for tests, to scale its
delays. The one retry loop of our own (:mod:`bdn.bucket.s3_reads`) resumes a GET whose *body*
broke mid-stream (botocore only retries until the headers arrive): it re-asks the missing byte
range with ``If-Match`` on the first response's ETag, so a resumed read never mixes two versions
of an object.

Concurrency: every call holds one slot of a ``BoundedSemaphore(max_concurrency)`` for as long as
it uses a connection (for a GET, until the body is drained). ``write_file`` runs its multipart
parts on s3transfer's own pool of ``multipart_concurrency`` threads, which bounds those parts
separately; botocore's connection pool is sized for both so no connection is opened and dropped.

GCS S3-API quirks handled here (``gs://``):
- botocore >= 1.36 by default sends ``x-amz-checksum-crc32`` with an ``aws-chunked`` trailer body
  on PUT/UploadPart and asks for checksums on GET; GCS's XML API does not implement the flexible
  checksums and rejects or mis-stores such bodies, so both are "when_required" there.
- SigV4 must be signed for region ``us-east-1``; path-style addressing is used.
- An AWS session token must not be sent (GCS rejects ``x-amz-security-token``): credentials
  from the standard chain are reduced to the HMAC key id and secret.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import boto3
import botocore.exceptions as bex
import botocore.loaders
import botocore.session
from boto3.s3.transfer import TransferConfig, create_transfer_manager
from botocore.config import Config
from botocore.retries import standard as standard_retries

from bdn.bucket.base import (
    DEFAULT_MAX_READ,
    AccessDenied,
    Bucket,
    BucketError,
    BucketStats,
    BucketUnavailable,
    ObjectChanged,
    ObjectChecksum,
    ObjectInfo,
    ObjectNotFound,
    as_byte_view,
    one_line,
    validate_key,
    validate_prefix,
)
from bdn.bucket.checksums import object_checksum
from bdn.bucket.credentials import ReaderCredentials
from bdn.bucket.s3_reads import fill, status_and_code
from bdn.proto.errors import PathError

log = logging.getLogger(__name__)

GCS_ENDPOINT_URL = "https://storage.googleapis.com"
GCS_REGION = "us-east-1"

DEFAULT_MULTIPART_THRESHOLD = 64 << 20
DEFAULT_MULTIPART_CHUNKSIZE = 16 << 20

_T = TypeVar("_T")

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
class S3Bucket(Bucket):
    """An S3 (or GCS through its S3 API) bucket under an optional key prefix.

    ``bucket``: bucket name; ``prefix``: the root inside it, without leading/trailing ``/``
    (``""`` for the whole bucket). ``gcs`` selects the GCS endpoint, region and quirks.
    ``credentials``: static keys (a ``reader.json``) or ``None`` for the standard chain.
    ``max_attempts``: total attempts per request, first one included.
    ``multipart_threshold``/``multipart_chunksize`` (bytes): ``write_file`` switches to multipart
    at the threshold and uploads parts of the chunk size (S3 needs >= 5 MiB; s3transfer enforces
    it). ``retry_backoff_scale`` multiplies botocore's backoff delays (1.0 in production; tests
    use a small value so a few throttled attempts take milliseconds).
    """

    def __init__(
        self,
        url: str,
        *,
        bucket: str,
        prefix: str = "",
        gcs: bool = False,
        credentials: ReaderCredentials | None = None,
        endpoint_url: str | None = None,
        max_concurrency: int = 16,
        max_attempts: int = 8,
        multipart_threshold: int = DEFAULT_MULTIPART_THRESHOLD,
        multipart_chunksize: int = DEFAULT_MULTIPART_CHUNKSIZE,
        multipart_concurrency: int | None = None,
        retry_backoff_scale: float = 1.0,
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
    ) -> None:
        if max_concurrency < 1:
            raise BucketError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if max_attempts < 1:
            raise BucketError(f"max_attempts must be >= 1, got {max_attempts}")
        if retry_backoff_scale < 0:
            raise BucketError(f"retry_backoff_scale must be >= 0, got {retry_backoff_scale}")
        self.url = url
        self.stats = BucketStats()
        self._bucket = bucket
        self._prefix = prefix.strip("/")
        self._gcs = gcs
        self._max_attempts = max_attempts
        self._backoff_scale = retry_backoff_scale
        self._slots = threading.BoundedSemaphore(max_concurrency)
        self._closed = False
        transfer_threads = multipart_concurrency or min(max_concurrency, 10)

        region: str | None
        if gcs:
            endpoint_url = endpoint_url or os.environ.get("BDN_GCS_ENDPOINT_URL") or GCS_ENDPOINT_URL
            region = GCS_REGION
        else:
            region = credentials.region if credentials else None
        session = self._session(credentials, region)

        config_args: dict[str, Any] = dict(
            region_name=region,
            signature_version="s3v4",
            retries={"mode": "standard", "total_max_attempts": max_attempts},
            max_pool_connections=max_concurrency + transfer_threads,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            tcp_keepalive=True,
            # bdn checks every chunk against the manifest's xxh3-128, and ranged GETs carry no
            # whole-object checksum anyway; a second hash on the hot path buys nothing.
            response_checksum_validation="when_required",
        )
        if gcs:
            config_args["request_checksum_calculation"] = "when_required"
            config_args["s3"] = {"addressing_style": "path"}
        try:
            self._client = session.client("s3", endpoint_url=endpoint_url, config=Config(**config_args))
        except (bex.BotoCoreError, ValueError) as exc:
            raise BucketError(f"cannot open {url}: {one_line(exc)}") from None
        self._install_retry_hook()
        self._transfer = create_transfer_manager(
            self._client,
            TransferConfig(
                multipart_threshold=multipart_threshold,
                multipart_chunksize=multipart_chunksize,
                max_concurrency=transfer_threads,
                use_threads=True,
                # The CRT client would build its own connection with its own credentials and
                # retries; keep every request on the client configured above.
                preferred_transfer_client="classic",
            ),
        )

    # -- setup ---------------------------------------------------------------------------------

    def _session(self, credentials: ReaderCredentials | None, region: str | None) -> boto3.session.Session:
        if credentials is not None:
            return _new_session(
                aws_access_key_id=credentials.access_key_id,
                aws_secret_access_key=credentials.secret_access_key,
                region_name=region,
            )
        session = _new_session(region_name=region)
        if not self._gcs:
            return session
        try:
            found = session.get_credentials()
        except bex.BotoCoreError as exc:
            raise BucketError(f"cannot load credentials for {self.url}: {one_line(exc)}") from None
        if found is None:
            raise BucketError(
                f"no credentials for {self.url}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                "to a GCS HMAC key, or give a credentials file"
            )
        frozen = found.get_frozen_credentials()
        return _new_session(
            aws_access_key_id=frozen.access_key,
            aws_secret_access_key=frozen.secret_key,
            region_name=region,
        )

    def _install_retry_hook(self) -> None:
        """Put a counting, scaling wrapper around botocore's standard retry handler.

        botocore registers its handler under a unique id; we swap it for an identical one that we
        hold (built by botocore's own ``register_retry_handler``) and wrap that. The decision of
        whether and how long to wait stays botocore's.
        """
        events = self._client.meta.events
        event = "needs-retry.s3"
        unique_id = "retry-config-s3"
        events.unregister(event, unique_id=unique_id)
        inner = standard_retries.register_retry_handler(self._client, max_attempts=self._max_attempts)
        events.unregister(event, unique_id=unique_id)
        stats = self.stats
        scale = self._backoff_scale

        def needs_retry(**kwargs: Any) -> float | None:
            delay = inner.needs_retry(**kwargs)
            if delay is None or delay is False:
                return delay
            stats.add(retries=1)
            return delay * scale

        events.register(event, needs_retry, unique_id=unique_id)

    # -- helpers -------------------------------------------------------------------------------

    def _full_key(self, key: str) -> str:
        return f"{self._prefix}/{key}" if self._prefix else key

    @contextmanager
    def _slot(self) -> Iterator[None]:
        if self._closed:
            raise BucketError(f"{self.url} is closed")
        with self._slots:
            yield

    def _map_error(self, op: str, key: str | None, exc: Exception) -> BucketError:
        where = self._where(key) if key is not None else self.url
        if isinstance(exc, bex.ClientError):
            status, code = status_and_code(exc)
            meta = (exc.response or {}).get("ResponseMetadata") or {}
            message = one_line(((exc.response or {}).get("Error") or {}).get("Message") or "")
            what = f"{code or 'HTTP'} ({status})" + (f": {message}" if message else "")
            if code == "NoSuchBucket":
                return BucketError(f"{op} {where}: bucket {self._bucket!r} does not exist")
            if code in _NOT_FOUND_CODES or status == 404:
                return ObjectNotFound(f"object not found: {where}")
            if code in _DENIED_CODES or status == 403:
                return AccessDenied(f"{op} {where}: access denied: {what}")
            if code in _UNAVAILABLE_CODES or status in _UNAVAILABLE_STATUS:
                attempts = int(meta.get("RetryAttempts", 0)) + 1
                return BucketUnavailable(f"{op} {where}: gave up after {attempts} attempts: {what}")
            return BucketError(f"{op} {where}: {what}")
        if isinstance(exc, (bex.ConnectionError, bex.HTTPClientError)):
            return BucketUnavailable(
                f"{op} {where}: gave up after up to {self._max_attempts} attempts: {one_line(exc)}"
            )
        if isinstance(exc, bex.NoCredentialsError):
            return BucketError(f"{op} {where}: no credentials found (AWS standard chain)")
        if isinstance(exc, bex.BotoCoreError):
            return BucketError(f"{op} {where}: {one_line(exc)}")
        return BucketError(f"{op} {where}: {type(exc).__name__}: {one_line(exc)}")

    def _call(self, op: str, key: str | None, fn: Callable[..., _T], **params: Any) -> _T:
        try:
            return fn(Bucket=self._bucket, **params)
        except (bex.BotoCoreError, bex.ClientError) as exc:
            raise self._map_error(op, key, exc) from None

    # -- reads ---------------------------------------------------------------------------------

    def stat(self, key: str) -> ObjectInfo:
        validate_key(key)
        self.stats.add(head_requests=1)
        with self._slot():
            resp = self._call("stat", key, self._client.head_object, Key=self._full_key(key))
        return ObjectInfo(key=key, size=_size(resp, self._where(key)), etag=_etag(resp))

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        validate_prefix(prefix)
        root = f"{self._prefix}/" if self._prefix else ""
        params: dict[str, Any] = {"Prefix": root + prefix}
        found: list[ObjectInfo] = []
        while True:
            self.stats.add(list_requests=1)
            with self._slot():
                page = self._call("list", prefix, self._client.list_objects_v2, **params)
            for item in page.get("Contents") or ():
                full = item.get("Key")
                if not isinstance(full, str) or not full.startswith(root):
                    continue
                key = full[len(root):]
                if key.endswith("/"):
                    continue  # a "directory" marker some consoles create
                try:
                    validate_key(key)
                except PathError as exc:
                    log.warning("skipping object with an unusable key in %s: %s", self.url, exc)
                    continue
                size = item.get("Size")
                if not isinstance(size, int) or size < 0:
                    raise BucketError(f"list {self._where(key)}: bad object size {size!r}")
                found.append(ObjectInfo(key=key, size=size, etag=str(item.get("ETag") or "").strip('"')))
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                break
            params["ContinuationToken"] = token
        found.sort(key=lambda info: info.key)
        return found

    def read(self, key: str, max_size: int = DEFAULT_MAX_READ) -> bytes:
        validate_key(key)
        self.stats.add(get_requests=1)
        with self._slot():
            resp = self._call("read", key, self._client.get_object, Key=self._full_key(key))
            size = _size(resp, self._where(key))
            if size > max_size:
                resp["Body"].close()
                raise BucketError(
                    f"object {self._where(key)} is {size} bytes, over the {max_size}-byte limit"
                )
            buf = bytearray(size)
            self._fill(key, 0, memoryview(buf), first=resp)
        return bytes(buf)

    def read_range_into(
        self, key: str, offset: int, out: memoryview, *, if_match: str | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        view = as_byte_view(out)
        validate_key(key)
        if offset < 0:
            raise BucketError(f"negative offset {offset} for {self._where(key)}")
        if len(view) == 0:
            return
        self.stats.add(get_requests=1)
        with self._slot():
            self._fill(key, offset, view, if_match=_quoted(if_match) if if_match else None, progress=progress)

    def _head(
        self, key: str, etag: str, part: int | None, *, checksums: bool = False
    ) -> tuple[dict[str, Any], dict[str, str]]:
        """HEAD of ``key`` (with ``If-Match: etag``, or of part ``part``): (answer, raw headers).
        ``checksums``: ask for the additional checksums (``ChecksumMode=ENABLED``; S3 only)."""
        params: dict[str, Any] = {"Key": self._full_key(key)}
        if checksums:
            params["ChecksumMode"] = "ENABLED"
        if part is not None:
            # No If-Match here: S3 compares it with the whole object's ETag, but some S3 APIs
            # (moto) with the part's; the caller holds the version with a plain HEAD instead.
            params["PartNumber"] = part
        else:
            params["IfMatch"] = _quoted(etag)
        self.stats.add(head_requests=1)
        with self._slot():
            try:
                resp = self._client.head_object(Bucket=self._bucket, **params)
            except bex.ClientError as exc:
                status, code = status_and_code(exc)
                if status == 412 or code == "PreconditionFailed":
                    raise ObjectChanged(
                        f"object changed while it was read: {self._where(key)} (version {etag!r} is gone)",
                        key,
                    ) from None
                if part is not None and (status == 416 or code in ("InvalidPartNumber", "InvalidRange")):
                    raise ObjectChanged(
                        f"object changed while it was read: {self._where(key)} (it has no part {part} now)",
                        key,
                    ) from None
                raise self._map_error("stat", key, exc) from None
            except bex.BotoCoreError as exc:
                raise self._map_error("stat", key, exc) from None
        return resp, (resp.get("ResponseMetadata") or {}).get("HTTPHeaders") or {}

    def checksum(self, key: str, etag: str, *, exact_parts: bool = False) -> ObjectChecksum:
        """What the bucket vouches for (:func:`bdn.bucket.checksums.object_checksum`: S3's ETag MD5,
        multipart composite and part layout, additional checksum; GCS's ``x-goog-hash``)."""
        validate_key(key)
        where = self._where(key)

        def head(part: int | None, checksums: bool) -> tuple[int, dict[str, str]]:
            resp, headers = self._head(key, etag, part, checksums=checksums)
            return _size(resp, where), headers

        return object_checksum(
            key, etag, head=head, stat=lambda: self.stat(key), gcs=self._gcs, exact_parts=exact_parts, where=where
        )

    def _fill(
        self, key: str, offset: int, view: memoryview, *, first: dict[str, Any] | None = None,
        if_match: str | None = None, progress: Callable[[int], None] | None = None,
    ) -> None:
        """Fill ``view`` from ``offset``, resuming broken bodies (:func:`bdn.bucket.s3_reads.fill`)."""
        full = self._full_key(key)
        fill(
            lambda **params: self._client.get_object(Bucket=self._bucket, Key=full, **params),
            key, offset, view, where=self._where(key), max_attempts=self._max_attempts, stats=self.stats,
            map_error=self._map_error, first=first, if_match=if_match, progress=progress,
        )

    # -- writes --------------------------------------------------------------------------------

    def write(self, key: str, data: bytes | bytearray | memoryview) -> None:
        validate_key(key)
        # botocore takes bytes/bytearray/files, not memoryview; objects written whole are small.
        body = data if isinstance(data, (bytes, bytearray)) else bytes(data)
        self.stats.add(put_requests=1)
        with self._slot():
            self._call("write", key, self._client.put_object, Key=self._full_key(key), Body=body)
        self.stats.add(put_bytes=len(body))

    def write_file(self, key: str, path: str | os.PathLike[str]) -> None:
        validate_key(key)
        name = os.fspath(path)
        try:
            size = os.stat(name).st_size
        except OSError as exc:
            raise BucketError(f"cannot read {name!r}: {exc.strerror or exc}") from None
        if self._closed:
            raise BucketError(f"{self.url} is closed")
        self.stats.add(put_requests=1)
        future = self._transfer.upload(name, self._bucket, self._full_key(key))
        try:
            future.result()
        except (bex.BotoCoreError, bex.ClientError) as exc:
            raise self._map_error("write", key, exc) from None
        except OSError as exc:
            raise BucketError(f"write {self._where(key)} from {name!r}: {exc.strerror or exc}") from None
        except Exception as exc:  # s3transfer wraps some failures in its own types
            raise BucketError(f"write {self._where(key)}: {type(exc).__name__}: {one_line(exc)}") from None
        self.stats.add(put_bytes=size)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._transfer.shutdown()
        self._client.close()


# Parsing botocore's JSON models (the endpoint table, the S3 API, the retry rules) is most of what a
# new boto3 Session costs: 0.6-2 s per bucket opened on a busy 2-core machine, 0.12 s with the
# models already parsed. Every S3Bucket needs a Session of its own (its credentials), so they all
# share one botocore Loader per AWS_DATA_PATH (which says where models are read from); the
# Loader's own caches hold the parsed models. boto3 appends its data directory to the Loader of
# every new Session: the duplicates are dropped again so the list stays as botocore builds it.
_LOADERS: dict[str | None, botocore.loaders.Loader] = {}
_LOADERS_LOCK = threading.Lock()


def _new_session(**kwargs: Any) -> boto3.session.Session:
    """``boto3.session.Session(**kwargs)`` on a botocore session that shares the parsed models."""
    core = botocore.session.Session()
    data_path = core.get_config_variable("data_path")
    with _LOADERS_LOCK:
        loader = _LOADERS.get(data_path)
        if loader is None:
            loader = _LOADERS[data_path] = botocore.loaders.create_loader(data_path)
        core.register_component("data_loader", loader)
        session = boto3.session.Session(botocore_session=core, **kwargs)
        paths = loader.search_paths
        paths[:] = list(dict.fromkeys(paths))
    return session


def _size(resp: dict[str, Any], where: str) -> int:
    size = resp.get("ContentLength")
    if not isinstance(size, int) or size < 0:
        raise BucketError(f"{where}: the bucket sent no usable Content-Length ({size!r})")
    return size


def _etag(resp: dict[str, Any]) -> str:
    return str(resp.get("ETag") or "").strip('"')


def _quoted(etag: str) -> str:
    """An ETag as an HTTP entity-tag (``"..."``), as ``If-Match`` takes it."""
    return etag if etag.startswith('"') else f'"{etag}"'
