"""``DaemonClient``: a synchronous client of bdnd's local API.

The API is described in README.md ("Local API") (and DESIGN.md, "Surfaces"). Serving processes
are often threaded rather than asyncio, so this client is blocking; its HTTP is
:mod:`bdn.client.transport` (httpx, pooled keep-alive connections shared by all threads).

Base URLs: ``http://host:port`` (default ``http://127.0.0.1:7081``, optionally with a path prefix)
or ``unix:///path/to.sock`` for the daemon's unix socket.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import quote, urlencode

import numpy as np

from bdn.client import pull
from bdn.client.errors import DaemonError, NotPublished, SnapshotFailed
from bdn.client.snapshot import Snapshot, open_snapshot
from bdn.client.transport import (
    DEFAULT_URL,
    Response,
    Transport,
    error_message,
)
from bdn.proto.errors import BdnError, ProtocolError
from bdn.proto.identity import validate_identity, validate_relpath
from bdn.proto.safetensors_fmt import numpy_dtype
from bdn.proto.states import SNAPSHOT_STATES as STATES
from bdn.proto.states import TERMINAL

MAX_WAIT_POLL = 300.0  # the daemon caps one long-poll at 300 s


class DaemonClient:
    """Blocking client of one bdnd's local API.

    Args:
        url: ``http://host:port[/prefix]`` or ``unix:///path/to.sock``.
        timeout: seconds to wait for the connection and for each answer (long-polls add their own
            wait on top).

    Errors (all one line): ``DaemonUnreachable`` when the daemon cannot be reached (refused, no
    socket, timed out, dropped); ``DaemonError`` (``.status``) when it answers with an error;
    ``SnapshotFailed`` when a waited-for snapshot fails; ``IdentityError``/``PathError`` for a bad
    argument before anything is sent; ``ProtocolError`` for an answer that breaks the API.
    Thread-safe.
    """

    def __init__(self, url: str = DEFAULT_URL, timeout: float = 30.0) -> None:
        self.http = Transport(url, timeout)
        self.url = url
        self.timeout = self.http.timeout

    def _request(
        self,
        method: str,
        path: str,
        *,
        ok: tuple[int, ...] = (200,),
        timeout: float | None = None,
        idempotent: bool = False,
    ) -> Response:
        return self.http.request(method, path, ok=ok, timeout=timeout, idempotent=idempotent)

    def _json(self, method: str, path: str, ok: tuple[int, ...] = (200,), idempotent: bool = False) -> dict[str, Any]:
        obj = self._request(method, path, ok=ok, idempotent=idempotent).json()
        if not isinstance(obj, dict):
            raise ProtocolError(f"{method} {path}: expected a JSON object, got {type(obj).__name__}")
        return obj

    def close(self) -> None:
        """Close every connection this client opened (it reconnects if used again)."""
        self.http.close()

    def __enter__(self) -> DaemonClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- API -----------------------------------------------------------------------------------

    @staticmethod
    def _snap_path(identity: str) -> str:
        return f"/v1/snapshots/{quote(validate_identity(identity), safe='')}"

    def health(self) -> dict[str, Any]:
        """``GET /v1/health``: ``{"status": "ok", "node_id", "swarm_id"}``."""
        return self._json("GET", "/v1/health")

    def status(self) -> dict[str, Any]:
        """``GET /v1/status``: node, swarm, peers, bucket, counters and every snapshot."""
        return self._json("GET", "/v1/status")

    def snapshots(self) -> list[dict[str, Any]]:
        """``GET /v1/snapshots``: every snapshot this daemon knows, as ``<snapshot>`` objects.

        Raises ProtocolError when ``snapshots`` is not a list of objects.
        """
        snaps = self._json("GET", "/v1/snapshots").get("snapshots")
        if not isinstance(snaps, list) or not all(isinstance(s, dict) for s in snaps):
            raise ProtocolError("GET /v1/snapshots: 'snapshots' is not a list of objects")
        return snaps

    def snapshot(self, identity: str) -> dict[str, Any]:
        """``GET /v1/snapshots/{identity}``; DaemonError 404 if the daemon does not know it."""
        return self._json("GET", self._snap_path(identity))

    def prefetch(
        self, identity: str, wait_publish: bool = False, publish_timeout: float | None = None
    ) -> dict[str, Any]:
        """``POST /v1/snapshots/{identity}/prefetch``: start fetching; returns the ``<snapshot>``.

        The daemon waits for ``bdn.manifest.json`` if the snapshot's files are there without it.
        With nothing at all under the identity the snapshot fails at once (reason "nothing is
        published under ..."), unless ``wait_publish`` (``?wait_publish=1``): then it waits for
        the publication too. Either wait lasts up to the daemon's ``manifest_wait_s`` (600 s),
        or ``publish_timeout`` seconds when given (the caller gives up then: the daemon stops
        looking too, and the snapshot fails "not published yet (waited N s)").
        """
        query = {"wait_publish": "1"} if wait_publish else {}
        if publish_timeout is not None:
            query["publish_timeout"] = f"{max(0.0, publish_timeout):.3f}"
        path = self._snap_path(identity) + "/prefetch" + (f"?{urlencode(query)}" if query else "")
        return self._json("POST", path, ok=(200, 202), idempotent=True)

    def cancel(self, identity: str) -> dict[str, Any]:
        """``DELETE /v1/snapshots/{identity}``: stop its load on this node; the ``<snapshot>``
        (``failed``, reason "cancelled by the operator"; a ready or failed one unchanged).
        DaemonError 404 if the daemon does not know it."""
        return self._json("DELETE", self._snap_path(identity), idempotent=True)

    def repair(self, identity: str) -> dict[str, Any]:
        """``POST /v1/snapshots/{identity}/repair``: the daemon re-hashes the ready snapshot; every
        corrupted chunk is quarantined (no longer served) and fetched again. Returns ``{"identity",
        "chunks", "corrupted": [{"path", "chunk", "offset", "length"}], "state", "reason"}``
        (``state`` is ``downloading`` while a repair runs); DaemonError 404 unknown, 409 not ready."""
        return self._json("POST", self._snap_path(identity) + "/repair")

    def wait(
        self,
        identity: str,
        state: str = "ready",
        timeout: float | None = None,
        *,
        poll: float = 30.0,
        on_update: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        """Block until snapshot ``identity`` reaches ``state``; return its ``<snapshot>``.

        Loops over ``GET /v1/snapshots/{identity}/wait`` (long-poll of at most ``poll`` seconds).

        Args:
            state: one of queued, downloading, applying, verifying, ready, failed.
            timeout: overall seconds to wait; ``None`` waits for ever.
            poll: seconds per long-poll (small values make ``on_update`` fire often).
            on_update: called with the latest ``<snapshot>`` after every long-poll that ended
                before the state was reached (progress bars).

        Raises:
            SnapshotFailed: the snapshot failed (``.reason``, ``.snapshot``).
            TimeoutError: ``timeout`` elapsed first.
            DaemonError: e.g. 404 when the daemon does not know the identity.
        """
        if state not in STATES:
            raise ValueError(f"state {state!r} is not one of {', '.join(STATES)}")
        if not (poll > 0 and math.isfinite(poll)):
            raise ValueError(f"poll must be a positive number of seconds, got {poll!r}")
        if timeout is not None and not (timeout >= 0 and math.isfinite(timeout)):
            raise ValueError(f"timeout must be a non-negative number of seconds, got {timeout!r}")
        base = self._snap_path(identity) + "/wait?"
        deadline = None if timeout is None else time.monotonic() + timeout
        snap: dict[str, Any] = {}
        while True:
            this_poll = min(poll, MAX_WAIT_POLL)
            if deadline is not None:
                this_poll = min(this_poll, max(0.0, deadline - time.monotonic()))
            query = urlencode({"state": state, "timeout": f"{this_poll:.3f}"})
            sent = time.monotonic()
            r = self._request("GET", base + query, ok=(200, 202, 409), timeout=this_poll + self.timeout)
            if r.status == 409:
                message, obj = error_message(409, r.body)
                snap_obj = obj.get("snapshot") if isinstance(obj, dict) else None
                snap_obj = snap_obj if isinstance(snap_obj, dict) else None
                if state == "failed" and snap_obj is not None:
                    return snap_obj
                raise SnapshotFailed(message, snap_obj)
            obj = r.json()
            if not isinstance(obj, dict):
                raise ProtocolError(f"wait for {identity}: expected a JSON object, got {type(obj).__name__}")
            snap = obj
            if r.status == 200:
                return snap
            if on_update is not None:
                on_update(snap)
            # A daemon that answers 202 at once (ignoring the long-poll) must not make this a
            # busy loop.
            floor = min(this_poll, 0.05) - (time.monotonic() - sent)
            if floor > 0:
                time.sleep(floor)
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"{identity} not {state} after {timeout:g} s (state {snap.get('state', '?')})")

    def _reason(self, identity: str) -> str:
        """The daemon's current reason for ``identity`` ("" when it has none or is unreachable)."""
        try:
            return str(self.snapshot(identity).get("reason") or "")
        except BdnError:
            return ""

    def list_files(self, identity: str) -> list[dict[str, Any]]:
        """``GET /v1/snapshots/{identity}/files``: ``[{"path", "size"}]`` of a ready snapshot.

        ``size`` is the rebuilt file's, in bytes (a delta's result, not its diff file). Raises
        DaemonError (404 unknown identity, 409 not ready) or ProtocolError for a malformed answer.
        """
        files = self._json("GET", self._snap_path(identity) + "/files").get("files")
        if not isinstance(files, list) or not all(isinstance(f, dict) for f in files):
            raise ProtocolError(f"files of {identity}: 'files' is not a list of objects")
        return files

    def read_file(self, identity: str, path: str, offset: int = 0, length: int | None = None) -> bytes:
        """Bytes ``[offset, offset+length)`` of file ``path`` of a ready snapshot (HTTP Range).

        ``length=None`` reads to the end of the file. Raises DaemonError (404 no such file, 409 not
        ready, 416 range outside the file) or ProtocolError if the answer is not that range.
        """
        if offset < 0 or (length is not None and length < 0):
            raise ValueError(f"offset and length must be >= 0, got {offset}, {length}")
        if length == 0:
            return b""
        url = self._snap_path(identity) + "/files/" + quote(validate_relpath(path), safe="/")
        headers: dict[str, str] = {}
        if offset or length is not None:
            end = "" if length is None else str(offset + length - 1)
            headers["Range"] = f"bytes={offset}-{end}"

        def alloc(n: int, h: dict[str, str]) -> bytearray:
            if length is not None and n > length:
                raise ProtocolError(f"daemon sent {n} bytes for a range of {length}")
            return bytearray(n)

        status, h, body = self.http.get_into(url, headers, alloc)
        if status not in (200, 206):
            raise DaemonError(status, error_message(status, body)[0])
        if headers and status != 206:
            raise ProtocolError(f"daemon ignored Range for {identity}/{path} (HTTP {status})")
        if status == 206:
            content_range = h.get("content-range", "")
            if not content_range.startswith(f"bytes {offset}-"):
                raise ProtocolError(f"daemon sent Content-Range {content_range[:80]!r} for offset {offset}")
        return bytes(body)

    def read_tensor(self, identity: str, name: str) -> np.ndarray:
        """Tensor ``name`` of a ready snapshot, pulled over HTTP into a new writable array.

        dtype and shape come from the ``X-BDN-Dtype``/``X-BDN-Shape`` headers (safetensors dtype
        names; bf16 as ``ml_dtypes.bfloat16``); the body is the little-endian C-order bytes,
        copied into the array as they arrive. A 0-element tensor is an empty array of its shape.
        Raises DaemonError (404 no such tensor, 409 not ready) or ProtocolError if the headers and
        the body disagree.
        """
        if not isinstance(name, str) or not name:
            raise ValueError("tensor name must be a non-empty string")
        url = self._snap_path(identity) + "/tensors/" + quote(name, safe="")
        meta: dict[str, Any] = {}

        def alloc(n: int, h: dict[str, str]) -> np.ndarray:
            dtype_str = h.get("x-bdn-dtype") or ""
            try:
                dtype = np.dtype(numpy_dtype(dtype_str))
            except BdnError as exc:
                raise ProtocolError(f"tensor {name!r}: X-BDN-Dtype: {exc}") from None
            shape = pull.parse_shape(h.get("x-bdn-shape"), name)
            nbytes = math.prod(shape) * dtype.itemsize
            if n != nbytes:
                raise ProtocolError(f"tensor {name!r}: {n} bytes sent, {dtype_str} {list(shape)} needs {nbytes}")
            meta.update(dtype=dtype, shape=shape)
            return np.empty(nbytes, dtype=np.uint8)

        status, _h, out = self.http.get_into(url, {}, alloc)
        if status != 200:
            raise DaemonError(status, error_message(status, out)[0])
        dtype, shape = meta["dtype"], meta["shape"]
        return out.view(dtype).reshape(shape)

    def read_file_into(self, identity: str, path: str, out: Any, offset: int = 0, *, connections: int = 1) -> int:
        """Fill the writable buffer ``out`` with bytes ``[offset, offset + out.nbytes)`` of file
        ``path`` (in ``connections`` parallel ranges); returns the byte count. For a buffer the
        caller reuses: no new object, no fresh pages per call. See ``bdn.client.pull``."""
        return pull.read_file_into(self.http, identity, path, out, offset, connections=connections)

    def read_tensor_into(self, identity: str, name: str, out: Any) -> np.ndarray:
        """Fill the writable buffer ``out`` (exactly the tensor's bytes) with tensor ``name``;
        returns ``out`` viewed with the tensor's dtype and shape. See ``bdn.client.pull``."""
        return pull.read_tensor_into(self.http, identity, name, out)

    def open(self, identity: str, wait: bool = True, timeout: float | None = None) -> Snapshot:
        """Open snapshot ``identity`` from the directory the daemon reports (same host only).

        With ``wait`` (the default) this fetches the snapshot if needed and blocks until it is
        ready: a snapshot the daemon does not know yet, or whose earlier load failed, is
        prefetched first (``POST .../prefetch?wait_publish=1``, so the daemon waits for it if it
        is not published yet), then waited for, all
        within ``timeout`` seconds (``None``: for ever; the daemon looks for the publication no
        longer either); ``wait()``'s errors apply (TimeoutError, SnapshotFailed), and a snapshot
        nobody published within ``timeout`` raises NotPublished (a TimeoutError: "<identity> is
        not published yet (waited N s): <reason>"). Without ``wait``, raise DaemonError 404 if the daemon does not know it
        and 409 unless it is ready now. Raises ProtocolError if the directory is not a valid
        snapshot or holds another identity.
        """
        if wait:
            started = time.monotonic()
            deadline = None if timeout is None else started + timeout
            try:
                snap: dict[str, Any] | None = self.snapshot(identity)
            except DaemonError as exc:
                if exc.status != 404:
                    raise
                snap = None
            if snap is None or snap.get("state") in ("failed", "queued"):
                # unknown here, or failed before (not published yet then, a bucket outage): ask
                # for it again, as ``bdnctl prefetch --wait`` does; a failure that is still true
                # (a malformed delta) fails again and is raised below. The daemon looks for the
                # publication no longer than this call waits (``publish_timeout``).
                snap = self.prefetch(identity, wait_publish=True, publish_timeout=timeout)
            try:
                if snap.get("state") not in TERMINAL:
                    left = None if deadline is None else max(0.0, deadline - time.monotonic())
                    snap = self.wait(identity, "ready", left)
                elif snap.get("state") == "failed":
                    raise SnapshotFailed(str(snap.get("reason") or "failed"), snap)
            except (TimeoutError, SnapshotFailed) as exc:
                # say what was missing, not only that the time ran out
                reason = exc.reason if isinstance(exc, SnapshotFailed) else self._reason(identity)
                if reason and "not published yet" in reason:
                    raise NotPublished(identity, time.monotonic() - started, reason) from None
                raise
        else:
            snap = self.snapshot(identity)
        if snap.get("state") != "ready":
            raise DaemonError(409, f"{identity} is not ready (state {str(snap.get('state'))[:40]})")
        path = snap.get("path")
        if not isinstance(path, str) or not path:
            raise ProtocolError(f"daemon reports {identity} ready without a path")
        opened = open_snapshot(path)
        if opened.identity != identity:
            opened.close()
            raise ProtocolError(f"{path} holds snapshot {opened.identity}, not {identity}")
        return opened
