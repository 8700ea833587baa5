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

The module also has the fleet hot-load calls a trainer or operator makes (``hot_load``,
``hot_load_status``) and the lease and GC calls (``take_lease``, ``release_lease``,
``collect_garbage``).

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
from bdn.client.snapshot import Snapshot, open_snapshot
from bdn.client.transport import Transport
from bdn.proto.errors import BdnError, ProtocolError
from bdn.proto.identity import validate_identity

log = logging.getLogger("bdn.client.engine")

T = TypeVar("T")
MAX_NEXT_POLL = 300.0  # the daemon caps one long-poll at 300 s
HOT_LOAD_PATH = "/hot_load/v1/models/hot_load"
RETRY_MIN, RETRY_MAX = 0.5, 10.0  # seconds between attempts while the daemon is unreachable


def _as_client(daemon: DaemonClient | str) -> tuple[DaemonClient, bool]:
    """The DaemonClient to use, and whether this module made it (and so must close it)."""
    if isinstance(daemon, DaemonClient):
        return daemon, False
    return DaemonClient(daemon), True


def call_json(
    daemon: DaemonClient | str,
    method: str,
    path: str,
    body: Any = None,
    *,
    ok: tuple[int, ...] = (200,),
    timeout: float | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    """One JSON request to a daemon; returns ``(status, parsed body or None when empty)``.

    Args:
        daemon: a ``DaemonClient`` (its URL and timeout are used) or a URL (``http://host:port``,
            ``unix:///path.sock``; also a daemon's peer URL for the network hot-load API).
        body: sent as JSON (``Content-Type: application/json``) unless None.
        ok: statuses that are answers; any other raises ``DaemonError(status, message)``.
        timeout: seconds for the connection and the answer (default: the client's).
        headers: extra headers (``Authorization: Bearer ...`` for the network hot-load API).

    Raises:
        DaemonUnreachable: refused, no socket, timed out, dropped.
        DaemonError: a status outside ``ok`` (message: the daemon's ``{"error": ...}`` line).
        ProtocolError: an answer over 64 MiB or not JSON.
    """
    if isinstance(daemon, DaemonClient):
        r = daemon.http.request(method, path, body=body, ok=ok, headers=headers, timeout=timeout)
    else:
        transport = Transport(daemon)
        try:
            r = transport.request(method, path, body=body, ok=ok, headers=headers, timeout=timeout)
        finally:
            transport.close()
    try:
        return r.status, r.json()
    except ProtocolError as exc:
        raise ProtocolError(f"{method} {path}: {exc}") from None


def _object(obj: Any, what: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise ProtocolError(f"{what}: expected a JSON object, got {type(obj).__name__}")
    return obj


# -- fleet hot-load, leases, GC ----------------------------------------------------------------

def hot_load(
    daemon: DaemonClient | str,
    identity: str,
    previous: str | None = None,
    *,
    compression_format: str = "arc_v2",
    checksum_format: str = "alder32",
    token: str | None = None,
    prompt_cache_policy: str | None = None,
    inflight_policy: str | None = None,
    inflight_wait_s: float | None = None,
) -> dict[str, Any]:
    """``POST /hot_load/v1/models/hot_load``: make every replica of the fleet load ``identity``.

    Args:
        identity: the snapshot to serve.
        previous: for a delta, the identity it applies to (``previous_snapshot_identity``); the
            request then carries ``incremental_snapshot_metadata`` with ``compression_format``
            and ``checksum_format`` (spelled ``alder32`` as the hosted APIs spell it).
        token: the daemons' API token, for a daemon's network (peer) port; not needed locally.
        prompt_cache_policy, inflight_policy, inflight_wait_s: the engine options of this hot-load
            (``RESET_ALL``/``PRESERVE``, ``wait``/``keep``/``abort``, seconds; docs/ENGINES.md);
            None leaves a field out (the daemon's defaults: RESET_ALL, wait, 30 s).

    Returns the answer: ``{"accepted", "identity", "policy_version", "request_id", "replicas",
    "prompt_cache_policy", "inflight_policy", "inflight_wait_s"}``.

    Raises:
        IdentityError: a malformed identity (nothing is sent).
        DaemonError: 400 malformed, 404 not in the bucket, 409 unknown base or not the one
            served, 415 unsupported compression format, 401 bad token.
    """
    body: dict[str, Any] = {"identity": validate_identity(identity)}
    if previous is not None:
        body["incremental_snapshot_metadata"] = {
            "previous_snapshot_identity": validate_identity(previous),
            "compression_format": compression_format,
            "checksum_format": checksum_format,
        }
    for key, val in (("prompt_cache_policy", prompt_cache_policy), ("inflight_policy", inflight_policy),
                     ("inflight_wait_s", inflight_wait_s)):
        if val is not None:
            body[key] = val
    headers = {"Authorization": f"Bearer {token}"} if token else None
    _status, ans = call_json(daemon, "POST", HOT_LOAD_PATH, body, headers=headers)
    return _object(ans, "hot-load answer")


def hot_load_status(daemon: DaemonClient | str, *, token: str | None = None) -> list[dict[str, Any]]:
    """``GET /hot_load/v1/models/hot_load``: every replica of the fleet.

    Each: ``{"replica_id", "current_snapshot_identity", "policy_version", "readiness",
    "loading_state": {"stage", "identity", "progress", "reason"}}`` (stages queued, downloading,
    applying, verifying, ready, loading, done, error).
    """
    headers = {"Authorization": f"Bearer {token}"} if token else None
    _status, ans = call_json(daemon, "GET", HOT_LOAD_PATH, headers=headers)
    reps = _object(ans, "hot-load status").get("replicas")
    if not isinstance(reps, list) or not all(isinstance(r, dict) for r in reps):
        raise ProtocolError("hot-load status: 'replicas' is not a list of objects")
    return reps


def list_engines(daemon: DaemonClient | str) -> dict[str, Any]:
    """``GET /v1/engines``: ``{"engine_ttl_s", "engines": [{"engine_id", "name", "serving",
    "offered", "error", "pause_ms", "prompt_cache_policy", "inflight_policy", "swap",
    "registered_s_ago", "last_seen_s_ago", "expires_in_s"}]}``."""
    _status, ans = call_json(daemon, "GET", "/v1/engines")
    ans = _object(ans, "engines")
    if not isinstance(ans.get("engines"), list) or not all(isinstance(e, dict) for e in ans["engines"]):
        raise ProtocolError("engines: 'engines' is not a list of objects")
    return ans


def remove_engine(daemon: DaemonClient | str, engine_id: str) -> None:
    """``DELETE /v1/engines/{id}``: drop an engine (its leases are released); DaemonError 404 if unknown."""
    call_json(daemon, "DELETE", f"/v1/engines/{quote(engine_id, safe='')}")


def take_lease(daemon: DaemonClient | str, identity: str, holder: str) -> str:
    """``POST /v1/snapshots/{identity}/leases``: keep a ready snapshot from GC; returns the lease id.

    Raises DaemonError 409 if the snapshot is not ready on this node.
    """
    path = f"/v1/snapshots/{quote(validate_identity(identity), safe='')}/leases"
    _status, ans = call_json(daemon, "POST", path, {"holder": holder}, ok=(200, 201))
    lease_id = _object(ans, "lease answer").get("lease_id")
    if not isinstance(lease_id, str) or not lease_id:
        raise ProtocolError("lease answer has no 'lease_id' string")
    return lease_id


def release_lease(daemon: DaemonClient | str, lease_id: str) -> None:
    """``DELETE /v1/leases/{lease_id}``; DaemonError 404 for an unknown lease."""
    call_json(daemon, "DELETE", f"/v1/leases/{quote(lease_id, safe='')}")


def collect_garbage(daemon: DaemonClient | str) -> dict[str, Any]:
    """``POST /v1/gc``: drop old snapshots now; returns ``{"removed": [...], "kept": [...]}``."""
    _status, ans = call_json(daemon, "POST", "/v1/gc")
    return _object(ans, "gc answer")


# -- the engine's registration -----------------------------------------------------------------

class EngineLink:
    """An engine's registration with its node's bdnd (local API only).

    Registers on construction (``POST /v1/engines``). ``engine_id`` is the daemon's name for it.

    Args:
        daemon: a ``DaemonClient`` or the daemon's local URL (default ``http://127.0.0.1:7081``).
        name: shown by the daemon in logs (e.g. ``"vllm-0"``).

    Raises DaemonUnreachable / DaemonError when the registration fails. Thread-safe.
    """

    def __init__(self, daemon: DaemonClient | str = DEFAULT_URL, name: str = "engine") -> None:
        self.client, self._owns_client = _as_client(daemon)
        self.name = name
        self._lock = threading.Lock()
        self._closed = False
        self.engine_id = ""
        try:
            self.register()
        except BaseException:
            if self._owns_client:
                self.client.close()
            raise

    def register(self) -> str:
        """(Re-)register with the daemon, e.g. after it restarted and forgot us; returns the id."""
        _status, ans = call_json(self.client, "POST", "/v1/engines", {"name": self.name}, ok=(200, 201))
        engine_id = _object(ans, "engine registration").get("engine_id")
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
        """Long-poll ``GET /v1/engines/{id}/next``: the fleet's target once READY here, if not ``after``.

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
        query = urlencode({"after": after or "", "timeout": f"{wait:.3f}"})
        status, ans = call_json(self.client, "GET", self._path("/next?") + query, ok=(200, 204),
                                timeout=wait + self.client.timeout)
        if status == 204:
            return None
        offer = _object(ans, "next snapshot")
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

    def close(self) -> None:
        """``DELETE /v1/engines/{id}``: unregister (the daemon releases this engine's leases).

        Best effort: a daemon that is gone or has forgotten the engine is not an error.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            call_json(self.client, "DELETE", self._path(), ok=(200, 204, 404))
        except (DaemonUnreachable, DaemonError, ProtocolError) as exc:
            log.warning("could not unregister engine %s: %s", self.engine_id, exc)
        finally:
            if self._owns_client:
                self.client.close()

    def __enter__(self) -> EngineLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def offer_keepalive_s(offer: dict[str, Any]) -> float | None:
    """How often to send heartbeats while an offer is prepared: a third of the offer's
    ``engine_ttl_s`` (the daemon drops an engine silent for that long), None without one."""
    ttl = offer.get("engine_ttl_s")
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not math.isfinite(ttl) or ttl <= 0:
        return None
    return max(0.05, ttl / 3.0)


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
                log.info("loaded %s (policy version %s): prepared in %.0f ms, paused %.2f ms",
                         identity, snap.policy_version, (time.monotonic() - t0) * 1000.0, pause_ms)
            except Exception as exc:  # any failure of the engine's own code is reported, not fatal
                reason = _describe(exc)
                log.error("loading %s failed: %s", identity, reason)
                if snap is not None:
                    snap.close()
                _ack_quietly(link, identity, 0.0, reason)
                continue
            old, serving = serving, snap
            _ack_quietly(link, identity, pause_ms, None)
            if old is not None:
                old.close()
            if on_swapped is not None:
                on_swapped(snap, pause_ms)
    finally:
        if serving is not None:
            serving.close()


def _next_offer(link: EngineLink, after: str | None, poll_timeout: float, stop: threading.Event) -> dict[str, Any] | None:
    """``link.next_snapshot``, retried with backoff (``bdn.retry``) until it answers or ``stop`` is set.

    A daemon that forgot the engine (404: it restarted) gets a new registration at once.
    Backoff waits on ``stop``, so setting it ends the wait; None then.
    """
    for attempt in retry.attempts(deadline_s=math.inf, first_s=RETRY_MIN, max_s=RETRY_MAX, on=(BdnError,),
                                  sleep=stop.wait):
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


__all__ = [
    "HOT_LOAD_PATH",
    "EngineLink",
    "call_json",
    "collect_garbage",
    "hot_load",
    "hot_load_status",
    "list_engines",
    "offer_keepalive_s",
    "release_lease",
    "remove_engine",
    "run_hot_swap_loop",
    "take_lease",
]
