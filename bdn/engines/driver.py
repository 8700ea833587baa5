"""The hot-swap cycle between bdn's engine link and an engine adapter.

Like ``bdn.client.run_hot_swap_loop``, but the adapter sees the whole offer (changed tensors,
per hot-load options) and the ack carries what the adapter did::

    link = EngineLink("http://127.0.0.1:7081", name="hf-0")
    drive(link, adapter, stop=stop_event)

An adapter has two methods:

- ``prepare(snapshot, offer, options) -> prepared``: while the old policy keeps serving.
- ``swap(prepared) -> report``: the pause; returns a dict with at least ``pause_ms`` (ms).

Each cycle: ``link.next_snapshot(after)``; ``open_snapshot(offer["path"])`` (READY and identity
checked); ``HotLoadOptions.from_offer(offer)``; prepare; swap; then
``POST /v1/engines/{id}/ack`` with ``{"identity", "pause_ms", "prompt_cache_policy",
"inflight_policy", "swap": report}`` (``"error"`` instead of a report when anything failed: the
engine keeps serving the old policy and only a newer target is tried). The snapshot swapped out
is closed after the ack; the daemon holds the leases.

Daemon trouble never ends the loop: the long-poll and the ack retry through ``bdn.retry``.

Stopping: set ``stop``. A long-poll in flight is answered at once when the engine unregisters
(``DELETE /v1/engines/{id}``); ``polling`` tells a stopper whether that is safe now (no load in
progress) or must wait for the driver to return (``bdn.engines.service.Driver.close``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol
from urllib.parse import quote

from bdn import retry
from bdn.client import EngineLink, Snapshot, call_json, open_snapshot
from bdn.client.engine import offer_keepalive_s
from bdn.client.errors import DaemonError, DaemonUnreachable, one_line
from bdn.client.swap_report import describe_swap
from bdn.engines.options import HotLoadOptions
from bdn.proto.errors import BdnError, ProtocolError

log = logging.getLogger("bdn.engines.driver")

__all__ = ["Adapter", "ack", "drive"]

POLL_RETRY_S = 3600.0  # retry a daemon that is away for up to an hour per long-poll, then log and go on


class Adapter(Protocol):
    """What the driver needs of an engine: prepare a snapshot while serving, then swap it in."""

    def prepare(self, snapshot: Snapshot, offer: dict[str, Any], options: HotLoadOptions) -> Any:
        """Stage ``snapshot``'s weights (per ``offer``: which tensors changed) while serving; returns the staged state."""

    def swap(self, prepared: Any) -> dict[str, Any]:
        """Pause, make ``prepared`` the served weights, resume; returns what the ack reports (mode, tensors, pause ms)."""


class _Stopped(Exception):
    pass


def ack(
    link: EngineLink,
    identity: str,
    pause_ms: float,
    options: HotLoadOptions | None,
    report: dict[str, Any] | None = None,
    error: str | None = None,
) -> None:
    """``POST /v1/engines/{id}/ack`` with the swap report; retried a few times on a daemon away.

    Body: ``{"identity", "pause_ms", "error"?, "prompt_cache_policy"?, "inflight_policy"?,
    "swap"?}``. The daemon reads ``identity``, ``pause_ms`` and ``error`` today; the other fields
    are what the replica state should report (docs/ENGINES.md, "What the daemon is asked to send").
    An unreachable daemon is tried 3 times (backoff from 0.5 s); whatever BdnError is left
    (unreachable still, or an error answer) is logged, not raised.
    """
    body: dict[str, Any] = {"identity": identity, "pause_ms": max(0.0, float(pause_ms))}
    if error is not None:
        body["error"] = one_line(error) or "error"
    if options is not None:
        body.update(prompt_cache_policy=options.prompt_cache_policy, inflight_policy=options.inflight_policy)
    if report is not None:
        body["swap"] = report
    path = f"/v1/engines/{quote(link.engine_id, safe='')}/ack"
    try:
        for attempt in retry.attempts(tries=3, first_s=0.5, on=(DaemonUnreachable,)):
            with attempt:
                call_json(link.client, "POST", path, body)
    except BdnError as exc:
        log.warning("ack of %s failed: %s", identity, exc)


def _describe(exc: BaseException) -> str:
    text = one_line(str(exc))
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _next(link: EngineLink, after: str | None, poll_timeout: float, stop: threading.Event) -> dict[str, Any] | None:
    def sleep(s: float) -> None:
        if stop.wait(s):
            raise _Stopped

    for attempt in retry.attempts(
        deadline_s=POLL_RETRY_S,
        first_s=0.5,
        max_s=10.0,
        on=(DaemonUnreachable, DaemonError, ProtocolError),
        sleep=sleep,
    ):
        with attempt:
            try:
                return link.next_snapshot(after, poll_timeout)
            except DaemonError as exc:
                if exc.status == 404:
                    if stop.is_set():  # unregistered on the way out: do not register again
                        raise _Stopped from None
                    log.warning("daemon forgot engine %s; registering again", link.engine_id)
                    link.register()
                    return link.next_snapshot(after, poll_timeout)
                raise
    return None


def drive(
    link: EngineLink,
    adapter: Adapter,
    *,
    stop: threading.Event,
    current: str | None = None,
    poll_timeout: float = 30.0,
    on_swapped: Callable[[Snapshot, dict[str, Any]], None] | None = None,
    polling: threading.Event | None = None,
) -> None:
    """Serve hot-loads until ``stop`` is set (see the module doc).

    Args:
        current: the identity already served (None at start: the first offer is loaded too).
        poll_timeout: seconds per long-poll; bounds how late ``stop`` is noticed, unless the
            engine is unregistered meanwhile (the daemon then answers the poll at once).
        on_swapped: called with the new snapshot and the report after each successful ack.
        polling: set while the driver waits for an offer, clear while it loads one (from the
            offer to its ack). It is set before each check of ``stop`` and cleared before the
            check that precedes a load, so a stopper that sets ``stop`` and then finds
            ``polling`` set knows no load will start: it may unregister at once.

    Returns once ``stop`` is set, after closing the snapshot it served. Daemon trouble is retried
    and logged, and a failed load (offer, snapshot or adapter) is acked with ``"error"``: none of
    them is raised. An exception of ``on_swapped`` ends the loop and propagates.
    """
    after = current
    if current is not None:
        link.serving = current  # (a re-registration tells a restarted daemon: bdn.client.EngineLink)
    serving: Snapshot | None = None
    polling = polling if polling is not None else threading.Event()
    try:
        while True:
            polling.set()
            if stop.is_set():
                break
            try:
                offer = _next(link, after, poll_timeout, stop)
            except _Stopped:
                break
            except BdnError as exc:
                log.warning("waiting for the next snapshot failed: %s", exc)
                continue
            if offer is None:
                continue
            polling.clear()
            if stop.is_set():
                continue
            identity: str = offer["identity"]
            after = identity
            snap: Snapshot | None = None
            options: HotLoadOptions | None = None
            try:
                options = HotLoadOptions.from_offer(offer)
                snap = open_snapshot(offer["path"])
                if snap.identity != identity:
                    raise ProtocolError(f"{offer['path']} holds snapshot {snap.identity}, not {identity}")
                with link.keepalive(offer_keepalive_s(offer)):  # not polling meanwhile: stay registered
                    prepared = adapter.prepare(snap, offer, options)
                    report = adapter.swap(prepared)
            except Exception as exc:  # the engine's own failure is the replica's error, never fatal
                reason = _describe(exc)
                log.error("loading %s failed: %s", identity, reason)
                if snap is not None:
                    snap.close()
                ack(link, identity, 0.0, options, error=reason)
                continue
            pause = float(report.get("pause_ms") or 0.0)
            log.info(
                "serving %s (policy version %s): %s",
                identity,
                snap.policy_version,
                describe_swap({**report, "pause_ms": pause}),
            )
            old, serving = serving, snap
            link.serving = identity
            ack(link, identity, pause, options, report)
            if old is not None and old is not snap:
                old.close()
            if on_swapped is not None:
                on_swapped(snap, report)
    finally:
        if serving is not None:
            serving.close()
