"""Signed requests to other daemons of the swarm (the peer protocol of DESIGN.md).

Each request is signed for the node id of the daemon it goes to (FORMATS.md, "Keys and
signatures"): the one that daemon named in its last ``X-BDN-Node`` answer, else the one
membership knows for its URL (``node_of``), else ``-``. A 401 that names another node id (the
daemon behind that URL is not who this client thought, or was not known) is answered by signing
the request again, once, for the daemon named.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import msgpack
from yarl import URL

from bdn.control.replay import Counters
from bdn.daemon.observe.bodies import BodyTooLarge, read_body
from bdn.daemon.observe.packing import packb
from bdn.proto.keys import NODE_HEADER, NODE_ID_RE, UNKNOWN_TARGET, SwarmKeys, sign_request


class PeerError(Exception):
    """A peer could not be reached or broke the protocol (message says how)."""


def why(e: BaseException) -> str:
    """A transport error in words, without Python reprs (aiohttp's connect errors embed the
    address tuple: ``[Connect call failed ('127.0.0.1', 7080)]``)."""
    if isinstance(e, aiohttp.ClientConnectorError):
        os_err = e.os_error
        if isinstance(os_err, OSError) and os_err.errno:
            reason = os.strerror(os_err.errno)  # asyncio's strerror repeats the address tuple
        else:
            reason = type(os_err).__name__
        return f"cannot connect to {e.host}:{e.port}: {reason}"
    if isinstance(e, asyncio.TimeoutError):
        return "timed out"
    text = str(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


MAX_HAVE_BYTES = 64 << 20
MAX_MEMBERS_BYTES = 4 << 20
MAX_NAMED = 8192  # peer URLs whose self-named node id is remembered


class PeerClient:
    """One aiohttp session for every peer; each request signed with the partition's auth key."""

    def __init__(
        self,
        keys: SwarmKeys,
        node_id: str,
        timeout_s: float = 60.0,
        node_of: Callable[[str], str] | None = None,
        keepalive_s: float = 5.0,
    ) -> None:
        """``node_of(base_url)`` is the node id membership knows for a peer URL ("" if none).
        ``keepalive_s``: how long an idle connection is kept for reuse, below the peers' own
        keep-alive (``http_header_timeout_s``, ``bdn/daemon/http/guard.py``), so that a request
        (a POST is not retried) never goes out on a connection the peer is closing."""
        self.keys = keys
        self.keepalive_s = keepalive_s
        self.node_id = node_id
        self.timeout_s = timeout_s
        self.node_of = node_of or (lambda url: "")
        self._named: dict[str, str] = {}  # base URL -> node id the daemon there named itself (bounded)
        self._session: aiohttp.ClientSession | None = None  # members, have, hot-load, status
        # Nonces numbered per target (FORMATS.md, "Keys and signatures"): the verifier's replay
        # window then sees dense counters. (Chunks move over the transfer wire, not here.)
        self._nonces = Counters(time.time)

    async def start(self) -> None:
        """Open the HTTP session to peers (inside the running loop)."""
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=64, limit_per_host=4, ttl_dns_cache=10, keepalive_timeout=self.keepalive_s
            ),
            auto_decompress=False,
        )

    async def close(self) -> None:
        """Close the session and its connections."""
        if self._session is not None:
            await self._session.close()

    def _prefix(self) -> str:
        return f"/bdn/v1/{self.keys.swarm_id}"

    async def _request(
        self,
        method: str,
        base_url: str,
        path_qs: str,
        *,
        timeout: float,
        data: bytes | None = None,
    ) -> aiohttp.ClientResponse:
        session = self._session
        assert session is not None
        for first in (True, False):
            to = self.target_of(base_url)
            nonce = self._nonces.next(to, 0)
            headers = {"Authorization": sign_request(self.keys, method, path_qs, self.node_id, to=to, nonce=nonce)}
            if data is not None:
                headers["Content-Type"] = "application/msgpack"
            try:
                resp = await session.request(
                    method,
                    URL(base_url + path_qs, encoded=True),
                    headers=headers,
                    data=data,
                    timeout=aiohttp.ClientTimeout(total=timeout, sock_connect=5),
                )
            except (TimeoutError, aiohttp.ClientError, OSError) as e:
                raise PeerError(f"{base_url}: {why(e)}") from None
            named = resp.headers.get(NODE_HEADER, "") if resp.status == 401 else ""
            if first and named != to and NODE_ID_RE.match(named):
                # signed for someone else: the daemon at this URL says who it is; sign for it
                resp.release()
                self._learn(base_url, named)
                continue
            return resp
        raise AssertionError("unreachable")

    def target_of(self, base_url: str) -> str:
        """The node id a request to ``base_url`` is signed for."""
        return self._named.get(base_url) or self.node_of(base_url) or UNKNOWN_TARGET

    def _learn(self, base_url: str, node_id: str) -> None:
        if len(self._named) >= MAX_NAMED and base_url not in self._named:
            self._named.pop(next(iter(self._named)))
        self._named[base_url] = node_id

    @contextlib.asynccontextmanager
    async def _answer(
        self,
        method: str,
        base_url: str,
        path_qs: str,
        what: str,
        *,
        timeout: float,
        data: bytes | None = None,
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """One signed request whose answer the caller reads inside the ``async with``: transport
        and decoding errors become one PeerError (``"<url>: <what><why>"``), and the answer is
        always released (the one copy of this try/except/finally for every peer request)."""
        resp = await self._request(method, base_url, path_qs, timeout=timeout, data=data)
        try:
            yield resp
        except (TimeoutError, aiohttp.ClientError, ValueError, msgpack.UnpackException, BodyTooLarge) as e:
            raise PeerError(f"{base_url}: {what}{why(e)}") from None
        finally:
            resp.release()

    async def get_have(
        self, base_url: str, identity: str, *, since: int = -1, wait: float = 0.0
    ) -> dict[str, Any] | None:
        """A peer's have-bitfields for ``identity`` (None if it does not know the snapshot)."""
        q = f"?since={since}&wait={wait:g}"
        path = f"{self._prefix()}/snapshots/{identity}/have{q}"
        async with self._answer("GET", base_url, path, "bad have answer: ", timeout=wait + self.timeout_s) as resp:
            if resp.status == 404:
                return None
            if resp.status != 200:
                raise PeerError(f"{base_url}: have request answered {resp.status}")
            body = await read_body(resp.content, MAX_HAVE_BYTES, resp.content_length)
            obj = msgpack.unpackb(body, raw=False)
            if not isinstance(obj, dict):
                raise PeerError(f"{base_url}: have answer is not a map")
            return obj

    async def exchange_members(self, base_url: str, payload: dict[str, Any]) -> dict[str, Any]:
        """POST our member view; returns the peer's ``{node_id, url, members: [...]}``."""
        path = f"{self._prefix()}/members"
        data = packb(payload)
        async with self._answer("POST", base_url, path, "bad members answer: ", timeout=5.0, data=data) as resp:
            if resp.status != 200:
                raise PeerError(f"{base_url}: members answered {resp.status}")
            body = await read_body(resp.content, MAX_MEMBERS_BYTES, resp.content_length)
            obj = msgpack.unpackb(body, raw=False)
            if not isinstance(obj, dict) or not isinstance(obj.get("node_id"), str):
                raise PeerError(f"{base_url}: members answer malformed")
            return obj

    async def post_json(self, base_url: str, path: str, payload: bytes, timeout: float = 10.0) -> tuple[int, bytes]:
        """A signed POST of a msgpack body to a peer endpoint under the swarm prefix."""
        async with self._answer(
            "POST", base_url, f"{self._prefix()}/{path}", "", timeout=timeout, data=payload
        ) as resp:
            return resp.status, await read_body(resp.content, MAX_MEMBERS_BYTES, resp.content_length)

    async def get_json(self, base_url: str, path: str, timeout: float = 5.0) -> tuple[int, Any]:
        """A signed GET of a JSON peer endpoint under the swarm prefix: ``(status, body)``."""
        async with self._answer("GET", base_url, f"{self._prefix()}/{path}", "", timeout=timeout) as resp:
            body = await read_body(resp.content, MAX_MEMBERS_BYTES, resp.content_length)
            try:
                return resp.status, json.loads(body)
            except (ValueError, RecursionError):
                return resp.status, None
