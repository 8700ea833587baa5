"""Ranged GETs of an S3 API object into a caller's buffer, resuming bodies that break off.

botocore retries a request only until its headers arrive; a body that breaks mid-stream, or a
206 that is well-formed but shorter than the range asked, is this module's to handle. It
re-asks the missing byte range with ``If-Match`` on the first answer's ETag (RFC 9110 §13.1.1),
so a resumed read never mixes two versions of an object, and it reads each body with
``recv_into`` straight into the caller's memory (no temporary ``bytes`` per part).

Used by :class:`bdn.bucket.s3.S3Bucket`; no state of its own.
"""

from __future__ import annotations

import functools
import http.client
import logging
import re
from collections.abc import Callable
from typing import Any

import botocore.exceptions as bex

from bdn.bucket.base import PROGRESS_BYTES, BucketError, BucketStats, BucketUnavailable, ObjectChanged, one_line
from bdn.bucket.s3_errors import status_and_code

log = logging.getLogger("bdn.bucket.s3")

# A GET body broke after the headers came: the connection reset, timed out or closed early.
_STREAM_ERRORS = (OSError, http.client.HTTPException, bex.HTTPClientError, bex.IncompleteReadError)

#: Piece size for bodies read through ``readinto`` of a library that copies through a temp buffer.
_FALLBACK_CHUNK = 1 << 20

_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


def fill(
    get: Callable[..., dict[str, Any]],
    key: str,
    offset: int,
    view: memoryview,
    *,
    where: str,
    max_attempts: int,
    stats: BucketStats,
    map_error: Callable[[str, str, Exception], BucketError],
    first: dict[str, Any] | None = None,
    if_match: str | None = None,
    progress: Callable[[int], None] | None = None,
) -> None:
    """Fill ``view`` with the object's bytes from ``offset``, resuming broken bodies.

    ``get(**params)`` is ``get_object`` bound to the bucket and the object's full key, called
    with ``Range`` (and ``IfMatch``); it returns botocore's answer dict or raises botocore's
    errors. ``first`` is an already-open GET answer whose body starts at ``offset``.
    ``if_match``: a quoted ETag every request must match; without it the first answer's ETag is
    used. ``where`` names the object in messages; ``map_error(op, key, exc)`` turns other botocore
    errors into :class:`BucketError`; ``stats`` counts ``get_bytes`` and ``retries``.
    ``progress(n)``: called each time the first ``n`` bytes of ``view`` are in place.

    Two kinds of broken answer are retried from the byte where they stopped, up to
    ``max_attempts`` in all: a body that breaks off (the connection dies), and a 206 that is
    well-formed but shorter than the range asked although its ``Content-Range`` says the object
    goes on (a proxy or gateway cutting answers short). Only a ``Content-Range`` whose end is the
    object's end means the object really ends there.

    Raises :class:`BucketError` (short object, bad answer), :class:`ObjectChanged` (``If-Match``
    failed) or :class:`BucketUnavailable` (attempts used up).
    """
    total = len(view)
    done = 0
    breaks = 0
    shorts = 0
    etag: str | None = if_match
    resp = first
    try:
        while done < total:
            if resp is None:
                params: dict[str, Any] = {"Range": f"bytes={offset + done}-{offset + total - 1}"}
                if etag:
                    params["IfMatch"] = etag
                try:
                    resp = get(**params)
                except bex.ClientError as exc:
                    status, code = status_and_code(exc)
                    if code == "InvalidRange" or status == 416:
                        raise BucketError(
                            f"short read of {where}: wanted {total} bytes at offset {offset},"
                            f" the object ends before offset {offset + done}"
                        ) from None
                    if etag and (code == "PreconditionFailed" or status == 412):
                        raise ObjectChanged(
                            f"object changed while it was read: {where} (ETag {etag} no longer matches)",
                            key,
                        ) from None
                    raise map_error("read", key, exc) from None
                except bex.BotoCoreError as exc:
                    raise map_error("read", key, exc) from None
            etag = etag or resp.get("ETag")
            body = resp["Body"]
            answered = resp.get("ContentLength")
            content_range = resp.get("ContentRange")
            if not isinstance(answered, int) or answered > total - done:
                body.close()
                raise BucketError(
                    f"read {where}: the bucket answered {answered!r} bytes for a request of {total - done}"
                )
            resp = None
            got, broken = _stream_into(
                body,
                view[done : done + answered],
                None if progress is None else functools.partial(_progress_from, progress, done),
            )
            done += got
            stats.add(get_bytes=got)
            if broken is not None:
                breaks += 1
                if breaks + shorts >= max_attempts:
                    raise BucketUnavailable(
                        f"read {where}: the body broke off {breaks} times; last: {one_line(broken)}"
                    )
                stats.add(retries=1)
                log.debug("resuming %s at byte %d after: %s", where, offset + done, broken)
                continue
            if done < total:
                object_size = _range_total(content_range)
                if object_size is not None and object_size <= offset + done:
                    raise BucketError(
                        f"short read of {where}: wanted {total} bytes at offset {offset}, the"
                        f" object ends after {done} (it is {object_size} bytes)"
                    )
                shorts += 1
                if breaks + shorts >= max_attempts:
                    goes_on = (
                        "although the object goes on"
                        if object_size is not None
                        else ("without saying that the object ends there")
                    )
                    raise BucketUnavailable(
                        f"read {where}: the bucket answered {shorts} times with fewer bytes than"
                        f" asked {goes_on} (last: {answered} bytes,"
                        f" Content-Range {one_line(content_range, 80)!r}, for"
                        f" {answered + total - done} asked)"
                    )
                stats.add(retries=1)
                log.debug("re-asking %s from byte %d after a short answer (%s)", where, offset + done, content_range)
    finally:
        if resp is not None:
            resp["Body"].close()


def _range_total(content_range: object) -> int | None:
    """The object size in a ``Content-Range: bytes a-b/T`` answer, or None if absent or ``*``."""
    if not isinstance(content_range, str):
        return None
    m = _CONTENT_RANGE.fullmatch(content_range.strip())
    if m is None or m.group(3) == "*":
        return None
    return int(m.group(3))


def _stream_into(
    body: Any,
    view: memoryview,
    progress: Callable[[int], None] | None = None,
) -> tuple[int, BaseException | None]:
    """Read exactly ``len(view)`` body bytes into ``view``; return (bytes read, error or None).

    When the body is botocore's plain ``StreamingBody`` over urllib3 over ``http.client``, read
    with ``http.client.HTTPResponse.readinto``, which ``recv_into``s the socket straight into
    ``view``: urllib3's own ``readinto`` reads into a temporary ``bytes`` and copies it, and at
    line rate that allocation and copy per chunk is what we are avoiding. Any other body (a
    checksum wrapper, another HTTP stack) falls back to ``body.readinto``. With ``progress``
    the body is read in pieces of ``PROGRESS_BYTES`` (a buffered ``readinto`` returns only once
    its whole view is full), each reported as it lands.
    """
    raw: Any = getattr(body, "_raw_stream", None)  # urllib3's response when ``direct``
    fp: Any = getattr(raw, "_fp", None)
    direct = type(body).__name__ == "StreamingBody" and isinstance(fp, http.client.HTTPResponse)
    got = 0
    step = PROGRESS_BYTES if progress is not None else len(view)
    try:
        while got < len(view):
            if direct:
                n = fp.readinto(view[got : got + step])
            else:
                n = body.readinto(view[got : got + min(step, _FALLBACK_CHUNK)])
            if not n:
                raise http.client.IncompleteRead(b"", len(view) - got)
            got += n
            if progress is not None:
                progress(got)
    except _STREAM_ERRORS as exc:
        body.close()
        return got, exc
    if direct:
        # The response is fully read, so the connection is clean: give it back to the pool
        # (closing the body would drop it instead).
        raw.release_conn()
    else:
        body.close()
    return got, None


def _progress_from(progress: Callable[[int], None], base: int, n: int) -> None:
    """``progress`` of a read resumed at byte ``base``: its first ``n`` bytes are ``base + n``."""
    progress(base + n)
