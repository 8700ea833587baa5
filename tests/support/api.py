"""JSON over HTTP to real daemons and engines in tests, and waits on the states they report.

Every wait polls a state with a generous deadline (the machine may be busy); none asserts how long
something took.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from http.client import HTTPConnection
from typing import Any, TypeVar

_T = TypeVar("_T")

HOT_LOAD = "/hot_load/v1/models/hot_load"


def http(
    method: str, url: str, body: Any = None, *, token: str | None = None, timeout: float = 60.0
) -> tuple[int, Any]:
    """``(status, answer)``: ``body`` is sent as JSON (bytes as they are), ``token`` as a bearer
    token. The answer is its decoded JSON (None for an empty one), or its text when it is not JSON."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, raw.decode(errors="replace")


def wait_for(
    probe: Callable[[], _T],
    timeout: float,
    what: str,
    interval: float = 0.05,
    *,
    until: Callable[[_T], object] | None = None,
    detail: Callable[[], str] | None = None,
) -> _T:
    """``probe()``'s first value that is truthy (with ``until``: for which ``until(value)`` is truthy),
    polled every ``interval`` s. After ``timeout`` s an AssertionError naming ``what``, the last value
    seen and ``detail()`` (say a daemon's log) when given. An exception from ``probe`` or ``until`` (an
    assertion on a state that must hold while waiting) propagates at once."""
    deadline = time.monotonic() + timeout
    while True:
        v = probe()
        if until(v) if until is not None else v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(_timed_out(timeout, what, v, detail))
        time.sleep(interval)


async def wait_for_async(
    probe: Callable[[], _T],
    timeout: float,
    what: str,
    interval: float = 0.0,
    *,
    until: Callable[[_T], object] | None = None,
    detail: Callable[[], str] | None = None,
) -> _T:
    """:func:`wait_for` inside an event loop: between polls it awaits ``asyncio.sleep(interval)``
    (0: one turn of the loop), so the tasks under test run."""
    deadline = time.monotonic() + timeout
    while True:
        v = probe()
        if until(v) if until is not None else v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(_timed_out(timeout, what, v, detail))
        await asyncio.sleep(interval)


def _timed_out(timeout: float, what: str, last: object, detail: Callable[[], str] | None) -> str:
    seen = repr(last)
    if len(seen) > 2000:
        seen = seen[:2000] + "..."
    msg = f"timed out after {timeout:g} s waiting for {what}; last seen: {seen}"
    return msg + "\n" + detail() if detail is not None else msg


def wait_fleet(url: str, identity: str, timeout: float = 120.0, token: str | None = None) -> list[dict]:
    """The replicas the daemon at ``url`` lists, once every one is done serving ``identity``; an
    AssertionError as soon as one reports an error, or after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        status, body = http("GET", url + HOT_LOAD, token=token)
        assert status == 200, body
        reps = body["replicas"]
        if all(r["current_snapshot_identity"] == identity and r["loading_state"]["stage"] == "done" for r in reps):
            return reps
        errs = [r for r in reps if r["loading_state"]["stage"] == "error"]
        assert not errs, errs
        if time.monotonic() > deadline:
            raise AssertionError(f"fleet not done with {identity}: {reps}")
        time.sleep(0.2)


def raw_request(base_url: str, method: str, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """One HTTP request with the path sent exactly as given (no client-side normalisation)."""
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    conn = HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, path, headers=headers or {})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()
