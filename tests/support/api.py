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
    meanwhile: Callable[[_T], object] | None = None,
    detail: Callable[[], str] | None = None,
) -> _T:
    """``probe()``'s first value that is truthy (with ``until``: for which ``until(value)`` is truthy),
    polled every ``interval`` s. ``meanwhile(value)`` must hold of every value that does not end the
    wait (a state the wait may pass through): an AssertionError naming ``what`` and the value at once
    otherwise. After ``timeout`` s an AssertionError naming ``what``, the last value seen and
    ``detail()`` (say a daemon's log) when given. An exception from ``probe`` or ``until``
    propagates at once."""
    deadline = time.monotonic() + timeout
    while True:
        v = probe()
        if until(v) if until is not None else v:
            return v
        if meanwhile is not None and not meanwhile(v):
            raise AssertionError(f"while waiting for {what}: unexpected {_shown(v)}" + _detail(detail))
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
    return f"timed out after {timeout:g} s waiting for {what}; last seen: {_shown(last)}" + _detail(detail)


def _shown(v: object) -> str:
    r = repr(v)
    return r if len(r) <= 2000 else r[:2000] + "..."


def _detail(detail: Callable[[], str] | None) -> str:
    return "\n" + detail() if detail is not None else ""


def wait_fleet(url: str, identity: str, timeout: float = 120.0, token: str | None = None) -> list[dict]:
    """The replicas the daemon at ``url`` lists, once every one is done serving ``identity``; an
    AssertionError as soon as one reports an error, or after ``timeout`` s."""

    def replicas() -> list[dict]:
        status, body = http("GET", url + HOT_LOAD, token=token)
        assert status == 200, body
        return body["replicas"]

    return wait_for(
        replicas,
        timeout,
        f"the fleet done with {identity}",
        0.2,
        until=lambda reps: all(
            r["current_snapshot_identity"] == identity and r["loading_state"]["stage"] == "done" for r in reps
        ),
        meanwhile=lambda reps: not [r for r in reps if r["loading_state"]["stage"] == "error"],
    )


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
