"""The one retry/backoff policy of bdn, on tenacity (a well-kept library; DESIGN.md, "Retries").

Every loop that retries (bucket reads, peer requests, membership, the client, ``bdnctl``, the
engine link) uses :func:`attempts` or :func:`attempts_async` instead of writing its own::

    for attempt in retry.attempts(tries=3, on=(BucketError,)):
        with attempt:
            data = bucket.read(key)

    async for attempt in retry.attempts_async(deadline_s=30, on=(PeerError,)):
        with attempt:
            await peers.get_have(url, identity)

The wait between tries is exponential with full jitter (``first_s`` doubling up to ``max_s``),
as AWS's "Exponential Backoff And Jitter" recommends for many clients retrying one service. The
last exception is re-raised unchanged when the tries or the deadline run out. ``sleep`` can be
injected (a fake clock in tests).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import tenacity

__all__ = ["attempts", "attempts_async", "RetryError"]

RetryError = tenacity.RetryError


def _kwargs(
    tries: int | None,
    deadline_s: float | None,
    first_s: float,
    max_s: float,
    on: tuple[type[BaseException], ...],
) -> dict[str, Any]:
    if tries is None and deadline_s is None:
        raise ValueError("give tries, deadline_s or both")
    stops: list[tenacity.stop.stop_base] = []
    if tries is not None:
        if tries < 1:
            raise ValueError("tries must be >= 1")
        stops.append(tenacity.stop_after_attempt(tries))
    if deadline_s is not None:
        stops.append(tenacity.stop_after_delay(deadline_s))
    stop = stops[0] if len(stops) == 1 else tenacity.stop_any(*stops)
    return {
        "stop": stop,
        "wait": tenacity.wait_random_exponential(multiplier=first_s, max=max_s),
        "retry": tenacity.retry_if_exception_type(on),
        "reraise": True,
    }


def attempts(
    tries: int | None = None,
    *,
    deadline_s: float | None = None,
    first_s: float = 0.2,
    max_s: float = 5.0,
    on: tuple[type[BaseException], ...] = (Exception,),
    sleep: Callable[[float], object] | None = None,
) -> tenacity.Retrying:
    """A synchronous retry loop: at most ``tries`` tries and/or ``deadline_s`` seconds (float)."""
    kw = _kwargs(tries, deadline_s, first_s, max_s, on)
    if sleep is not None:
        kw["sleep"] = sleep
    return tenacity.Retrying(**kw)


def attempts_async(
    tries: int | None = None,
    *,
    deadline_s: float | None = None,
    first_s: float = 0.2,
    max_s: float = 5.0,
    on: tuple[type[BaseException], ...] = (Exception,),
    sleep: Callable[[float], Awaitable[None]] | None = None,
) -> tenacity.AsyncRetrying:
    """The same policy for coroutines (``async for attempt in ...: with attempt: ...``)."""
    kw = _kwargs(tries, deadline_s, first_s, max_s, on)
    if sleep is not None:
        kw["sleep"] = sleep
    return tenacity.AsyncRetrying(**kw)
