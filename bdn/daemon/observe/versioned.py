"""Waiting for a version counter to move: the long-poll behind ``since``/``wait`` parameters.

A record (a snapshot job, the replica view) bumps an integer ``version`` on every change and
notifies an ``asyncio.Condition``; readers hand back the version they saw and wait until it moves.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def wait_change(cond: asyncio.Condition, version: Callable[[], int], since: int, timeout: float) -> None:
    """Return once ``version()`` differs from ``since`` or ``timeout`` seconds passed (at once if
    it already differs or ``timeout <= 0``). ``cond`` must be notified after every bump."""
    if version() != since or timeout <= 0:
        return
    async with cond:
        try:
            await asyncio.wait_for(cond.wait_for(lambda: version() != since), timeout)
        except TimeoutError:
            pass
