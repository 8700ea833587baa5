"""The daemon's retry loops, each a use of ``bdn.retry`` (the one retry/backoff of bdn)."""

from __future__ import annotations

import tenacity

from bdn import retry

BUCKET_BYTES_TRIES = 3


class BadBytes(Exception):
    """Bytes that did not match their digest: worth another read."""


def bucket_bytes() -> tenacity.AsyncRetrying:
    """A chunk read from the bucket whose bytes do not match: up to 3 reads, short jittered waits."""
    return retry.attempts_async(tries=BUCKET_BYTES_TRIES, first_s=0.05, max_s=0.5, on=(BadBytes,))
