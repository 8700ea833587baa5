"""A peer that holds the secret and claims it is reading every chunk from the bucket now: on a
HAVE subscription it announces every stored chunk of the snapshot growing (HAVE layer
``wire.HAVE_GROWING``) and never one held; it holds nothing (its have-bitfields are empty).
Asked for a chunk cut-through, it answers ``--mode``:

- ``not-here``: NOT_HERE at once;
- ``keepalive``: a growing chunk that never lands: keep-alive PARTs (``bdn.transfer.growing``)
  until the asker gives up.

It speaks SWIM as a healthy member (``support.liar.post_members``). Run:
``python tests/support/growliar.py --port P --bucket URL --secret-file F --mode M``; ``GrowLiar``
starts and stops that process from a test."""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
import threading
import time
from pathlib import Path

from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bdn.proto import handshake, wire
from bdn.proto.errors import BdnError
from bdn.proto.identity import validate_identity
from bdn.proto.keys import derive_keys
from bdn.transfer import GRANTED, NOT_HERE, TransferServer
from bdn.transfer.announce import frames
from bdn.transfer.growing import Growing
from support.liar import LIAR_STATE, LiarState, _auth, have_answer, post_members
from support.peerproc import PeerProcess


class Counts:
    subscriptions = 0
    asks = 0


def _have_feed(st: LiarState, counts: Counts):
    def serve(sock: socket.socket, session: handshake.Session, payload: memoryview) -> None:
        have = wire.decode_have(payload)
        m = st.manifest(validate_identity(have.identity))
        if m is None:
            return
        counts.subscriptions += 1
        ns = sum(len(f.chunks) for f in m.files)
        print(f"announced {ns} chunks of {have.identity} growing (subscription {counts.subscriptions})", flush=True)
        for p in frames(have.identity, wire.HAVE_GROWING, range(ns)):
            sock.sendall(session.seal(wire.FrameType.HAVE, p))
        while True:  # "that was all", then keep-alives until the subscriber leaves
            sock.sendall(session.seal(wire.FrameType.HAVE, wire.encode_have(wire.Have(have.identity, 0, ()))))
            time.sleep(2.0)

    return serve


def start_wire(st: LiarState, mode: str, counts: Counts, junk: Path) -> TransferServer:
    junk.write_bytes(b"\0" * (16 << 20))

    def admit(peer: str, ask: wire.Ask):
        counts.asks += 1
        print(f"asked for {ask.address} (ask {counts.asks}, cut-through {ask.cut_through})", flush=True)
        if ask.snapshot:
            try:
                st.manifest(validate_identity(ask.snapshot))
            except BdnError:
                pass
        return NOT_HERE if mode == "not-here" else GRANTED

    def resolve(address: str):
        n = st.lengths.get(address)
        if n is None or mode == "not-here":
            return None
        return Growing(str(junk), 0, [(0, n)])  # never lands, never verified

    server = TransferServer(st.keys, st.node_id, resolve, admit=admit, on_have=_have_feed(st, counts))
    host, port = server.start()
    st.transfer = f"{host}:{port}"
    return server


async def get_have(request: web.Request) -> web.Response:
    """Holds nothing: empty bitfields of the manifest's sizes."""
    return await have_answer(request, "fetching", lambda n: bytes((n + 7) // 8))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--bucket", required=True)
    ap.add_argument("--secret-file", required=True)
    ap.add_argument("--node-id", default="growliar")
    ap.add_argument("--mode", choices=["not-here", "keepalive"], required=True)
    a = ap.parse_args()
    url = f"http://127.0.0.1:{a.port}"
    st = LiarState(derive_keys(Path(a.secret_file).read_text()), a.node_id, url, a.bucket)
    counts = Counts()
    start_wire(st, a.mode, counts, Path(a.secret_file).parent / "junk")

    async def run() -> None:
        app = web.Application(middlewares=[_auth])
        app[LIAR_STATE] = st
        p = "/bdn/v1/{swarm_id}"
        app.router.add_get(p + "/snapshots/{identity}/have", get_have)
        app.router.add_post(p + "/members", post_members)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", a.port).start()
        print(f"liar listening on {url}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(run())


class GrowLiar(PeerProcess):
    """The process: ``start()``, ``url``, ``stop()``."""

    script = Path(__file__).resolve()

    def __init__(self, workdir: Path, bucket: str, secret: str, mode: str, node_id: str = "growliar") -> None:
        self.mode = mode
        super().__init__(workdir, bucket, secret, node_id)

    def args(self) -> list[str]:
        return ["--mode", self.mode]


if __name__ == "__main__":
    threading.excepthook = lambda args: None  # a subscriber that left ends its feed thread with an OSError
    main()
