"""The boto3 client behind :class:`bdn.bucket.s3.S3Bucket`: session, configuration, retries.

:func:`open_client` builds one botocore S3 client for ``s3://`` or ``gs://`` (GCS's S3-compatible
XML API) and :func:`open_transfer` the s3transfer manager that runs ``write_file``'s multipart
parts on it. What is decided here, once per bucket opened:

- Retries are botocore's own "standard" mode (jittered exponential backoff on throttling codes
  such as ``SlowDown``, on 429, on 500/502/503/504 and on connection errors, with the SDKs'
  shared retry quota) rather than a loop of ours: it is what every AWS SDK does and is well
  kept. Its ``needs-retry`` handler is wrapped only to count retries in
  :class:`bdn.bucket.base.BucketStats` and, for tests, to scale its delays.
- botocore's connection pool is sized for the bucket's request slots plus the transfer
  manager's threads, so no connection is opened and dropped.
- GCS quirks (``gs://``): botocore >= 1.36 by default sends ``x-amz-checksum-crc32`` with an
  ``aws-chunked`` trailer body on PUT/UploadPart and asks for checksums on GET; GCS's XML API
  does not implement the flexible checksums and rejects or mis-stores such bodies, so both are
  "when_required" there. SigV4 is signed for region ``us-east-1`` and path-style addressing is
  used. An AWS session token must not be sent (GCS rejects ``x-amz-security-token``):
  credentials from the standard chain are reduced to the HMAC key id and secret.

Errors: :class:`bdn.bucket.base.BucketError` (one line) for a client that cannot be built (no
or unloadable credentials for GCS, a bad endpoint).
"""

from __future__ import annotations

import os
import threading
from typing import Any

import boto3
import botocore.exceptions as bex
import botocore.loaders
import botocore.session
from boto3.s3.transfer import TransferConfig, create_transfer_manager
from botocore.config import Config
from botocore.retries import standard as standard_retries

from bdn.bucket.base import BucketError, BucketStats, one_line
from bdn.bucket.credentials import ReaderCredentials

GCS_ENDPOINT_URL = "https://storage.googleapis.com"
GCS_REGION = "us-east-1"


def open_client(
    url: str,
    *,
    gcs: bool,
    credentials: ReaderCredentials | None,
    endpoint_url: str | None,
    max_connections: int,
    max_attempts: int,
    connect_timeout: float,
    read_timeout: float,
    stats: BucketStats,
    retry_backoff_scale: float,
) -> Any:
    """A botocore S3 client for the bucket at ``url`` (named in messages only).

    ``gcs``: the GCS endpoint (``endpoint_url``, else ``$BDN_GCS_ENDPOINT_URL``, else
    :data:`GCS_ENDPOINT_URL`), region and quirks (module doc). ``credentials``: static keys, or
    None for the standard chain. ``max_connections``: botocore's pool size. ``max_attempts``:
    total attempts per request, first one included. Timeouts in seconds.
    ``retry_backoff_scale`` multiplies botocore's backoff delays; every retry adds 1 to
    ``stats.retries``. Raises :class:`BucketError`.
    """
    region: str | None
    if gcs:
        endpoint_url = endpoint_url or os.environ.get("BDN_GCS_ENDPOINT_URL") or GCS_ENDPOINT_URL
        region = GCS_REGION
    else:
        region = credentials.region if credentials else None
    session = _session(url, gcs, credentials, region)
    config_args: dict[str, Any] = dict(
        region_name=region,
        signature_version="s3v4",
        retries={"mode": "standard", "total_max_attempts": max_attempts},
        max_pool_connections=max_connections,
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
        client = session.client("s3", endpoint_url=endpoint_url, config=Config(**config_args))
    except (bex.BotoCoreError, ValueError) as exc:
        raise BucketError(f"cannot open {url}: {one_line(exc)}") from None
    _install_retry_hook(client, max_attempts, stats, retry_backoff_scale)
    if gcs:
        client.meta.events.register("before-sign.s3.PutObject", _gcs_create_only)
    return client


def _gcs_create_only(request: Any, **_: Any) -> None:
    """GCS's XML API spells "create only if absent" on an upload as ``x-goog-if-generation-match: 0``
    (GCS docs, "Request preconditions"); its ``If-None-Match`` applies to reads. The S3 header is
    kept for S3-compatible fakes. Not run against real GCS here."""
    if request.headers.get("If-None-Match") == "*":
        request.headers["x-goog-if-generation-match"] = "0"


def open_transfer(client: Any, *, multipart_threshold: int, multipart_chunksize: int, threads: int) -> Any:
    """s3transfer's manager over ``client``: uploads switch to multipart at ``multipart_threshold``
    bytes, in parts of ``multipart_chunksize`` bytes (S3 needs >= 5 MiB; s3transfer enforces it),
    on a pool of ``threads`` threads of its own. Call its ``shutdown()`` before closing ``client``."""
    return create_transfer_manager(
        client,
        TransferConfig(
            multipart_threshold=multipart_threshold,
            multipart_chunksize=multipart_chunksize,
            max_concurrency=threads,
            use_threads=True,
            # The CRT client would build its own connection with its own credentials and
            # retries; keep every request on the client configured above.
            preferred_transfer_client="classic",
        ),
    )


def _session(url: str, gcs: bool, credentials: ReaderCredentials | None, region: str | None) -> boto3.session.Session:
    if credentials is not None:
        return _new_session(
            aws_access_key_id=credentials.access_key_id,
            aws_secret_access_key=credentials.secret_access_key,
            region_name=region,
        )
    session = _new_session(region_name=region)
    if not gcs:
        return session
    try:
        found = session.get_credentials()
    except bex.BotoCoreError as exc:
        raise BucketError(f"cannot load credentials for {url}: {one_line(exc)}") from None
    if found is None:
        raise BucketError(
            f"no credentials for {url}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
            "to a GCS HMAC key, or give a credentials file"
        )
    frozen = found.get_frozen_credentials()
    return _new_session(
        aws_access_key_id=frozen.access_key,
        aws_secret_access_key=frozen.secret_key,
        region_name=region,
    )


def _install_retry_hook(client: Any, max_attempts: int, stats: BucketStats, scale: float) -> None:
    """Put a counting, scaling wrapper around botocore's standard retry handler.

    botocore registers its handler under a unique id; we swap it for an identical one that we
    hold (built by botocore's own ``register_retry_handler``) and wrap that. The decision of
    whether and how long to wait stays botocore's.
    """
    events = client.meta.events
    event = "needs-retry.s3"
    unique_id = "retry-config-s3"
    events.unregister(event, unique_id=unique_id)
    inner = standard_retries.register_retry_handler(client, max_attempts=max_attempts)
    events.unregister(event, unique_id=unique_id)

    def needs_retry(**kwargs: Any) -> float | None:
        delay = inner.needs_retry(**kwargs)
        if delay is None or delay is False:
            return delay
        stats.add(retries=1)
        return delay * scale

    events.register(event, needs_retry, unique_id=unique_id)


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
