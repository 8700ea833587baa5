"""The engine hand-off: how a serving process learns of, loads and acknowledges new snapshots.

Source: README.md ("Local API", "Fleet hot-load API") and DESIGN.md ("Surfaces").
A serving engine registers with its node's bdnd (``EngineLink``), long-polls for the fleet's target
snapshot once it is READY on this node, prepares the new weights while it keeps serving, pauses,
swaps, resumes, and acknowledges with the pause it measured; the daemon then reports the replica
``done`` in ``GET /hot_load/v1/models/hot_load``. While an engine holds a snapshot (the one offered
to it, then the one it serves) the daemon keeps a lease on it, so garbage collection leaves it be.

``run_hot_swap_loop`` is that cycle, for an engine that supplies two callables::

    from bdn.client import EngineLink, run_hot_swap_loop
    link = EngineLink("http://127.0.0.1:7081", name="my-engine")
    run_hot_swap_loop(link,
                      prepare=lambda snap: load_model(snap.path),         # while still serving
                      swap=lambda model, snap: engine.replace(model),     # the measured pause
                      stop=stop_event)

The fleet hot-load, lease and GC calls a trainer or operator makes are in :mod:`bdn.client.fleet`.

Transport: the ``DaemonClient``'s (:mod:`bdn.client.transport`, httpx over TCP or the unix
socket, pooled keep-alive connections), with its timeout and errors; a plain URL (e.g. a daemon's
peer port for the network hot-load API) gets a transport for the one call. Retries and backoff are
:mod:`bdn.retry`'s.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar
from urllib.parse import quote, urlencode

from bdn import retry
from bdn.client.daemon import DEFAULT_URL, DaemonClient
from bdn.client.errors import DaemonError, DaemonUnreachable, one_line
from bdn.client.fleet import as_client, call_json, json_object
from bdn.client.snapshot import Snapshot, open_snapshot
from bdn.proto.errors import BdnError, ProtocolError
from bdn.proto.identity import validate_identity

log = logging.getLogger("bdn.client.engine")

T = TypeVar("T")
MAX_NEXT_POLL = 300.0  # the daemon caps one long-poll at 300 s
RETRY_MIN, RETRY_MAX = 0.5, 10.0  # seconds between attempts while the daemon is unreachable


class EngineLink:
    """An engine's registration with its node's bdnd (local API only).

    Registers on construction (``POST /v1/engines``). ``engine_id`` is the daemon's name for it.

    Args:
        daemon: a ``DaemonClient`` or the daemon's local URL (default ``http://127.0.0.1:7081``).
        name: shown by the daemon in logs (e.g. ``"vllm-0"``).

    Raises DaemonUnreachable / DaemonError when the registration fails. Thread-safe.
    """

    def __init__(self, daemon: DaemonClient | str = DEFAULT_URL, name: str = "engine") -> None:
        self.client, self._owns_client = as_client(daemon)
        self.name = name
        self._lock = threading.Lock()
        self._closed = False
        self.engine_id = ""
        #: the identity this engine serves (its last acknowledged swap; the hot-swap loops set it),
        #: sent with a re-registration so a restarted daemon counts it as acknowledged
        self.serving: str | None = None
        try:
            self.register()
        except BaseException:
            if self._owns_client:
                self.client.close()
            raise

    def register(self) -> str:
        """(Re-)register with the daemon (``POST /v1/engines {"name", "serving"?}``), e.g. after it
        restarted and forgot us; returns the new ``engine_id``. With :attr:`serving` set, the
        daemon takes that snapshot as acknowledged when it is ready there (its lease, the replica
        ``done``, the next offer's changes relative to it).

        Raises DaemonUnreachable / DaemonError from the call, ProtocolError when the answer has no
        printable ``engine_id`` string of 1-200 characters.
        """
        body: dict[str, Any] = {"name": self.name}
        if self.serving is not None:
            body["serving"] = self.serving
        _status, ans = call_json(self.client, "POST", "/v1/engines", body, ok=(200, 201))
        engine_id = json_object(ans, "engine registration").get("engine_id")
        if not isinstance(engine_id, str) or not engine_id or not engine_id.isprintable() or len(engine_id) > 200:
            raise ProtocolError("engine registration: no valid 'engine_id' string")
        with self._lock:
            self.engine_id = engine_id
            self._closed = False
        log.info("registered with %s as engine %s", self.client.url, engine_id)
        return engine_id

    def _path(self, suffix: str = "") -> str:
        with self._lock:
            return f"/v1/engines/{quote(self.engine_id, safe='')}{suffix}"

    def next_snapshot(self, after: str | None, timeout: float = 30.0) -> dict[str, Any] | None:
        """Long-poll ``GET /v1/engines/{id}/next``: the fleet's target once READY here, if not ``after``
        (with ``serving`` = :attr:`serving` when set: what this engine serves now).

        Returns ``{"identity", "policy_version", "kind", "path", "lease_id"}`` (the daemon holds
        ``lease_id`` for this engine), or None when ``timeout`` seconds (at most 300) pass first.

        Raises:
            DaemonError: 404 when the daemon does not know this engine (it restarted: call
                ``register()``).
            DaemonUnreachable, ProtocolError: as ``call_json``.
        """
        if not (timeout >= 0 and math.isfinite(timeout)):
            raise ValueError(f"timeout must be a non-negative number of seconds, got {timeout!r}")
        wait = min(timeout, MAX_NEXT_POLL)
        params = {"after": after or "", "timeout": f"{wait:.3f}"}
        if self.serving is not None:  # (an ack the daemon missed across its restart is taken from it)
            params["serving"] = self.serving
        query = urlencode(params)
        status, ans = call_json(
            self.client, "GET", self._path("/next?") + query, ok=(200, 204), timeout=wait + self.client.timeout
        )
        if status == 204:
            return None
        offer = json_object(ans, "next snapshot")
        try:
            validate_identity(offer.get("identity"))
        except BdnError as exc:
            raise ProtocolError(f"next snapshot: {exc}") from None
        if not isinstance(offer.get("path"), str) or not offer["path"]:
            raise ProtocolError("next snapshot: no 'path' string")
        pv = offer.get("policy_version")
        if pv is not None and (not isinstance(pv, int) or isinstance(pv, bool)):
            raise ProtocolError("next snapshot: 'policy_version' is not an integer")
        return offer

    def ack(self, identity: str, pause_ms: float, error: str | None = None) -> None:
        """``POST /v1/engines/{id}/ack``: this engine now serves ``identity`` (or failed to load it).

        ``pause_ms`` is how long serving stopped for the swap (milliseconds). With ``error`` (one
        line) the daemon reports the replica in stage ``error`` with that reason and the engine
        keeps serving what it had. Raises DaemonError 409 if ``identity`` was never offered.
        """
        if not (pause_ms >= 0 and math.isfinite(pause_ms)):
            raise ValueError(f"pause_ms must be a non-negative number, got {pause_ms!r}")
        body: dict[str, Any] = {"identity": validate_identity(identity), "pause_ms": float(pause_ms)}
        if error is not None:
            body["error"] = one_line(error) or "error"
        call_json(self.client, "POST", self._path("/ack"), body)

    def heartbeat(self) -> None:
        """``POST /v1/engines/{id}/heartbeat``: tell the daemon this engine is alive while it is not
        polling (preparing or swapping), so it is not dropped after the daemon's ``engine_ttl_s``.

        Raises DaemonError 404 when the daemon has already dropped it; DaemonUnreachable.
        """
        call_json(self.client, "POST", self._path("/heartbeat"))

    @contextlib.contextmanager
    def keepalive(self, interval_s: float | None) -> Iterator[None]:
        """Send :meth:`heartbeat` every ``interval_s`` seconds from a thread while the block runs
        (None or <= 0: nothing is sent). Failures are logged, never raised: the block's work goes on.

        Use it around a prepare and swap: ``with link.keepalive(offer_keepalive_s(offer)): ...``.
        """
        if not interval_s or interval_s <= 0 or not math.isfinite(interval_s):
            yield
            return
        interval_s = min(interval_s, KEEPALIVE_MAX_S)  # Event.wait overflows past ~9.2e9 s
        done = threading.Event()

        def beat() -> None:
            while not done.wait(interval_s):
                try:
                    self.heartbeat()
                except BdnError as exc:
                    log.warning("heartbeat of engine %s failed: %s", self.engine_id, exc)

        t = threading.Thread(target=beat, name="bdn-engine-keepalive", daemon=True)
        t.start()
        try:
            yield
        finally:
            done.set()
            t.join(5.0)

    def unregister(self) -> None:
        """``DELETE /v1/engines/{id}``: the daemon forgets this engine and releases its leases; a
        :meth:`next_snapshot` in flight in another thread is answered at once (None).

        Once per registration (:meth:`register` again re-arms it). Best effort: a daemon that is
        gone or has forgotten the engine is not an error (logged). The connections stay open.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            call_json(self.client, "DELETE", self._path(), ok=(200, 204, 404))
        except (DaemonUnreachable, DaemonError, ProtocolError) as exc:
            log.warning("could not unregister engine %s: %s", self.engine_id, exc)
        else:
            log.info("unregistered engine %s from %s", self.engine_id, self.client.url)

    def close(self) -> None:
        """:meth:`unregister`, then close the connections this link opened (not a client passed in)."""
        try:
            self.unregister()
        finally:
            if self._owns_client:
                self.client.close()

    def __enter__(self) -> EngineLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: The longest pause between two heartbeats, whatever the offer's windows (an offer of
#: ``engine_ttl_s`` 1e300 made the keepalive thread die on ``OverflowError``).
KEEPALIVE_MAX_S = 3600.0


def offer_keepalive_s(offer: dict[str, Any]) -> float | None:
    """How often to send heartbeats while an offer is prepared: a third of the smaller of the
    offer's ``engine_stale_s`` (the daemon stops waiting for an engine silent for that long) and
    ``engine_ttl_s`` (it drops one), counting only positive finite numbers; None without one."""

    def positive(key: str) -> float | None:
        v = offer.get(key)
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
            return None
        return float(v)

    window = [v for v in (positive("engine_ttl_s"), positive("engine_stale_s")) if v is not None]
    return max(0.05, min(window) / 3.0) if window else None


def _describe(exc: BaseException) -> str:
    text = one_line(str(exc))
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def run_hot_swap_loop(
    link: EngineLink,
    prepare: Callable[[Snapshot], T],
    swap: Callable[[T, Snapshot], None],
    *,
    stop: threading.Event,
    current: str | None = None,
    poll_timeout: float = 30.0,
    on_swapped: Callable[[Snapshot, float], None] | None = None,
) -> None:
    """Serve hot-loads until ``stop`` is set: wait, prepare, swap, acknowledge; repeat.

    Each cycle: ``link.next_snapshot(after=<last identity>)``; ``open_snapshot(path)`` (checks
    READY and the identity); ``prepared = prepare(snapshot)`` while the engine keeps serving the
    old weights; then ``swap(prepared, snapshot)`` with the time it takes measured as the pause;
    then ``link.ack(identity, pause_ms)``. If opening, ``prepare`` or ``swap`` raises, the loop
    acks with ``error`` (one line: the exception's type and message) and keeps serving the old
    snapshot; it will not retry that identity, only a newer target.

    Snapshot lifetime: the loop owns the ``Snapshot`` objects. The one swapped out is closed after
    the ack (arrays still pointing into it stay valid until freed, see ``Snapshot.close``); a
    snapshot whose load failed is closed at once. The daemon holds the leases.

    Args:
        current: the identity already served (None at start-up: the first offer is loaded too).
        poll_timeout: seconds per long-poll; bounds how late ``stop`` is noticed.
        on_swapped: called with the new snapshot and the pause (ms) after each successful ack.

    Daemon trouble never ends the loop: while the daemon is unreachable it retries with backoff
    (``bdn.retry``: 0.5 s doubling to 10 s, jittered); if the daemon forgot the engine (404) it
    registers again.
    Exceptions from ``on_swapped`` propagate.
    """
    after = current
    if current is not None:
        link.serving = current
    serving: Snapshot | None = None
    try:
        while not stop.is_set():
            offer = _next_offer(link, after, poll_timeout, stop)
            if offer is None or stop.is_set():
                continue
            identity: str = offer["identity"]
            after = identity  # success or failure, only a newer target is worth another attempt
            snap: Snapshot | None = None
            try:
                snap = open_snapshot(offer["path"])
                if snap.identity != identity:
                    raise ProtocolError(f"{offer['path']} holds snapshot {snap.identity}, not {identity}")
                t0 = time.monotonic()
                with link.keepalive(offer_keepalive_s(offer)):
                    prepared = prepare(snap)
                    t1 = time.perf_counter()
                    swap(prepared, snap)
                    pause_ms = (time.perf_counter() - t1) * 1000.0
                log.info(
                    "loaded %s (policy version %s): prepared in %.0f ms, paused %.2f ms",
                    identity,
                    snap.policy_version,
                    (time.monotonic() - t0) * 1000.0,
                    pause_ms,
                )
            except Exception as exc:  # any failure of the engine's own code is reported, not fatal
                reason = _describe(exc)
                log.error("loading %s failed: %s", identity, reason)
                if snap is not None:
                    snap.close()
                _ack_quietly(link, identity, 0.0, reason)
                continue
            old, serving = serving, snap
            link.serving = identity
            _ack_quietly(link, identity, pause_ms, None)
            if old is not None:
                old.close()
            if on_swapped is not None:
                on_swapped(snap, pause_ms)
    finally:
        if serving is not None:
            serving.close()


def _next_offer(
    link: EngineLink, after: str | None, poll_timeout: float, stop: threading.Event
) -> dict[str, Any] | None:
    """``link.next_snapshot``, retried with backoff (``bdn.retry``) until it answers or ``stop`` is set.

    A daemon that forgot the engine (404: it restarted) gets a new registration at once.
    Backoff waits on ``stop``, so setting it ends the wait; None then.
    """
    for attempt in retry.attempts(
        deadline_s=math.inf, first_s=RETRY_MIN, max_s=RETRY_MAX, on=(BdnError,), sleep=stop.wait
    ):
        with attempt:
            if stop.is_set():
                return None
            try:
                try:
                    return link.next_snapshot(after, poll_timeout)
                except DaemonError as exc:
                    if exc.status != 404:
                        raise
                    log.warning("daemon forgot engine %s; registering again", link.engine_id)
                    link.register()
                    return link.next_snapshot(after, poll_timeout)
            except BdnError as exc:
                log.warning("waiting for the next snapshot failed: %s", exc)
                raise
    return None  # pragma: no cover - the loop above returns or raises


def _ack_quietly(link: EngineLink, identity: str, pause_ms: float, error: str | None) -> None:
    """Ack, logging (not raising) daemon trouble: the engine's state is what it is either way.

    A daemon that is briefly unreachable gets two more tries (``bdn.retry``), so that the replica
    does not stay ``loading`` for a swap that happened.
    """
    try:
        for attempt in retry.attempts(3, first_s=RETRY_MIN, max_s=RETRY_MAX, on=(DaemonUnreachable,)):
            with attempt:
                try:
                    link.ack(identity, pause_ms, error)
                except DaemonUnreachable as exc:
                    log.warning("ack of %s failed (attempt %d): %s", identity, attempt.retry_state.attempt_number, exc)
                    raise
    except BdnError as exc:
        log.warning("ack of %s failed: %s", identity, exc)


__all__ = ["EngineLink", "offer_keepalive_s", "run_hot_swap_loop"]
