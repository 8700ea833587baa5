"""The bucket interface: one small sync API over the origin object store, and its errors.

Kraken's ``lib/backend`` is the model: every backend (``file://``, ``s3://``, ``gs://``) implements
the same few calls and maps its own failures onto the few errors below, so the daemon never sees a
botocore or ``OSError`` type. Keys are always relative to the bucket root URL and ``/``-separated;
they are validated with :func:`validate_key` before any backend touches them.
"""

from __future__ import annotations

import abc
import dataclasses
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from bdn.proto.errors import BdnError, PathError

#: Bytes from which an S3/GCS upload goes multipart, and its part size (``bdn.bucket.s3.S3Bucket``;
#: here so that ``open_bucket``'s signature needs no boto3 import).
DEFAULT_MULTIPART_THRESHOLD = 64 << 20
DEFAULT_MULTIPART_CHUNKSIZE = 16 << 20

#: S3 limits a key to 1024 bytes of UTF-8; we hold ``file://`` to the same rule so keys that work
#: in one backend work in all of them.
MAX_KEY_BYTES = 1024

#: Default cap of :meth:`Bucket.read` (bytes): manifests and ``STARTUP_SNAPSHOT`` are far smaller.
DEFAULT_MAX_READ = 64 << 20


@dataclass(frozen=True)
class ObjectInfo:
    """One stored object.

    ``key``: relative to the bucket root, ``/``-separated (``"step000001/model.safetensors"``).
    ``size``: bytes. ``etag``: the object's **version token**, opaque; a new write gives a new
    token, and :meth:`Bucket.read_range_into` can be made conditional on it (``if_match``).
    S3: the ETag without quotes (the MD5 of the object for a single-part upload, the MD5 of the
    parts' MD5s plus ``-N`` for a multipart one; neither for SSE-KMS/SSE-C objects). GCS (its S3
    API): its ETag, which changes with every generation. ``file://``:
    ``"<size hex>-<mtime_ns hex>-<inode hex>"`` (see :mod:`bdn.bucket.file`).
    """

    key: str
    size: int
    etag: str


#: Largest piece read between two ``progress`` calls of ``read_range_into`` (bytes).
PROGRESS_BYTES = 128 << 10


class BucketError(BdnError):
    """A bucket operation failed; the message is one line naming the URL and what went wrong."""


class ObjectNotFound(BucketError):
    """The object does not exist. Message: ``object not found: <url>/<key>``."""


class ObjectChanged(BucketError):
    """A conditional read found the object replaced since its version token was taken.

    ``key``: the object's key. Message: ``object changed while it was read: <url>/<key> (...)``.
    Retrying the same read cannot help: the caller must take a new listing (and a new table).
    """

    def __init__(self, message: str, key: str) -> None:
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class SdkChecksum:
    """An S3 additional checksum (``x-amz-checksum-<algorithm>``): ``algorithm`` one of
    ``crc32``, ``crc32c``, ``sha1``, ``sha256``; ``digest`` its raw bytes (CRCs big-endian);
    ``composite``: the checksum of the parts' concatenated binary checksums (multipart
    ``COMPOSITE``), else of the whole object. ``typed``: the bucket said which
    (``x-amz-checksum-type`` or a ``-N`` suffix); an untyped multipart checksum is taken as
    composite (S3's default) and, if that does not match, also tried as a full-object one, so a
    store that leaves the type out never gets a good object called bad."""

    algorithm: str
    digest: bytes
    composite: bool = False
    typed: bool = True


@dataclass(frozen=True)
class ObjectChecksum:
    """What the bucket itself says about an object's content (for verifying assembled copies).

    ``key``/``etag``/``size``: the object and the version token these values belong to.
    ``md5``: 32 lowercase hex, the MD5 of the whole object, when the bucket vouches for one
    (S3 single-part without SSE-KMS/SSE-C, GCS ``x-goog-hash: md5=``), else ``None``.
    ``parts``/``part_size``: an S3 multipart object's part count (the ETag's ``-N``) and the
    size in bytes of its first part (``HeadObject`` with ``PartNumber=1``); every part but the
    last has that size when the uploader used one part size (s3transfer, the AWS CLI, boto3 do).
    ``part_sizes``: every part's size, when the first and last parts show that they differ.
    ``composite_md5``: the ETag's hex digest of the parts' binary MD5s. ``crc32c``: GCS's
    CRC-32C of the object (``x-goog-hash``), or ``None``. ``sdk_checksum``: S3's additional
    checksum, when the uploader sent one (current AWS SDKs do). An object with none of these
    (``file://``; SSE-KMS uploaded without an additional checksum) has no bucket checksum
    (docs/TRUST.md says what is trusted then).
    """

    key: str
    etag: str
    size: int
    md5: str | None = None
    parts: int | None = None
    part_size: int | None = None
    composite_md5: str | None = None
    part_sizes: tuple[int, ...] | None = None
    crc32c: int | None = None
    sdk_checksum: SdkChecksum | None = None

    @property
    def verifiable(self) -> bool:
        """True when the bucket vouches for the bytes with at least one checksum (MD5, composite MD5, CRC32C or an SDK checksum)."""
        return any(v is not None for v in (self.md5, self.composite_md5, self.crc32c, self.sdk_checksum))


class AccessDenied(BucketError):
    """The bucket refused the credentials (HTTP 403, bad key id, bad signature)."""


class BucketUnavailable(BucketError):
    """The bucket could not be reached or kept failing after every retry; names the last error."""


@dataclass
class BucketStats:
    """Counters of bucket traffic, safe to bump from many threads.

    ``get_requests``/``get_bytes``: GET calls (whole and ranged reads) and body bytes received.
    ``head_requests``: ``stat`` calls. ``put_requests``/``put_bytes``: objects written (one per
    ``write``/``write_file``, however many multipart parts it took) and their bytes.
    ``list_requests``: listing pages. ``retries``: attempts repeated after a retryable failure
    (botocore's retries plus resumed GET bodies), so ``requests + retries`` is what the bucket saw.
    Counts are per logical request, not per HTTP attempt.
    """

    get_requests: int = 0
    get_bytes: int = 0
    head_requests: int = 0
    put_requests: int = 0
    put_bytes: int = 0
    list_requests: int = 0
    retries: int = 0
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: int) -> None:
        """Add each ``name=delta`` to its counter atomically."""
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def snapshot(self) -> dict[str, int]:
        """A consistent copy of every counter: ``{name: value}``."""
        with self._lock:
            return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.name.startswith("_")}


def one_line(text: object, limit: int = 200) -> str:
    """Untrusted server text squeezed into one bounded line."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _show(text: str, limit: int = 120) -> str:
    """A one-line, bounded rendering of untrusted text for error messages."""
    shown = repr(text)
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


def validate_key(key: object) -> str:
    """Check an object key and return it.

    A key is a non-empty ``str`` of ``/``-separated segments: no leading or trailing ``/``, no
    empty, ``.`` or ``..`` segment, no backslash, no NUL or other control character, at most
    :data:`MAX_KEY_BYTES` of UTF-8. Raises :class:`bdn.proto.errors.PathError` otherwise.
    """
    if not isinstance(key, str):
        raise PathError(f"bucket key must be a str, got {type(key).__name__}")
    _check_segments(key, what="bucket key", allow_trailing_slash=False)
    return key


def validate_prefix(prefix: object) -> str:
    """Check a listing prefix and return it: ``""``, or a key that may end with ``/``.

    The last segment may be partial (``"step00"`` matches ``"step000001/..."``); the same rules as
    :func:`validate_key` apply otherwise. Raises :class:`bdn.proto.errors.PathError`.
    """
    if not isinstance(prefix, str):
        raise PathError(f"bucket prefix must be a str, got {type(prefix).__name__}")
    if prefix == "":
        return prefix
    _check_segments(prefix, what="bucket prefix", allow_trailing_slash=True)
    return prefix


def _check_segments(text: str, *, what: str, allow_trailing_slash: bool) -> None:
    if text == "":
        raise PathError(f"{what} is empty")
    if len(text.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:
        raise PathError(f"{what} is longer than {MAX_KEY_BYTES} bytes: {_show(text)}")
    if "\\" in text:
        raise PathError(f"{what} contains a backslash: {_show(text)}")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in text):
        raise PathError(f"{what} contains NUL or a control character: {_show(text)}")
    if text.startswith("/"):
        raise PathError(f"{what} starts with '/': {_show(text)}")
    body = text[:-1] if allow_trailing_slash and text.endswith("/") else text
    for segment in body.split("/"):
        if segment in ("", ".", ".."):
            raise PathError(f"{what} has an empty, '.' or '..' segment: {_show(text)}")


class Bucket(abc.ABC):
    """The origin object store behind one small synchronous, thread-safe interface.

    ``url`` is the root URL as given (``"s3://b/prefix"``, ``"file:///tmp/x"``); every key is
    relative to it. The daemon calls these methods from a thread pool, so implementations keep no
    per-call state on ``self`` and bound their own concurrency. Every method raises only
    :class:`BucketError` subclasses (and :class:`~bdn.proto.errors.PathError` for a bad key).
    """

    url: str
    stats: BucketStats

    @abc.abstractmethod
    def stat(self, key: str) -> ObjectInfo:
        """Size and etag of one object. Raises :class:`ObjectNotFound`."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every object whose key starts with ``prefix`` (recursive), sorted by key.

        ``prefix`` is a plain string prefix as in S3 (``"step000001/"`` lists that directory).
        Directory markers (keys ending in ``/``) and keys that break the key rules are skipped.
        """

    def has_objects(self) -> bool:
        """Whether any object lies under the bucket's URL (a readiness probe: an empty prefix is
        usually a mistyped one). This default lists everything; backends ask for one key."""
        return bool(self.list(""))

    @abc.abstractmethod
    def read(self, key: str, max_size: int = DEFAULT_MAX_READ) -> bytes:
        """The whole object (manifests, ``STARTUP_SNAPSHOT``).

        Raises :class:`BucketError` if it is larger than ``max_size`` bytes (read nothing then).
        """

    @abc.abstractmethod
    def read_range_into(
        self,
        key: str,
        offset: int,
        out: memoryview,
        *,
        if_match: str | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        """Fill all of ``out`` (a writable contiguous buffer) with the bytes at ``offset``.

        ``progress(n)``, when given, is called on the reading thread each time the first ``n``
        bytes of ``out`` are in place (n grows; pieces of at most ``PROGRESS_BYTES``): the
        daemon forwards a chunk's bytes while they land (cut-through, bdn.transfer.growing).

        Bytes land directly in ``out`` where the backend allows it. Raises :class:`BucketError`
        if the object ends before ``offset + len(out)`` (``out`` is then partly written).
        ``if_match``: a version token (:attr:`ObjectInfo.etag`); the read then returns bytes of
        that version only and raises :class:`ObjectChanged` if the object was replaced (S3/GCS:
        ``If-Match`` on every request; ``file://``: the token is re-checked before and after).
        Without it, a read resumed after a broken body is still held to the first answer's ETag.
        """

    def checksum(self, key: str, etag: str, *, exact_parts: bool = False) -> ObjectChecksum:
        """What the bucket vouches for about version ``etag`` of ``key`` (see :class:`ObjectChecksum`).

        ``exact_parts``: for a multipart object, ask every part for its size (``part_sizes``)
        instead of inferring the layout from the first and last parts.

        The base implementation (``file://``) vouches for nothing. Raises :class:`ObjectNotFound`,
        :class:`ObjectChanged` when the object's token is no longer ``etag``.
        """
        info = self.stat(key)
        if info.etag != etag:
            raise ObjectChanged(
                f"object changed while it was read: {self._where(key)} (version {etag!r} is gone)",
                key,
            )
        return ObjectChecksum(key=key, etag=etag, size=info.size)

    @abc.abstractmethod
    def write(self, key: str, data: bytes | bytearray | memoryview) -> None:
        """Store ``data`` as the object; readers see the old object or the new one, never half."""

    @abc.abstractmethod
    def write_new(self, key: str, data: bytes | bytearray | memoryview) -> bool:
        """Store ``data`` as the object only if no object ``key`` exists, atomically: of two
        writers racing, exactly one gets True. Returns False (and writes nothing) when the key
        exists. ``file://``: a hard link of the written temporary file (``link(2)`` fails with
        EEXIST); S3: ``PutObject`` with ``If-None-Match: *`` (HTTP 412 when the key exists, S3
        user guide "Conditional writes"). Raises as :meth:`write` does."""

    @abc.abstractmethod
    def write_file(self, key: str, path: str | os.PathLike[str]) -> None:
        """Store the local file at ``path`` as the object (multipart and parallel where large)."""

    def write_buffers(self, key: str, buffers: Sequence[Any]) -> None:
        """Store the concatenation of ``buffers`` (bytes-like objects) as the object, as
        :meth:`write` does; backends send the buffers without joining them (multipart and
        parallel where large). This default joins them and calls :meth:`write`."""
        self.write(key, b"".join(memoryview(b).cast("B") for b in buffers))

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections and threads. Idempotent."""

    def __enter__(self) -> Bucket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def _where(self, key: str) -> str:
        """``<url>/<key>`` for messages."""
        return f"{self.url.rstrip('/')}/{key}"


def as_byte_view(out: memoryview | bytearray) -> memoryview:
    """``out`` as a writable, contiguous, 1-byte-item memoryview, or :class:`BucketError`."""
    view = memoryview(out)
    if view.readonly:
        raise BucketError("read_range_into needs a writable buffer")
    if not view.c_contiguous:
        raise BucketError("read_range_into needs a contiguous buffer")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view
