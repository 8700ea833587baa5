"""JSON over HTTP to real daemons and engines in tests, and waits on the states they report.

Every wait polls a state with a generous deadline (the machine may be busy); none asserts how long
something took.
"""

from __future__ import annotations

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


def wait_for(pred: Callable[[], _T], timeout: float, what: str, interval: float = 0.05) -> _T:
    """``pred()``'s first truthy value, polled every ``interval`` s; AssertionError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


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
