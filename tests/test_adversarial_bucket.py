"""A bucket that misbehaves, in front of a real S3 API server (moto) and a real bdnd: chunk reads
answered with a redirect to a server handing out other bytes, with a header too large to parse,
with bursts of 500/503/429, or with a body that trickles in a few bytes at a time.

What must hold: the snapshot ends ``ready`` with the trainer's bytes (or ``failed`` with one line
naming what the bucket did), no redirect is followed to other bytes, and the daemon keeps serving.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from aiohttp import web

from support.checkpoints import publish_state
from support.s3server import S3Proxy
from support.swarm import Daemon, running

pytestmark = pytest.mark.timeout(300)
IDENT = "step000001"
CHUNK = 64 << 10


class BadBucket(S3Proxy):
    """S3Proxy whose next ranged GETs (chunk reads) get one of the faults queued with ``next``:
    ``redirect`` (307 to ``evil``), ``huge_header`` (a 206 whose one header is 200 KB), or
    ``trickle`` (the real 206, its body sent ``piece`` bytes every ``every`` s)."""

    def __init__(self, upstream: str, evil: str = "") -> None:
        super().__init__(upstream)
        self.evil = evil
        self.queue: list[str] = []
        self.hit: list[str] = []
        self.piece, self.every = 64, 0.5

    def next(self, n: int, kind: str) -> None:
        with self._lock:
            self.queue += [kind] * n

    async def _answer(self, request: web.Request, record, finished):  # type: ignore[no-untyped-def]
        kind = None
        if request.method == "GET" and record.range:
            with self._lock:
                if self.queue:
                    kind = self.queue.pop(0)
                    self.hit.append(kind)
        if kind == "redirect":
            record.injected, record.status = True, 307
            return web.Response(status=307, headers={"Location": self.evil + request.raw_path})
        if kind == "huge_header":
            record.injected, record.status = True, 206
            return web.Response(
                status=206, body=b"x" * 16, headers={"X-Amz-Meta-Junk": "j" * 200_000, "Content-Range": "bytes 0-15/16"}
            )
        if kind == "trickle":
            return await self._trickle(request, record, finished)
        return await super()._answer(request, record, finished)

    async def _trickle(self, request: web.Request, record, finished):  # type: ignore[no-untyped-def]
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "connection")}
        async with self._session.get(self.upstream + request.raw_path, headers=headers) as up:
            body = await up.read()
            resp = web.StreamResponse(status=up.status)
            for k in ("Content-Range", "ETag", "Last-Modified", "Content-Type"):
                if k in up.headers:
                    resp.headers[k] = up.headers[k]
            resp.content_length = len(body)
            record.status = up.status
            await resp.prepare(request)
            try:
                for i in range(0, len(body), self.piece):
                    await resp.write(body[i : i + self.piece])
                    record.response_bytes += len(body[i : i + self.piece])
                    await asyncio.sleep(self.every)
                await resp.write_eof()
            except ConnectionError:  # the daemon gave up on it (or stopped)
                record.truncated = True
            return resp


class Evil:
    """A plain HTTP server answering every GET with 206 and bytes that are not the object's."""

    def __init__(self) -> None:
        self.proxy = S3Proxy("http://127.0.0.1:1")  # only for its thread and loop
        self.gets = 0

    def start(self) -> Evil:
        async def answer(request: web.Request) -> web.Response:
            self.gets += 1
            return web.Response(
                status=206, body=b"E" * CHUNK, headers={"Content-Range": f"bytes 0-{CHUNK - 1}/{CHUNK}"}
            )

        async def startup() -> None:
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", answer)
            self.proxy._runner = web.AppRunner(app, access_log=None, handle_signals=False)
            await self.proxy._runner.setup()
            site = web.TCPSite(self.proxy._runner, "127.0.0.1", 0)
            await site.start()
            self.proxy._port = self.proxy._runner.addresses[0][1]

        self.proxy._startup = startup  # type: ignore[method-assign]
        self.proxy.start()
        return self

    @property
    def url(self) -> str:
        return self.proxy.url

    def stop(self) -> None:
        self.proxy.stop()


def _load_through(
    tmp_path: Path,
    s3_bucket: tuple[str, str],
    proxy: BadBucket,
    faults: list[tuple[int, str]],
    extra_env: dict[str, str] | None = None,
    settle_s: float = 180,
) -> tuple[dict, Path, Daemon]:
    bucket, endpoint = s3_bucket
    _, ck = publish_state(tmp_path, bucket, IDENT, 1, scale=2, chunk_size=CHUNK, endpoint=endpoint)
    env = {"BDN_LOAD_STARTUP": "false", "BDN_ENDPOINT_URL": proxy.url, **(extra_env or {})}
    d = Daemon(tmp_path / "nodes", "node0", bucket, extra_env=env)
    with running(d):
        for n, kind in faults:
            proxy.next(n, kind)
        assert d.prefetch(IDENT)[0] == 202
        rec = d.wait_settled(IDENT, settle_s)
        assert d.get("/v1/health")["status"] == "ok"
        assert "Traceback" not in d.log(), d.log()
        return rec, ck, d


def _identical(rec: dict, ck: Path) -> None:
    assert rec["state"] == "ready", (rec.get("reason"), rec)
    got = Path(rec["path"])
    for f in ck.iterdir():
        assert (got / f.name).read_bytes() == f.read_bytes(), f.name


def test_a_redirect_to_other_bytes_is_never_followed(tmp_path: Path, s3_bucket: tuple[str, str]) -> None:
    evil = Evil().start()
    proxy = BadBucket(s3_bucket[1], evil.url).start()
    try:
        rec, ck, _ = _load_through(tmp_path, s3_bucket, proxy, [(6, "redirect")])
    finally:
        proxy.stop()
        evil.stop()
    assert proxy.hit == ["redirect"] * 6
    assert evil.gets == 0  # the redirect was not followed
    _identical(rec, ck)


def test_a_header_too_large_to_parse_is_retried(tmp_path: Path, s3_bucket: tuple[str, str]) -> None:
    proxy = BadBucket(s3_bucket[1]).start()
    try:
        rec, ck, _ = _load_through(tmp_path, s3_bucket, proxy, [(3, "huge_header")])
    finally:
        proxy.stop()
    assert proxy.hit == ["huge_header"] * 3
    _identical(rec, ck)


def test_bursts_of_500_503_and_429_on_every_kind_of_request(tmp_path: Path, s3_bucket: tuple[str, str]) -> None:
    """Not only chunk reads (tests/test_faults.py): the listing, the manifest and the chunks, in
    a burst of 12 errors from the first request on."""
    proxy = BadBucket(s3_bucket[1]).start()
    try:
        proxy.fail_next(4, 503, "SlowDown")
        proxy.fail_next(4, 500, "InternalError")
        proxy.fail_next(4, 429, "TooManyRequests")
        rec, ck, _ = _load_through(tmp_path, s3_bucket, proxy, [])
    finally:
        proxy.stop()
    injected = [r for r in proxy.requests() if r.injected]
    assert len(injected) == 12, [(r.method, r.key, r.status) for r in injected]
    _identical(rec, ck)


@pytest.mark.xfail(
    strict=True,
    reason=(
        "no deadline on a bucket GET's body: botocore's read_timeout (60 s) is per recv, so a body that "
        "trickles in (64 B every 0.5 s) holds its chunk, and the snapshot, for as long as the bucket likes "
        "(seen: 180 s 'downloading' with 2 chunks left). Fix (bdn/bucket/s3_reads.py, review2's): break a "
        "body off below a minimum rate after a grace period and resume it from where it stopped, as for a "
        "broken one"
    ),
)
def test_a_body_that_trickles_in_does_not_hold_the_snapshot_for_ever(
    tmp_path: Path, s3_bucket: tuple[str, str]
) -> None:
    """Two chunk reads answered 64 bytes every 0.5 s (a 64 KiB chunk would take ~8.5 minutes;
    the socket is never silent for the 60 s read timeout). The snapshot must still be ready:
    the slow read is given up and asked again. The 30 s settle wait is this test's only clock
    (a bound on an xfail, so that it costs half a minute, not nine)."""
    proxy = BadBucket(s3_bucket[1]).start()
    try:
        rec, ck, _ = _load_through(tmp_path, s3_bucket, proxy, [(2, "trickle")], settle_s=30)
    finally:
        proxy.stop()
    assert proxy.hit == ["trickle"] * 2
    _identical(rec, ck)
