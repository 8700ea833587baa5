"""``s3://bucket/prefix`` and ``gs://bucket/prefix`` (GCS's S3-compatible XML API): the reads and writes.

The client is built by :mod:`bdn.bucket.s3_client` (session, botocore's "standard" retries
counted in :class:`BucketStats`, the GCS quirks); botocore's errors become bucket errors in
:mod:`bdn.bucket.s3_errors`. The one retry loop of our own (:mod:`bdn.bucket.s3_reads`) resumes
a GET whose *body* broke mid-stream (botocore only retries until the headers arrive): it re-asks
the missing byte range with ``If-Match`` on the first response's ETag, so a resumed read never
mixes two versions of an object.

Concurrency: every call holds one slot of a ``BoundedSemaphore(max_concurrency)`` for as long as
it uses a connection (for a GET, until the body is drained). ``write_file`` runs its multipart
parts on s3transfer's own pool of ``multipart_concurrency`` threads, which bounds those parts
separately; botocore's connection pool is sized for both so no connection is opened and dropped.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import botocore.exceptions as bex

from bdn.bucket.base import (
    DEFAULT_MAX_READ,
    DEFAULT_MULTIPART_CHUNKSIZE,
    DEFAULT_MULTIPART_THRESHOLD,
    Bucket,
    BucketError,
    BucketStats,
    ObjectChanged,
    ObjectChecksum,
    ObjectInfo,
    as_byte_view,
    one_line,
    validate_key,
    validate_prefix,
)
from bdn.bucket.buffers import BuffersReader
from bdn.bucket.checksums import object_checksum
from bdn.bucket.credentials import ReaderCredentials
from bdn.bucket.s3_client import open_client, open_transfer
from bdn.bucket.s3_errors import map_error, status_and_code
from bdn.bucket.s3_reads import fill
from bdn.proto.errors import PathError

log = logging.getLogger(__name__)


_T = TypeVar("_T")


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
        self._slots = threading.BoundedSemaphore(max_concurrency)
        self._closed = False
        transfer_threads = multipart_concurrency or min(max_concurrency, 10)

        self._client = open_client(
            url,
            gcs=gcs,
            credentials=credentials,
            endpoint_url=endpoint_url,
            max_connections=max_concurrency + transfer_threads,
            max_attempts=max_attempts,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            stats=self.stats,
            retry_backoff_scale=retry_backoff_scale,
        )
        self._transfer = open_transfer(
            self._client,
            multipart_threshold=multipart_threshold,
            multipart_chunksize=multipart_chunksize,
            threads=transfer_threads,
        )

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
        return map_error(op, where, exc, bucket=self._bucket, max_attempts=self._max_attempts)

    def _call(self, op: str, key: str | None, fn: Callable[..., _T], **params: Any) -> _T:
        try:
            return fn(Bucket=self._bucket, **params)
        except (bex.BotoCoreError, bex.ClientError) as exc:
            raise self._map_error(op, key, exc) from None

    # -- reads ---------------------------------------------------------------------------------

    def stat(self, key: str) -> ObjectInfo:
        """HEAD of the object: ``Content-Length`` in bytes and the ETag (quotes stripped). Raises
        :class:`ObjectNotFound`, :class:`AccessDenied`, :class:`BucketUnavailable` (retries used up)."""
        validate_key(key)
        self.stats.add(head_requests=1)
        with self._slot():
            resp = self._call("stat", key, self._client.head_object, Key=self._full_key(key))
        return ObjectInfo(key=key, size=_size(resp, self._where(key)), etag=_etag(resp))

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """ListObjectsV2 under the bucket's prefix, every page (``ContinuationToken``), sorted by
        key. Directory markers and keys that break the key rules are skipped (the latter with a
        warning); an item without a usable ``Size`` raises :class:`BucketError`."""
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
                key = full[len(root) :]
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

    def has_objects(self) -> bool:
        """One ListObjectsV2 of at most one key under the prefix (directory markers count)."""
        root = f"{self._prefix}/" if self._prefix else ""
        self.stats.add(list_requests=1)
        with self._slot():
            page = self._call("list", "", self._client.list_objects_v2, Prefix=root, MaxKeys=1)
        return bool(page.get("Contents") or page.get("KeyCount"))

    def read(self, key: str, max_size: int = DEFAULT_MAX_READ) -> bytes:
        """One GET of the whole object, its body read into one buffer (resumed with ``If-Match``
        if it breaks). Raises :class:`BucketError` before reading the body when
        ``Content-Length`` is over ``max_size`` bytes, and the errors of :meth:`stat`."""
        validate_key(key)
        self.stats.add(get_requests=1)
        with self._slot():
            resp = self._call("read", key, self._client.get_object, Key=self._full_key(key))
            size = _size(resp, self._where(key))
            if size > max_size:
                resp["Body"].close()
                raise BucketError(f"object {self._where(key)} is {size} bytes, over the {max_size}-byte limit")
            buf = bytearray(size)
            self._fill(key, 0, memoryview(buf), first=resp)
        return bytes(buf)

    def read_range_into(
        self,
        key: str,
        offset: int,
        out: memoryview,
        *,
        if_match: str | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        """Ranged GETs (``Range: bytes=offset-end``, ``If-Match`` with ``if_match``) ``recv_into``
        ``out``, resumed from the byte where a body broke (:func:`bdn.bucket.s3_reads.fill`).
        Raises :class:`ObjectChanged` when ``If-Match`` fails, :class:`BucketError` for a short
        object or a negative offset, :class:`BucketUnavailable` when the attempts are used up."""
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
        self,
        key: str,
        offset: int,
        view: memoryview,
        *,
        first: dict[str, Any] | None = None,
        if_match: str | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        """Fill ``view`` from ``offset``, resuming broken bodies (:func:`bdn.bucket.s3_reads.fill`)."""
        full = self._full_key(key)
        fill(
            lambda **params: self._client.get_object(Bucket=self._bucket, Key=full, **params),
            key,
            offset,
            view,
            where=self._where(key),
            max_attempts=self._max_attempts,
            stats=self.stats,
            map_error=self._map_error,
            first=first,
            if_match=if_match,
            progress=progress,
        )

    # -- writes --------------------------------------------------------------------------------

    def write(self, key: str, data: bytes | bytearray | memoryview) -> None:
        """One PutObject of ``data`` (S3 replaces the object atomically). Raises the mapped
        errors of :mod:`bdn.bucket.s3_errors`."""
        validate_key(key)
        # botocore takes bytes/bytearray/files, not memoryview; objects written whole are small.
        body = data if isinstance(data, (bytes, bytearray)) else bytes(data)
        self.stats.add(put_requests=1)
        with self._slot():
            self._call("write", key, self._client.put_object, Key=self._full_key(key), Body=body)
        self.stats.add(put_bytes=len(body))

    def write_new(self, key: str, data: bytes | bytearray | memoryview) -> bool:
        """One PutObject with ``If-None-Match: *``: False when S3 answers 412 (the key exists).
        Raises the mapped errors of :mod:`bdn.bucket.s3_errors`; a store that does not implement
        conditional writes (501 NotImplemented) raises :class:`BucketError` saying so."""
        validate_key(key)
        body = data if isinstance(data, (bytes, bytearray)) else bytes(data)
        self.stats.add(put_requests=1)
        with self._slot():
            try:
                self._client.put_object(Bucket=self._bucket, Key=self._full_key(key), Body=body, IfNoneMatch="*")
            except bex.ClientError as exc:
                status, code = status_and_code(exc)
                if status == 412 or code in ("PreconditionFailed", "ConditionalRequestConflict"):
                    return False
                if status == 501 or code == "NotImplemented":
                    raise BucketError(
                        f"{self._where(key)}: the store does not implement conditional writes "
                        "(If-None-Match: *), which a commit needs to refuse a concurrent one"
                    ) from None
                raise self._map_error("write", key, exc) from None
            except bex.BotoCoreError as exc:
                raise self._map_error("write", key, exc) from None
        self.stats.add(put_bytes=len(body))
        return True

    def write_file(self, key: str, path: str | os.PathLike[str]) -> None:
        """Upload the local file at ``path`` through s3transfer: one PutObject under
        ``multipart_threshold`` bytes, else a multipart upload of ``multipart_chunksize`` parts on
        its own threads. Raises :class:`BucketError` when ``path`` cannot be read or the bucket
        is closed, and the mapped errors of :mod:`bdn.bucket.s3_errors`."""
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

    def write_buffers(self, key: str, buffers: Sequence[Any]) -> None:
        """Upload the concatenation of ``buffers`` through s3transfer, as :meth:`write_file`
        uploads a file (one PutObject under ``multipart_threshold``, else parallel parts),
        reading each part straight from the buffers. Raises the mapped bucket errors."""
        validate_key(key)
        if self._closed:
            raise BucketError(f"{self.url} is closed")
        reader = BuffersReader(buffers)
        self.stats.add(put_requests=1)
        future = self._transfer.upload(reader, self._bucket, self._full_key(key))
        try:
            future.result()
        except (bex.BotoCoreError, bex.ClientError) as exc:
            raise self._map_error("write", key, exc) from None
        except Exception as exc:  # s3transfer wraps some failures in its own types
            raise BucketError(f"write {self._where(key)}: {type(exc).__name__}: {one_line(exc)}") from None
        self.stats.add(put_bytes=reader.size)

    def close(self) -> None:
        """Shut the transfer manager down (waiting for uploads in flight), then close the
        client's connections. Idempotent; every later call raises :class:`BucketError`."""
        if self._closed:
            return
        self._closed = True
        self._transfer.shutdown()
        self._client.close()


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
