"""The local API calls a trainer, an operator or an engine makes that are not the engine link
itself: the fleet hot-load (``hot_load``, ``hot_load_status``), the engine table (``list_engines``,
``remove_engine``), leases (``take_lease``, ``release_lease``) and GC (``collect_garbage``), and
``call_json``, the one JSON request/answer helper they and the engine link share.

Source: README.md ("Local API", "Fleet hot-load API"). Transport: the ``DaemonClient``'s
(:mod:`bdn.client.transport`, httpx over TCP or the unix socket); a plain URL (e.g. a daemon's
peer port for the network hot-load API) gets a transport for the one call. Errors: DaemonError
(the daemon's status and one-line message), DaemonUnreachable.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from bdn.client.daemon import DaemonClient
from bdn.client.transport import Transport
from bdn.proto.errors import ProtocolError
from bdn.proto.fleet_schema import complete_page
from bdn.proto.identity import validate_identity

HOT_LOAD_PATH = "/hot_load/v1/models/hot_load"


def as_client(daemon: DaemonClient | str) -> tuple[DaemonClient, bool]:
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


def json_object(obj: Any, what: str) -> dict[str, Any]:
    """``obj`` if it is a JSON object (dict), else ProtocolError naming ``what`` and the type it was."""
    if not isinstance(obj, dict):
        raise ProtocolError(f"{what}: expected a JSON object, got {type(obj).__name__}")
    return obj


# -- fleet hot-load, leases, GC ----------------------------------------------------------------


def hot_load(
    daemon: DaemonClient | str,
    identity: str,
    previous: str | None = None,
    *,
    compression_format: str | None = None,
    checksum_format: str = "alder32",
    token: str | None = None,
    prompt_cache_policy: str | None = None,
    inflight_policy: str | None = None,
    inflight_wait_s: float | None = None,
) -> dict[str, Any]:
    """``POST /hot_load/v1/models/hot_load``: make every replica of the fleet load ``identity``.

    Args:
        identity: the snapshot to serve.
        previous: for a delta, the snapshot the fleet serves now or is loading, which must be the
            delta's base (``previous_snapshot_identity``); the request then carries
            ``incremental_snapshot_metadata`` with ``checksum_format`` (spelled ``alder32`` as the
            hosted APIs spell it) and ``compression_format`` when given (None: the manifest's).
            Leave it out to load a delta over a chain of deltas from what is served.
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
        meta: dict[str, Any] = {
            "previous_snapshot_identity": validate_identity(previous),
            "checksum_format": checksum_format,
        }
        if compression_format is not None:
            meta["compression_format"] = compression_format
        body["incremental_snapshot_metadata"] = meta
    for key, val in (
        ("prompt_cache_policy", prompt_cache_policy),
        ("inflight_policy", inflight_policy),
        ("inflight_wait_s", inflight_wait_s),
    ):
        if val is not None:
            body[key] = val
    headers = {"Authorization": f"Bearer {token}"} if token else None
    _status, ans = call_json(daemon, "POST", HOT_LOAD_PATH, body, headers=headers)
    return json_object(ans, "hot-load answer")


def hot_load_status(
    daemon: DaemonClient | str, *, token: str | None = None, max_pages: int = 100
) -> list[dict[str, Any]]:
    """``GET /hot_load/v1/models/hot_load``: every replica of the fleet, page after page
    (1,000 a page, following ``next_page_token``; at most ``max_pages``). Each page costs the
    daemon a few requests to the fleet status aggregators, whatever the fleet size.

    Each row has every key of ``bdn.proto.fleet_schema.REPLICA_ROW`` (``replica_id``,
    ``current_snapshot_identity``, ``policy_version``, ``readiness``, ``loading_state``: ``{"stage",
    "identity", "progress", "reason"}``, ``engines``, ``last_swap_pause_ms``, ``superseded``,
    ``request_id``, the engine options, ``last_swap``), in every stage (queued, downloading,
    applying, verifying, ready, loading, done, error): a key an answer lacks takes its
    documented default, so none raises KeyError. Raises ProtocolError for an answer that is not
    a map with a ``replicas`` list or a row that is not a map.
    """
    headers = {"Authorization": f"Bearer {token}"} if token else None
    out: list[dict[str, Any]] = []
    page_token = ""
    for _ in range(max_pages):
        q = "?page_size=1000" + (f"&page_token={quote(page_token)}" if page_token else "")
        _status, ans = call_json(daemon, "GET", HOT_LOAD_PATH + q, headers=headers)
        page = complete_page(ans)  # every documented key, whichever daemon version answered
        out += page["replicas"]
        page_token = page["next_page_token"]
        if not page_token:
            break
    return out


def list_engines(daemon: DaemonClient | str) -> dict[str, Any]:
    """``GET /v1/engines``: ``{"engine_ttl_s", "engines": [{"engine_id", "name", "serving",
    "offered", "error", "pause_ms", "prompt_cache_policy", "inflight_policy", "swap",
    "registered_s_ago", "last_seen_s_ago", "expires_in_s"}]}``."""
    _status, ans = call_json(daemon, "GET", "/v1/engines")
    ans = json_object(ans, "engines")
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
    lease_id = json_object(ans, "lease answer").get("lease_id")
    if not isinstance(lease_id, str) or not lease_id:
        raise ProtocolError("lease answer has no 'lease_id' string")
    return lease_id


def release_lease(daemon: DaemonClient | str, lease_id: str) -> None:
    """``DELETE /v1/leases/{lease_id}``; DaemonError 404 for an unknown lease."""
    call_json(daemon, "DELETE", f"/v1/leases/{quote(lease_id, safe='')}")


def collect_garbage(daemon: DaemonClient | str) -> dict[str, Any]:
    """``POST /v1/gc``: drop old snapshots now; returns ``{"removed": [...], "kept": [...]}``."""
    _status, ans = call_json(daemon, "POST", "/v1/gc")
    return json_object(ans, "gc answer")


# -- the engine's registration -----------------------------------------------------------------
