"""Secret holders that are slow on the transfer wire, against real bdnd processes.

Slow readers: eight at once on a daemon's transfer port, each asking its own 8 MiB chunk and
reading 16 KiB every 0.05 s (never silent for a whole send timeout). The daemon breaks each answer
off by the deadline its asker would give it (``peer_timeout_s`` = 1 s here: 4 s for an 8 MiB
chunk), so no slow reader gets its whole chunk (before the fix each got all of it, at its pace,
holding its upload slot) and every upload slot comes back (``bdn_inflight_requests{kind="upload"}``
0); ``/v1/health`` answers within a second all along; an honest daemon then loads the snapshot
with the trainer's bytes, part of them from the attacked daemon.

Trickling answerers: three peers that claim every chunk and send each answer's frame a byte at a
time beside one honest seed: the victim's download finishes with the trainer's bytes, health stays
fast, no peer fetch is left in flight."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from bdn.proto import wire
from bdn.proto.keys import derive_keys, sign_request
from bdn.publish import publish_full
from bdn.transfer import Peer, TransferClient
from support.api import wait_for
from support.checkpoints import make_state, write_hf_dir
from support.liar import Liar
from support.swarm import SECRET, Daemon

IDENT = "step000001"
#: Larger than the most a socket's send buffer holds (tcp_wmem's 4 MiB): a smaller chunk goes
#: into the kernel at once, and its upload slot with it, however slowly it is read.
CHUNK = 8 << 20
READERS = 8
ENV = {"BDN_LOAD_STARTUP": "false", "BDN_PEER_TIMEOUT_S": "1", "BDN_MAX_UPLOADS": "4"}

pytestmark = pytest.mark.timeout(600)


def _uploads(d: Daemon) -> float:
    m = re.search(r'^bdn_inflight_requests\{kind="upload"\} (\S+)$', d.get("/metrics").decode(), re.MULTILINE)
    return float(m.group(1)) if m else -1.0


class SlowReader(threading.Thread):
    """Asks ``address`` over its own authenticated stream, then reads 16 KiB every 0.05 s until
    the daemon closes the connection (or 90 s pass); ``got`` bytes, ``took`` seconds."""

    def __init__(self, d: Daemon, i: int, address: str, length: int) -> None:
        super().__init__(daemon=True)
        self.client = TransferClient(d.keys, f"slow{i}", rcvbuf=65536, io_timeout_s=30)
        self.peer = Peer(d.node_id, "127.0.0.1", d.transfer_port)
        self.address, self.length = address, length
        self.got, self.took, self.ended = 0, 0.0, ""

    def run(self) -> None:
        stream = self.client.connect(self.peer)
        t0 = time.monotonic()
        try:
            ask = wire.encode_ask(wire.Ask(self.address, 0, self.length, 0, IDENT, 0))
            stream.sock.sendall(stream.session.seal(wire.FrameType.ASK, ask))
            stream.sock.settimeout(10)
            while time.monotonic() - t0 < 90:
                b = stream.sock.recv(16384)
                if not b:
                    self.ended = "closed"
                    break
                self.got += len(b)
                time.sleep(0.05)
            else:
                self.ended = "still open"
        except OSError as e:
            self.ended = type(e).__name__
        finally:
            self.took = time.monotonic() - t0
            stream.sock.close()
            self.client.close()


def test_slow_readers_give_their_upload_slots_back_and_the_daemon_serves_on(tmp_path: Path) -> None:
    bucket = f"file://{tmp_path}/bucket"
    ck = write_hf_dir(tmp_path / "ck", make_state(0, scale=24), 1)
    m = publish_full(bucket, IDENT, 1, dir=ck, chunk_size=CHUNK)
    chunks = [(f, i) for f in m.files for i, dg in enumerate(f.chunks) if f.size >= (i + 1) * CHUNK]
    assert len(chunks) >= READERS
    seed = Daemon(tmp_path / "nodes", "node0", bucket, extra_env=ENV)
    honest = Daemon(tmp_path / "nodes", "node1", bucket, extra_env=ENV)
    seed.start([])
    try:
        seed.wait_healthy()
        assert seed.prefetch(IDENT)[0] == 202
        seed.wait_ready(IDENT, 300)
        readers = [
            SlowReader(seed, i, seed.keys.address(f.chunks[c]), CHUNK) for i, (f, c) in enumerate(chunks[:READERS])
        ]
        for r in readers:
            r.start()
        slowest = 0.0
        while any(r.is_alive() for r in readers):
            t0 = time.monotonic()
            assert seed.get("/v1/health", timeout=30)["status"] == "ok"
            slowest = max(slowest, time.monotonic() - t0)
            time.sleep(0.2)
        for r in readers:
            r.join(120)
        done = [(r.got, round(r.took, 1), r.ended) for r in readers]
        # none got its whole chunk: the daemon broke each answer off at its deadline (4 x 1 s) and
        # closed the connection (what the socket buffers held still came)
        assert all(r.got < CHUNK for r in readers), done
        answered = [r for r in readers if r.got > 1000]  # the others were answered BUSY (max_uploads)
        assert answered and all(r.ended in ("closed", "ConnectionResetError") for r in answered), done
        assert slowest < 1.0, slowest
        wait_for(lambda: _uploads(seed), 30, "every upload slot back", until=lambda n: n == 0)
        honest.start([seed.peer_url])
        honest.wait_healthy()
        assert honest.prefetch(IDENT)[0] == 202
        rec = honest.wait_ready(IDENT, 300)
        for p in ck.iterdir():
            assert (Path(rec["path"]) / p.name).read_bytes() == p.read_bytes(), p.name
        assert rec["bytes_from_peers"] > 0, rec
    finally:
        honest.stop()
        seed.stop()


def _liar_stats(liar: Liar) -> dict:
    keys = derive_keys(SECRET)
    path = f"/bdn/v1/{keys.swarm_id}/liar/stats"
    req = urllib.request.Request(
        liar.url + path, headers={"Authorization": sign_request(keys, "GET", path, "tester", to=liar.node_id)}
    )
    return json.loads(urllib.request.urlopen(req, timeout=60).read())


def _peer_fetches(d: Daemon) -> float:
    m = re.search(r'^bdn_inflight_requests\{kind="peer"\} (\S+)$', d.get("/metrics").decode(), re.MULTILINE)
    return float(m.group(1)) if m else -1.0


def test_peers_trickling_every_answer_over_the_wire_do_not_hold_up_a_download(tmp_path: Path) -> None:
    """Three secret holders that claim every chunk and answer each ask over the transfer wire
    with its DATA header a byte every 0.6 x ``peer_timeout_s`` (no receive ever times out), beside
    one honest seed: the victim's asks to them end at the answer's deadline, the liars stop being
    asked, the victim ends with the trainer's bytes, ``/v1/health`` answers within a second all
    along, and no peer fetch is left in flight."""
    bucket = f"file://{tmp_path}/bucket"
    ck = write_hf_dir(tmp_path / "ck", make_state(0, scale=4), 1)
    publish_full(bucket, IDENT, 1, dir=ck, chunk_size=64 << 10)
    env = {"BDN_LOAD_STARTUP": "false", "BDN_PEER_TIMEOUT_S": "1"}
    liars = [Liar(tmp_path, bucket, SECRET, node_id=f"liar{i}", wire_trickle_s=0.6).start() for i in range(3)]
    seed = Daemon(tmp_path / "nodes", "node0", bucket, extra_env=env)
    victim = Daemon(tmp_path / "nodes", "node1", bucket, extra_env=env)
    try:
        seed.start([])
        seed.wait_healthy()
        assert seed.prefetch(IDENT)[0] == 202
        seed.wait_ready(IDENT, 300)
        victim.start([seed.peer_url] + [x.url for x in liars])
        victim.wait_healthy()
        wait_for(
            lambda: sum(p["alive"] for p in victim.status()["peers"]),
            120,
            "the seed and the liars live members",
            until=lambda n: n >= 4,
            detail=victim.log,
        )
        assert victim.prefetch(IDENT)[0] == 202
        slowest = 0.0
        deadline = time.monotonic() + 300  # (t0 below times one health probe; this bounds the whole wait)
        while True:
            t0 = time.monotonic()
            assert victim.get("/v1/health", timeout=30)["status"] == "ok"
            slowest = max(slowest, time.monotonic() - t0)
            st, rec = victim.request("GET", f"/v1/snapshots/{IDENT}")
            if st == 200 and rec["state"] in ("ready", "failed"):
                break
            assert time.monotonic() < deadline, "the download neither ready nor failed after 300 s"
            time.sleep(0.2)  # the health probe's period while the attack runs
        rec = victim.wait_ready(IDENT, 10)
        for p in ck.iterdir():
            assert (Path(rec["path"]) / p.name).read_bytes() == p.read_bytes(), p.name
        assert sum(_liar_stats(x)["wire_trickled"] for x in liars) > 0  # the attack reached the victim
        assert slowest < 1.0, slowest
        wait_for(lambda: _peer_fetches(victim), 30, "no peer fetch in flight", until=lambda n: n == 0)
    finally:
        victim.stop()
        seed.stop()
        for x in liars:
            x.stop()
