"""The daemon's retry loops, each a use of ``bdn.retry`` (the one retry/backoff of bdn)."""

from __future__ import annotations

import tenacity

from bdn import retry

BUCKET_BYTES_TRIES = 3


class BadBytes(Exception):
    """Bytes that did not match their digest: worth another read."""


class Transient(Exception):
    """A chunk's bucket read that failed in a way the next read may not (``BucketUnavailable``:
    still failing after the client's own retries, or a redirect bdn does not follow): worth
    another read before the snapshot fails (tests/test_adversarial_bucket.py: one 307 on one
    chunk failed a whole snapshot whenever it fell on a chunk read)."""


def bucket_bytes() -> tenacity.AsyncRetrying:
    """A chunk read from the bucket whose bytes do not match, or that failed transiently: up to
    3 reads, short jittered waits."""
    return retry.attempts_async(tries=BUCKET_BYTES_TRIES, first_s=0.1, max_s=2.0, on=(BadBytes, Transient))
