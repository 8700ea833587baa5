"""A lying swarm peer, as a real process, for the bad-input tests.

It knows the partition secret, so its requests and answers are properly signed and verified. It
behaves as a healthy member (``POST members`` answers correctly) and claims to hold everything:
``GET snapshots/{id}/have`` returns all-bits-set bitfields of the sizes the snapshot's manifest
(read from the bucket) gives.

Chunks move between daemons only over the transfer wire, and so do its lies: it runs a real
``TransferServer`` (advertised as ``transfer`` in its membership answers) whose location for
every chunk it can size is a file of random bytes, so daemons asking it get wrong bytes of the
right length, sent with ``sendfile`` like an honest peer's; only the receiver's digest check
(or, for a snapshot without a manifest, its object check) can catch them. ``--refuse`` answers
every ask BUSY or NOT_HERE instead; ``--trickle-s S`` answers each ask with its DATA header and
then one byte of the body every S seconds (a stalling peer); ``--wire-trickle-s S`` sends each
answer's frame header one byte every S seconds, then random bytes.

Run: ``python tests/support/liar.py --port P --bucket URL --secret-file F [--node-id liar]``.
It prints ``liar listening on <url>`` once it accepts connections. ``Liar`` below starts and stops
that process from a test.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgpack
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: tests/ for support.*

from bdn.bucket import ObjectNotFound, open_bucket
from bdn.control.swim import ALIVE, Message, Update
from bdn.daemon.swarm import gossip
from bdn.daemon.swarm.nonces import NonceCache
from bdn.foreign import read_foreign_table
from bdn.proto import wire
from bdn.proto.errors import AuthError, BdnError
from bdn.proto.identity import validate_identity
from bdn.proto.keys import NODE_HEADER, SwarmKeys, WrongTarget, derive_keys, verify_request
from bdn.proto.manifest import MANIFEST_NAME, Manifest
from bdn.transfer import GRANTED, NOT_HERE, Busy, TransferServer
from support.peerproc import PeerProcess

LIAR_STATE = web.AppKey("liar", object)


class LiarState:
    """What the liar knows: its keys, the bucket, and chunk lengths by swarm address."""

    def __init__(self, keys: SwarmKeys, node_id: str, url: str, bucket_url: str, foreign_chunk_size: int = 0) -> None:
        self.keys = keys
        self.node_id = node_id
        self.url = url
        self.bucket = open_bucket(bucket_url)
        self.nonces = NonceCache()
        self.manifests: dict[str, Manifest] = {}
        self.lengths: dict[str, int] = {}  # swarm address -> chunk length in bytes
        self.members: dict[str, str] = {}  # url -> node id, from POST members
        self.chunks_lied = 0
        self.foreign_chunk_size = foreign_chunk_size  # > 0: derive the table of a full snapshot without a manifest
        self.wire_lied = 0  # the part of chunks_lied sent over the transfer wire
        self.transfer: str | None = None  # "host:port" of its transfer server, if it runs one
        self.junk: Path | None = None  # random bytes the transfer server sends for every chunk
        self.trickle_s = 0.0  # > 0: answer chunks one byte every trickle_s seconds (a stalling peer)
        self.wire_trickle_s = 0.0  # > 0: over the wire, each answer's frame one byte every so often
        self.wire_trickled = 0  # answers trickled so
        #: "" (send random bytes), "busy" or "not_here": refuse every chunk it advertises (BUSY /
        #: NOT_HERE on the wire): a lying or stale have-list
        self.refuse = ""
        self.refused = 0  # chunk requests refused

    def manifest(self, identity: str) -> Manifest | None:
        m = self.manifests.get(identity)
        if m is not None:
            return m
        try:
            m = Manifest.from_json(self.bucket.read(f"{identity}/{MANIFEST_NAME}"), expect_identity=identity)
        except ObjectNotFound:
            if not self.foreign_chunk_size:
                return None
            try:  # as a daemon with require_manifest = false derives it (chunk ids, not digests)
                m = read_foreign_table(
                    self.bucket, identity, chunk_size=self.foreign_chunk_size, policy_version=0
                ).manifest
            except BdnError:
                return None
        except BdnError:
            return None
        self.manifests[identity] = m
        for ref in (*m.stored_chunks(), *m.result_chunks()):
            self.lengths[self.keys.address(ref.digest)] = ref.length
        return m


@web.middleware
async def _auth(request: web.Request, handler):  # type: ignore[no-untyped-def]
    st: LiarState = request.app[LIAR_STATE]  # type: ignore[assignment]
    if request.match_info.get("swarm_id") != st.keys.swarm_id:
        return web.Response(status=401)
    try:
        request["peer"] = verify_request(
            st.keys, request.headers.get("Authorization"), request.method, request.raw_path, st.nonces, me=st.node_id
        )
    except WrongTarget as e:  # as a daemon does: name itself, so members sign again for it
        return web.Response(status=401, headers={NODE_HEADER: e.me})
    except AuthError:
        return web.Response(status=401)
    return await handler(request)


async def post_members(request: web.Request) -> web.Response:
    """Speaks SWIM as a healthy member does (bdn.daemon.swarm.gossip): a sync gets a sync_ack with the
    liar itself (and its transfer address), a ping an ack; it claims every ping_req target alive."""
    st: LiarState = request.app[LIAR_STATE]  # type: ignore[assignment]
    body = msgpack.unpackb(await request.content.read(1 << 20), raw=False)
    try:
        msg, _ = gossip.parse_message(body.get("m") if isinstance(body, dict) else None, request["peer"], st.node_id)
    except BdnError as e:
        return web.Response(status=400, text=str(e))
    for u in msg.updates:
        if u.node == msg.src:
            st.members[gossip.decode_addr(u.addr)[0]] = u.node
    me = Update(st.node_id, ALIVE, 0, gossip.encode_addr(st.url, st.transfer))
    replies = []
    if msg.kind == "sync":
        replies.append(Message("sync_ack", st.node_id, msg.src, updates=(me,)))
    elif msg.kind in ("ping", "ping_req"):
        replies.append(Message("ack", st.node_id, msg.src, seq=msg.seq, updates=(me,)))
    ans = {"node_id": st.node_id, "url": st.url, "m": [gossip.message_wire(r, None) for r in replies]}
    return web.Response(body=msgpack.packb(ans, use_bin_type=True), content_type="application/msgpack")


def _all_set(n: int) -> bytes:
    """A bitfield of ``n`` bits, all set (MSB first; spare bits of the last byte clear)."""
    data = bytearray(b"\xff" * ((n + 7) // 8))
    if n % 8:
        data[-1] = (0xFF00 >> (n % 8)) & 0xFF
    return bytes(data)


async def get_have(request: web.Request) -> web.Response:
    """Holds everything: full bitfields, state ``ready``."""
    return await have_answer(request, "ready", _all_set)


async def have_answer(request: web.Request, state: str, bitfield: Callable[[int], bytes]) -> web.Response:
    """The have answer (msgpack ``{"v", "state", "ns", "stored", "nr", "result"}``) for the snapshot
    of the path, with ``bitfield(n)`` as each layer's bits; 400 for a bad identity, 404 for one
    the bucket has no manifest of. A long-poll (``since=1``) waits ``wait`` s (at most 5)."""
    st: LiarState = request.app[LIAR_STATE]  # type: ignore[assignment]
    identity = request.match_info["identity"]
    try:
        validate_identity(identity)
    except BdnError:
        return web.Response(status=400)
    m = st.manifest(identity)
    if m is None:
        return web.Response(status=404)
    ns = sum(len(f.chunks) for f in m.files)
    nr = sum(len(f.result_chunks) for f in m.files)
    if request.query.get("since") == "1":  # nothing will ever change: honour the long-poll
        await asyncio.sleep(min(float(request.query.get("wait", "0") or 0), 5.0))
    ans = {"v": 1, "state": state, "ns": ns, "stored": bitfield(ns), "nr": nr, "result": bitfield(nr)}
    return web.Response(body=msgpack.packb(ans, use_bin_type=True), content_type="application/msgpack")


async def get_stats(request: web.Request) -> web.Response:
    st: LiarState = request.app[LIAR_STATE]  # type: ignore[assignment]
    return web.json_response(
        {
            "chunks_lied": st.chunks_lied,
            "wire_lied": st.wire_lied,
            "wire_trickled": st.wire_trickled,
            "members": st.members,
            "refused": st.refused,
        }
    )


JUNK_BYTES = 16 << 20  # bdn's default chunk size: no test publishes larger chunks


def start_wire(st: LiarState, junk: Path) -> TransferServer:
    """The liar's transfer server: random bytes of the right length for every chunk it can size."""
    junk.write_bytes(os.urandom(JUNK_BYTES))
    st.junk = junk

    def admit(peer: str, ask: wire.Ask):
        if ask.address not in st.lengths and ask.snapshot:
            try:
                st.manifest(validate_identity(ask.snapshot))
            except BdnError:
                pass
        if st.refuse:
            st.refused += 1
            return Busy(0.2) if st.refuse == "busy" else NOT_HERE
        return GRANTED

    def resolve(address: str):
        n = st.lengths.get(address)
        if n is None or n > JUNK_BYTES:
            return None
        st.chunks_lied += 1
        st.wire_lied += 1
        return str(junk), 0, n

    server = TransferServer(st.keys, st.node_id, resolve, admit=admit)
    if st.wire_trickle_s > 0:
        server._answers.answer = _trickler(st)  # type: ignore[method-assign]  # the liar's own answers
    elif st.trickle_s > 0:
        server._answers.answer = _staller(st)  # type: ignore[method-assign]
    host, port = server.start()
    st.transfer = f"{host}:{port}"
    return server


def _trickler(st: LiarState):
    """Answers every ASK with its DATA frame header one byte every ``st.wire_trickle_s`` (each
    receive of the asker gets a byte, none times out), then random bytes of the asked length."""

    def answer(sock, session, ask: wire.Ask) -> None:  # type: ignore[no-untyped-def]
        st.wire_trickled += 1
        header = session.seal(wire.FrameType.DATA, wire.encode_data(ask.length))
        for i in range(len(header)):
            time.sleep(st.wire_trickle_s)
            sock.sendall(header[i : i + 1])
        sock.sendall(os.urandom(ask.length))

    return answer


def _staller(st: LiarState):
    """Answers every ASK of a chunk it can size with its DATA header, then one byte of the body
    every ``st.trickle_s`` (never silent for long, never done: a stalling peer); NOT_HERE for
    any other."""

    def answer(sock, session, ask: wire.Ask) -> None:  # type: ignore[no-untyped-def]
        if ask.address not in st.lengths and ask.snapshot:
            try:
                st.manifest(validate_identity(ask.snapshot))
            except BdnError:
                pass
        if ask.address not in st.lengths:
            sock.sendall(session.seal(wire.FrameType.NOT_HERE, b""))
            return
        st.chunks_lied += 1
        st.wire_lied += 1
        sock.sendall(session.seal(wire.FrameType.DATA, wire.encode_data(ask.length)))
        for _ in range(ask.length):
            time.sleep(st.trickle_s)
            sock.sendall(b"\0")

    return answer


def make_app(state: LiarState) -> web.Application:
    app = web.Application(middlewares=[_auth])
    app[LIAR_STATE] = state
    p = "/bdn/v1/{swarm_id}"
    app.router.add_get(p + "/snapshots/{identity}/have", get_have)
    app.router.add_post(p + "/members", post_members)
    app.router.add_get(p + "/liar/stats", get_stats)
    return app


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--bucket", required=True)
    ap.add_argument("--secret-file", required=True)
    ap.add_argument("--node-id", default="liar")
    ap.add_argument("--foreign-chunk-size", type=int, default=0, help="lie about snapshots without a manifest too")
    ap.add_argument(
        "--refuse",
        choices=("", "busy", "not_here"),
        default="",
        help="advertise every chunk but refuse each request (busy or not here)",
    )
    ap.add_argument("--trickle-s", type=float, default=0.0, help="stall: send chunks one byte every S seconds")
    ap.add_argument(
        "--wire-trickle-s", type=float, default=0.0, help="over the wire: each answer's frame one byte every S seconds"
    )
    args = ap.parse_args(argv)
    url = f"http://127.0.0.1:{args.port}"
    keys = derive_keys(Path(args.secret_file).read_text())
    state = LiarState(keys, args.node_id, url, args.bucket, args.foreign_chunk_size)
    state.trickle_s = args.trickle_s
    state.wire_trickle_s = args.wire_trickle_s
    state.refuse = args.refuse
    start_wire(state, Path(args.secret_file).parent / "junk")

    async def run() -> None:
        runner = web.AppRunner(make_app(state), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", args.port).start()
        print(f"liar listening on {url}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass


class Liar(PeerProcess):
    """The liar as a subprocess: ``start()``, ``url``, ``stop()``."""

    script = Path(__file__).resolve()

    def __init__(
        self,
        workdir: Path,
        bucket: str,
        secret: str,
        node_id: str = "liar",
        foreign_chunk_size: int = 0,
        trickle_s: float = 0.0,
        refuse: str = "",
        wire_trickle_s: float = 0.0,
    ) -> None:
        self.foreign_chunk_size = foreign_chunk_size
        self.trickle_s = trickle_s
        self.wire_trickle_s = wire_trickle_s
        self.refuse = refuse
        super().__init__(workdir, bucket, secret, node_id)

    def args(self) -> list[str]:
        return [
            "--foreign-chunk-size",
            str(self.foreign_chunk_size),
            "--trickle-s",
            str(self.trickle_s),
            "--refuse",
            self.refuse,
            "--wire-trickle-s",
            str(self.wire_trickle_s),
        ]


if __name__ == "__main__":
    main()
