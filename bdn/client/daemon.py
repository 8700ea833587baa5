"""``DaemonClient``: a synchronous client of bdnd's local API.

The API is described in README.md ("Local API") (and DESIGN.md, "Surfaces"). Serving processes
are often threaded rather than asyncio, so this client is blocking and uses only the stdlib
``http.client`` (no new dependency): one keep-alive connection per thread, reopened once when the
daemon has closed an idle one.

Base URLs: ``http://host:port`` (default ``http://127.0.0.1:7081``, optionally with a path prefix)
or ``unix:///path/to.sock`` for the daemon's unix socket.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

import numpy as np

from bdn.client.errors import DaemonError, DaemonUnreachable, SnapshotFailed, one_line
from bdn.client.snapshot import Snapshot, open_snapshot
from bdn.proto.errors import BdnError, ProtocolError
from bdn.proto.identity import validate_identity, validate_relpath
from bdn.proto.safetensors_fmt import numpy_dtype

DEFAULT_URL = "http://127.0.0.1:7081"
STATES = ("queued", "downloading", "applying", "verifying", "ready", "failed")
MAX_WAIT_POLL = 300.0  # the daemon caps one long-poll at 300 s
MAX_JSON_BYTES = 64 << 20
MAX_NDIM = 64
_UINT_RE = re.compile(r"[0-9]{1,19}")


class _UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP/1.1 over a unix stream socket (``Host: localhost``)."""

    def __init__(self, socket_path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = socket_path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self.socket_path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


class _Response:
    """Status, headers and (for small answers) the body of one finished request."""

    def __init__(self, status: int, headers: http.client.HTTPMessage, body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    def json(self) -> Any:
        try:
            return json.loads(self.body)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ProtocolError(f"daemon answered HTTP {self.status} with invalid JSON ({exc})") from None


def _error_message(status: int, body: bytes) -> tuple[str, Any]:
    """The daemon's ``{"error": ...}`` line (or the body's first line) and the parsed JSON."""
    try:
        obj = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        text = body[:1000].decode("utf-8", "replace")
        return (one_line(text) or f"HTTP {status}"), None
    if isinstance(obj, dict) and isinstance(obj.get("error"), str):
        return obj["error"], obj
    return f"HTTP {status}", obj


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
    Thread-safe: each thread gets its own connection.
    """

    def __init__(self, url: str = DEFAULT_URL, timeout: float = 30.0) -> None:
        parts = urlsplit(url)
        if parts.scheme == "http":
            if not parts.hostname:
                raise ValueError(f"daemon URL {url!r} has no host")
            try:
                port = parts.port or 80
            except ValueError:
                raise ValueError(f"daemon URL {url!r} has a bad port") from None
            self._host: str | None = parts.hostname
            self._port = port
            self._socket_path: str | None = None
            self._prefix = parts.path.rstrip("/")
        elif parts.scheme == "unix":
            if parts.netloc or not parts.path:
                raise ValueError(f"daemon URL {url!r} must look like unix:///path/to.sock")
            self._host, self._port, self._socket_path, self._prefix = None, 0, parts.path, ""
        else:
            raise ValueError(f"daemon URL {url!r} must start with http:// or unix://")
        if not (timeout > 0 and math.isfinite(timeout)):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.url = url
        self.timeout = float(timeout)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._conns: set[http.client.HTTPConnection] = set()

    # -- transport -----------------------------------------------------------------------------

    def _new_conn(self, timeout: float) -> http.client.HTTPConnection:
        if self._socket_path is not None:
            conn: http.client.HTTPConnection = _UnixHTTPConnection(self._socket_path, timeout)
        else:
            assert self._host is not None
            conn = http.client.HTTPConnection(self._host, self._port, timeout=timeout)
        with self._lock:
            self._conns.add(conn)
        return conn

    def _drop_conn(self) -> None:
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            conn.close()
            with self._lock:
                self._conns.discard(conn)

    def _send(
        self, method: str, path: str, headers: dict[str, str] | None, timeout: float
    ) -> http.client.HTTPResponse:
        """Send a request and return the response with its body unread (caller must read it)."""
        target = self._prefix + path
        hdrs = {"Accept": "application/json", **(headers or {})}
        for attempt in (0, 1):
            conn = getattr(self._local, "conn", None)
            reused = conn is not None
            if conn is None:
                conn = self._local.conn = self._new_conn(timeout)
            try:
                conn.timeout = timeout
                if conn.sock is not None:
                    conn.sock.settimeout(timeout)
                conn.request(method, target, headers=hdrs)
                return conn.getresponse()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as exc:
                self._drop_conn()
                # The daemon may close an idle keep-alive connection at any moment; only a fresh
                # connection failing means the daemon is gone.
                if reused and attempt == 0:
                    continue
                raise DaemonUnreachable(self.url, str(exc) or type(exc).__name__) from None
            except TimeoutError:
                self._drop_conn()
                raise DaemonUnreachable(self.url, f"no answer within {timeout:g} s") from None
            except (OSError, http.client.HTTPException) as exc:
                self._drop_conn()
                reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
                raise DaemonUnreachable(self.url, reason) from None
        raise AssertionError("unreachable")

    @contextlib.contextmanager
    def _reading(self, timeout: float) -> Iterator[None]:
        """Map errors while a response body is read: the connection is dropped on any of them,
        a stall or socket error becomes DaemonUnreachable (one line), others pass through."""
        try:
            yield
        except TimeoutError:
            self._drop_conn()
            raise DaemonUnreachable(self.url, f"answer stalled for {timeout:g} s") from None
        except (OSError, http.client.HTTPException) as exc:
            self._drop_conn()
            raise DaemonUnreachable(self.url, getattr(exc, "strerror", None) or str(exc) or type(exc).__name__) from None
        except BaseException:
            self._drop_conn()
            raise

    def _read_body(self, resp: http.client.HTTPResponse, limit: int, timeout: float) -> bytes:
        with self._reading(timeout):
            length = resp.getheader("Content-Length")
            if length is not None and _is_uint(length) and int(length) > limit:
                raise ProtocolError(f"daemon answer of {length} bytes exceeds {limit} bytes")
            body = resp.read(limit + 1)
            if len(body) > limit:
                raise ProtocolError(f"daemon answer exceeds {limit} bytes")
            if not resp.isclosed():
                resp.read()  # drain so the connection can be reused
            if resp.will_close:
                self._drop_conn()
            return body

    def _request(
        self,
        method: str,
        path: str,
        *,
        ok: tuple[int, ...] = (200,),
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> _Response:
        """One request whose answer is small; raises DaemonError for a status not in ``ok``."""
        t = self.timeout if timeout is None else timeout
        resp = self._send(method, path, headers, t)
        body = self._read_body(resp, MAX_JSON_BYTES, t)
        r = _Response(resp.status, resp.headers, body)
        if r.status not in ok:
            message, _obj = _error_message(r.status, body)
            raise DaemonError(r.status, message)
        return r

    def _json(self, method: str, path: str, ok: tuple[int, ...] = (200,)) -> dict[str, Any]:
        obj = self._request(method, path, ok=ok).json()
        if not isinstance(obj, dict):
            raise ProtocolError(f"{method} {path}: expected a JSON object, got {type(obj).__name__}")
        return obj

    def close(self) -> None:
        """Close every connection this client opened (it reconnects if used again)."""
        with self._lock:
            conns, self._conns = self._conns, set()
        for conn in conns:
            conn.close()
        self._local = threading.local()

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
        """``GET /v1/snapshots``: every snapshot this daemon knows, as ``<snapshot>`` objects."""
        snaps = self._json("GET", "/v1/snapshots").get("snapshots")
        if not isinstance(snaps, list) or not all(isinstance(s, dict) for s in snaps):
            raise ProtocolError("GET /v1/snapshots: 'snapshots' is not a list of objects")
        return snaps

    def snapshot(self, identity: str) -> dict[str, Any]:
        """``GET /v1/snapshots/{identity}``; DaemonError 404 if the daemon does not know it."""
        return self._json("GET", self._snap_path(identity))

    def prefetch(self, identity: str) -> dict[str, Any]:
        """``POST /v1/snapshots/{identity}/prefetch``: start fetching; returns the ``<snapshot>``.

        The daemon waits for ``bdn.manifest.json`` if the snapshot is not published yet.
        """
        return self._json("POST", self._snap_path(identity) + "/prefetch", ok=(200, 202))

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
            r = self._request(
                "GET", base + query, ok=(200, 202, 409), timeout=this_poll + self.timeout
            )
            if r.status == 409:
                message, obj = _error_message(409, r.body)
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
                raise TimeoutError(
                    f"{identity} not {state} after {timeout:g} s (state {snap.get('state', '?')})"
                )

    def list_files(self, identity: str) -> list[dict[str, Any]]:
        """``GET /v1/snapshots/{identity}/files``: ``[{"path", "size"}]`` of a ready snapshot."""
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
        resp = self._send("GET", url, headers, self.timeout)
        if resp.status not in (200, 206):
            body = self._read_body(resp, MAX_JSON_BYTES, self.timeout)
            raise DaemonError(resp.status, _error_message(resp.status, body)[0])
        if headers and resp.status != 206:
            self._read_and_drop(resp)
            raise ProtocolError(f"daemon ignored Range for {identity}/{path} (HTTP {resp.status})")
        if resp.status == 206:
            content_range = resp.getheader("Content-Range", "")
            if not content_range.startswith(f"bytes {offset}-"):
                self._read_and_drop(resp)
                raise ProtocolError(f"daemon sent Content-Range {content_range[:80]!r} for offset {offset}")
        size = resp.getheader("Content-Length")
        if size is None or not _is_uint(size):
            self._read_and_drop(resp)
            raise ProtocolError(f"daemon sent no Content-Length for {identity}/{path}")
        n = int(size)
        if length is not None and n > length:
            self._read_and_drop(resp)
            raise ProtocolError(f"daemon sent {n} bytes for a range of {length}")
        return self._read_body(resp, n, self.timeout)

    def _read_and_drop(self, resp: http.client.HTTPResponse) -> None:
        """Abandon a response whose body we will not read: the connection cannot be reused."""
        resp.close()
        self._drop_conn()

    def read_tensor(self, identity: str, name: str) -> np.ndarray:
        """Tensor ``name`` of a ready snapshot, pulled over HTTP into a new writable array.

        dtype and shape come from the ``X-BDN-Dtype``/``X-BDN-Shape`` headers (safetensors dtype
        names; bf16 as ``ml_dtypes.bfloat16``); the body is the little-endian C-order bytes,
        received straight into the array's memory. Raises DaemonError (404 no such tensor, 409 not
        ready) or ProtocolError if the headers and the body disagree.
        """
        if not isinstance(name, str) or not name:
            raise ValueError("tensor name must be a non-empty string")
        url = self._snap_path(identity) + "/tensors/" + quote(name, safe="")
        resp = self._send("GET", url, None, self.timeout)
        if resp.status != 200:
            body = self._read_body(resp, MAX_JSON_BYTES, self.timeout)
            raise DaemonError(resp.status, _error_message(resp.status, body)[0])
        try:
            dtype_str = resp.getheader("X-BDN-Dtype") or ""
            try:
                dtype = np.dtype(numpy_dtype(dtype_str))
            except BdnError as exc:
                raise ProtocolError(f"tensor {name!r}: X-BDN-Dtype: {exc}") from None
            shape = _parse_shape(resp.getheader("X-BDN-Shape"), name)
            count = math.prod(shape)
            nbytes = count * dtype.itemsize
            size = resp.getheader("Content-Length")
            if size is None or not _is_uint(size) or int(size) != nbytes:
                raise ProtocolError(
                    f"tensor {name!r}: {size} bytes sent, {dtype_str} {list(shape)} needs {nbytes}"
                )
        except BaseException:
            self._read_and_drop(resp)
            raise
        out = np.empty(nbytes, dtype=np.uint8)
        self._read_into(resp, memoryview(out), name)
        return out.view(dtype).reshape(shape)

    def _read_into(self, resp: http.client.HTTPResponse, buf: memoryview, name: str) -> None:
        with self._reading(self.timeout):
            got = 0
            while got < len(buf):
                n = resp.readinto(buf[got:])
                if not n:
                    raise ProtocolError(f"tensor {name!r}: body ended after {got} of {len(buf)} bytes")
                got += n
            if resp.will_close:
                self._drop_conn()

    def open(self, identity: str, wait: bool = True, timeout: float | None = None) -> Snapshot:
        """Open snapshot ``identity`` from the directory the daemon reports (same host only).

        With ``wait`` (the default) block until it is ready (``wait()``'s errors apply); without,
        raise DaemonError 409 unless it is ready now. Raises ProtocolError if the directory is
        not a valid snapshot or holds another identity.
        """
        snap = self.wait(identity, "ready", timeout) if wait else self.snapshot(identity)
        if snap.get("state") != "ready":
            raise DaemonError(409, f"{identity} is {str(snap.get('state'))[:40]}, not ready")
        path = snap.get("path")
        if not isinstance(path, str) or not path:
            raise ProtocolError(f"daemon reports {identity} ready without a path")
        opened = open_snapshot(path)
        if opened.identity != identity:
            opened.close()
            raise ProtocolError(f"{path} holds snapshot {opened.identity}, not {identity}")
        return opened


def _is_uint(text: str) -> bool:
    # str.isdigit() also accepts digits int() refuses (e.g. superscripts).
    return _UINT_RE.fullmatch(text) is not None


def _parse_shape(header: str | None, name: str) -> tuple[int, ...]:
    if header is None:
        raise ProtocolError(f"tensor {name!r}: no X-BDN-Shape header")
    text = header.strip()
    if not text:
        return ()
    parts = text.split(",")
    if len(parts) > MAX_NDIM or not all(_is_uint(p.strip()) for p in parts):
        raise ProtocolError(f"tensor {name!r}: bad X-BDN-Shape {header[:80]!r}")
    return tuple(int(p) for p in parts)
