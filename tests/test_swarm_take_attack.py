"""TAKE/GIVE (reads taken over, docs/DESIGN.md; docs/TRUST.md "What a secret holder can do")
against real daemons, by a client that holds the partition secret and speaks the wire as any
node id it likes.

- It TAKEs every chunk of an anchor, over and over, at every daemon, as every other daemon, and
  never reads one: every daemon still ends with the trainer's bytes, every chunk is read from the
  bucket once by the owners, no chunk is given twice, no taker holds more than ``MAX_GRANTS`` at
  a time, and the download ends within ``GRANT_S`` (plus slack) of the last grant.
- Malformed TAKEs (wrong sizes, empty or non-ascii identity, an identity nobody fetches or that
  is no identity, an index out of range, as a node id that is not live or as the owner itself,
  on a HAVE subscription, thousands pipelined): GIVE 0 or that connection closed, the daemon
  serves on, nothing is granted; then a well-formed TAKE is granted (the setup could grant).
- A taker that dies (kill -9) right after its grants: the owners read those chunks once it
  leaves their live set, long before its grants would lapse (``GRANT_S`` set to 600 s here).
- An owner whose transfer server has no TAKE hook (a daemon of the version before TAKE): every
  TAKE answered GIVE 0, and its chunks are read by it alone.
"""

from __future__ import annotations

import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

from bdn.bucket import open_bucket
from bdn.daemon.fetch.takeover import GRANT_S, MAX_GRANTS
from bdn.proto import handshake, wire
from bdn.proto.keys import derive_keys
from bdn.publish import publish_full
from bdn.transfer import Peer, TransferClient
from support.api import wait_for
from support.checkpoints import make_state, write_hf_dir
from support.relay import GateRelay
from support.swarm import SECRET, Daemon, Swarm

IDENTITY = "step000001"
KEYS = derive_keys(SECRET)


def _publish(tmp_path: Path, chunk_size: int = 256 * 1024) -> tuple[str, Path, int]:
    bucket = f"file://{tmp_path}/bucket"
    src = write_hf_dir(tmp_path / "ckpt", make_state(7, scale=8))  # ~9 MB
    manifest = publish_full(bucket, IDENTITY, 1, dir=src, chunk_size=chunk_size)
    return bucket, src, sum(1 for _ in manifest.stored_chunks())


def _wire_peer(d: Daemon) -> Peer:
    return Peer(d.node_id, "127.0.0.1", d.transfer_port)


class Attacker:
    """TAKEs every chunk at every daemon as every other daemon, over and over, until stopped;
    never reads. ``grants``: (time received, owner, taker, index)."""

    def __init__(self, daemons: list[Daemon], n_chunks: int) -> None:
        self.daemons, self.n = daemons, n_chunks
        self.clients = {d.node_id: TransferClient(KEYS, d.node_id, io_timeout_s=30) for d in daemons}
        self.grants: list[tuple[float, str, str, int]] = []
        self.asked = 0
        self.stop = threading.Event()
        self.t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            for owner in self.daemons:
                for taker in self.daemons:
                    if taker is owner:
                        continue
                    for i in range(self.n):
                        if self.stop.is_set():
                            return
                        self.asked += 1
                        if self.clients[taker.node_id].take(_wire_peer(owner), IDENTITY, i):
                            self.grants.append((time.monotonic(), owner.node_id, taker.node_id, i))

    def close(self) -> None:
        self.stop.set()
        self.t.join(60)
        for c in self.clients.values():
            c.close()


def _check_bytes(d: Daemon, src: Path) -> None:
    snap = d.get(f"/v1/snapshots/{IDENTITY}")
    assert snap["state"] == "ready", (d.node_id, snap)
    for f in src.iterdir():
        assert (Path(snap["path"]) / f.name).read_bytes() == f.read_bytes(), (d.node_id, f.name)


def test_a_secret_holder_taking_every_chunk_delays_each_once_and_nothing_is_read_twice(tmp_path: Path) -> None:
    bucket, src, n = _publish(tmp_path)
    # a slow bucket (1 MB/s per daemon): the owners' reads are still to come when the TAKEs are
    with Swarm(tmp_path / "nodes", 3, bucket, extra_env={"BDN_BUCKET_MBIT": "8"}) as swarm:
        ds = swarm.daemons
        attacker = Attacker(ds, n)
        attacker.t.start()
        try:
            for d in ds:
                assert d.prefetch(IDENTITY)[0] in (200, 202)
            for d in ds:
                d.wait_ready(IDENTITY, timeout=600)
            ready_at = time.monotonic()
        finally:
            attacker.close()
        grants = attacker.grants
        assert grants, f"the attack got no grant in {attacker.asked} TAKEs: the test proves nothing"
        # never given twice (per owner: a chunk has one owner, and a non-owner never reads it)
        per_chunk: dict[tuple[str, int], int] = {}
        for _, owner, _, i in grants:
            per_chunk[(owner, i)] = per_chunk.get((owner, i), 0) + 1
        assert max(per_chunk.values()) == 1, per_chunk
        # at most MAX_GRANTS per taker at a time (1 s for the round trips of the TAKEs)
        for t, owner, taker, _ in grants:
            held = [g for g in grants if g[1] == owner and g[2] == taker and t - GRANT_S + 1.0 < g[0] <= t]
            assert len(held) <= MAX_GRANTS, (owner, taker, held)
        # each given chunk delayed once, by GRANT_S at most: the fleet is done soon after the last
        # grant lapsed (generous: a loaded machine)
        assert ready_at - grants[-1][0] < GRANT_S + 120, ready_at - grants[-1][0]
        counters = [d.status()["counters"] for d in ds]
        assert sum(c["bucket_chunks_owner"] for c in counters) == n, counters  # every chunk read once
        assert sum(c["bucket_chunks_fallback"] for c in counters) == 0, counters
        assert sum(c["chunk_verify_failures"] for c in counters) == 0, counters
        for d, c in zip(ds, counters, strict=True):
            assert c["bucket_reads_given"] >= sum(1 for g in grants if g[1] == d.node_id), (d.node_id, c)
        for d in ds:
            _check_bytes(d, src)


# ---- malformed TAKEs on a raw connection -------------------------------------------------------


class Raw:
    """A raw authenticated connection to daemon ``d`` as node ``as_node``."""

    def __init__(self, d: Daemon, as_node: str) -> None:
        self.sock = socket.create_connection(("127.0.0.1", d.transfer_port), timeout=30)
        ftype, body = self.frame()
        assert ftype == wire.FrameType.SERVER_HELLO
        hello, self.session = handshake.client_hello(
            KEYS, as_node, d.node_id, handshake.parse_server_hello(body), secrets.token_bytes(32), time.time()
        )
        self.sock.sendall(hello)
        ftype, body = self.frame()
        assert ftype == wire.FrameType.ACCEPT
        handshake.check_accept(self.session, body)

    def _n(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            b = self.sock.recv(n - len(out))
            if not b:
                raise ConnectionError("closed")
            out += b
        return bytes(out)

    def frame(self) -> tuple[wire.FrameType, bytes]:
        ftype, n = wire.parse_header(self._n(5))
        return ftype, self._n(n)

    def send(self, ftype: wire.FrameType, payload: bytes) -> None:
        self.sock.sendall(self.session.seal(ftype, payload))

    def take(self, payload: bytes) -> bool | None:
        """GIVE's answer to a TAKE of ``payload``, or None when the daemon closed the connection."""
        self.send(wire.FrameType.TAKE, payload)
        try:
            while True:
                ftype, body = self.frame()
                body = self.session.open(ftype, body)
                if ftype != wire.FrameType.HAVE:
                    break
        except (ConnectionError, OSError):
            return None
        assert ftype == wire.FrameType.GIVE, ftype
        return wire.decode_give(body)

    def close(self) -> None:
        self.sock.close()


def _take(ident: bytes, idx: int) -> bytes:
    return bytes([len(ident)]) + ident + idx.to_bytes(4, "big")


@contextmanager
def relay_closed(relay: GateRelay) -> Iterator[GateRelay]:
    """``relay``, closed on the way out (what it holds released)."""
    try:
        yield relay
    finally:
        relay.close()


def test_malformed_takes_are_refused_or_closed_and_the_daemon_serves_on(tmp_path: Path, s3_bucket) -> None:
    bucket, endpoint = s3_bucket
    src = write_hf_dir(tmp_path / "ckpt", make_state(7, scale=4))  # ~2.5 MB
    b = open_bucket(bucket, endpoint_url=endpoint)
    try:
        n = sum(1 for _ in publish_full(b, IDENTITY, 1, dir=src, chunk_size=64 << 10).stored_chunks())
    finally:
        b.close()
    # the bucket (S3) behind a gate: what it sends on a connection stops after 16 KiB (the
    # manifest passes, no chunk) until the cases below are done, so the download is still
    # running through every one of them (a 1 Mbit/s bucket held it for ~40 s, most of it after)
    u = urlsplit(endpoint)
    relay = GateRelay((str(u.hostname), int(u.port or 80)), after=16 << 10)
    env = {"BDN_ENDPOINT_URL": relay.url}
    with relay_closed(relay), Swarm(tmp_path / "nodes", 2, bucket, extra_env=env) as swarm:
        owner, other = swarm.daemons
        assert owner.prefetch(IDENTITY)[0] in (200, 202)
        wait_for(lambda: relay.held.is_set(), 120, "a bucket read held half way")

        def given() -> int:
            return owner.status()["counters"].get("bucket_reads_given", 0)

        closing = {
            "empty": b"",
            "length byte past the end": bytes([20]) + IDENTITY.encode() + (1).to_bytes(4, "big"),
            "length byte short": bytes([5]) + IDENTITY.encode() + (1).to_bytes(4, "big"),
            "no identity": _take(b"", 1),
            "index of 2 bytes": bytes([len(IDENTITY)]) + IDENTITY.encode() + b"\x00\x01",
            "trailing byte": _take(IDENTITY.encode(), 1) + b"\x00",
            "non-ascii identity": _take(b"step\xff\xfe0001", 1),
        }
        for what, payload in closing.items():
            r = Raw(owner, other.node_id)
            assert r.take(payload) is None, what  # that connection closed
            r.close()
        refused = {
            "nobody fetches it": _take(b"step999999", 1),
            "not an identity": _take(b"../../etc", 1),
            "spaces": _take(b"step 0001", 1),
            "index = n": _take(IDENTITY.encode(), n),
            "index 2^32-1": _take(IDENTITY.encode(), 2**32 - 1),
        }
        r = Raw(owner, other.node_id)
        for what, payload in refused.items():
            assert r.take(payload) is False, what  # GIVE 0, the connection serves on
        r.close()
        for as_node in ("stranger", owner.node_id):  # not a live member; the owner itself
            r = Raw(owner, as_node)
            assert r.take(_take(IDENTITY.encode(), n - 1)) is False, as_node
            r.close()
        # another partition's secret: no handshake, so no TAKE at all
        stranger = TransferClient(derive_keys("another-secret-0123456789abcdef0123456789"), other.node_id)
        assert stranger.take(_wire_peer(owner), IDENTITY, n - 1) is False
        stranger.close()
        # a TAKE on a HAVE subscription is not read: no GIVE comes, nothing is granted
        r = Raw(owner, other.node_id)
        r.send(wire.FrameType.HAVE, wire.encode_have(wire.Have(IDENTITY, 0, ())))
        r.send(wire.FrameType.TAKE, _take(IDENTITY.encode(), n - 1))
        r.sock.settimeout(3.0)
        kinds = set()
        until = time.monotonic() + 5.0
        try:
            while time.monotonic() < until:
                ftype, body = r.frame()
                r.session.open(ftype, body)
                kinds.add(ftype)
        except (TimeoutError, ConnectionError, OSError):
            pass
        assert wire.FrameType.GIVE not in kinds, kinds
        r.close()
        # thousands pipelined, of a snapshot nobody fetches: one GIVE 0 each, the daemon answers
        r = Raw(owner, other.node_id)
        k = 3000
        r.sock.sendall(b"".join(r.session.seal(wire.FrameType.TAKE, _take(b"step999999", i)) for i in range(k)))
        for _ in range(k):
            ftype, body = r.frame()
            assert ftype == wire.FrameType.GIVE and wire.decode_give(r.session.open(ftype, body)) is False
        r.close()
        assert owner.get("/v1/health") is not None
        assert given() == 0, "a malformed or unwarranted TAKE was granted"
        # the control: the same daemon grants a well-formed TAKE of a live member (its last chunk,
        # the one it reads last) while its download runs
        state = owner.get(f"/v1/snapshots/{IDENTITY}")["state"]
        r = Raw(owner, other.node_id)
        ok = r.take(_take(IDENTITY.encode(), n - 1))
        r.close()
        assert ok is True or state == "ready", (ok, state)  # (granted in every run so far)
        if ok:
            assert given() == 1
        relay.release()
        owner.wait_ready(IDENTITY, timeout=600)
        _check_bytes(owner, src)


# ---- a taker that dies right after its grants ------------------------------------------------


_PATCHED = (
    "import sys, runpy; import bdn.daemon.fetch.takeover as f; f.GRANT_S = 600.0; "
    "sys.argv = ['bdnd']; runpy.run_module('bdn.daemon.main', run_name='__main__', alter_sys=True)"
)


def _start_with_long_grants(d: Daemon, peers: list[str]) -> None:
    env = dict(d.env, BDN_PEERS=",".join(p for p in peers if p != d.peer_url))
    with open(d.log_path, "ab") as log:
        d.proc = subprocess.Popen([sys.executable, "-c", _PATCHED], env=env, stdout=log, stderr=subprocess.STDOUT)


def test_a_taker_killed_after_its_grants_ends_them_when_it_leaves_the_live_set(tmp_path: Path) -> None:
    bucket, src, n = _publish(tmp_path)
    # quick failure detection (a dead member is dead in ~2 s), grants that would last 10 minutes
    env = {"BDN_BUCKET_MBIT": "4", "BDN_SWIM_PERIOD_S": "0.2", "BDN_SWIM_ACK_TIMEOUT_S": "0.1"}
    swarm = Swarm(tmp_path / "nodes", 3, bucket, extra_env=env)
    owners, victim = swarm.daemons[:2], swarm.daemons[2]
    try:
        for d in owners:
            _start_with_long_grants(d, swarm.peer_urls)
        victim.start(swarm.peer_urls)
        for d in swarm.daemons:
            d.wait_healthy()
        swarm.wait_members()
        for d in owners:
            assert d.prefetch(IDENTITY)[0] in (200, 202)
        # as the victim, TAKE chunks at both owners until each gave some
        client = TransferClient(KEYS, victim.node_id, io_timeout_s=30)
        got: dict[str, list[int]] = {d.node_id: [] for d in owners}

        def granted() -> dict[str, list[int]]:
            for d in owners:
                for i in range(n - 1, -1, -1):
                    if len(got[d.node_id]) < MAX_GRANTS and client.take(_wire_peer(d), IDENTITY, i):
                        got[d.node_id].append(i)
            return got

        wait_for(granted, 120, "a grant from every owner", 0, until=lambda got: all(got.values()))
        client.close()
        victim.kill()
        for d in owners:
            # GRANT_S is 600 s in the owners: only the victim leaving the live set ends its grants
            d.wait_ready(IDENTITY, timeout=300)
            _check_bytes(d, src)
        counters = [d.status()["counters"] for d in owners]
        for d, c in zip(owners, counters, strict=True):
            assert c["bucket_reads_given"] >= len(got[d.node_id]), (d.node_id, c, got)
        assert sum(c["chunk_verify_failures"] for c in counters) == 0
    finally:
        swarm.stop()


# ---- an owner of the older version: no TAKE hook -----------------------------------------------


# The slow owner's bucket reads after its first wait (up to 600 s) until someone has asked it to
# give a read (TAKE): however slowly the others reach their own last chunks on a loaded machine,
# the owner still holds unread chunks when they look for reads to take over.
_NO_HOOK = (
    "import sys, runpy, threading\n"
    "import bdn.proto.wire as w, bdn.transfer.server as s, bdn.bucket.file as f\n"
    "init, decode, read = s.TransferServer.__init__, w.decode_take, f.FileBucket.read_range_into\n"
    "asked, reads = threading.Event(), [0]\n"
    "def no_hook(self, *a, on_take=None, **k):\n"
    "    init(self, *a, **k)\n"
    "def seen(payload):\n"
    "    print('TAKE-SEEN', flush=True)\n"
    "    asked.set()\n"
    "    return decode(payload)\n"
    "def gated(self, *a, **k):\n"
    "    reads[0] += 1\n"
    "    if reads[0] > 1:\n"
    "        asked.wait(600)\n"
    "    return read(self, *a, **k)\n"
    "s.TransferServer.__init__, w.decode_take, f.FileBucket.read_range_into = no_hook, seen, gated\n"
    "sys.argv = ['bdnd']; runpy.run_module('bdn.daemon.main', run_name='__main__', alter_sys=True)\n"
)


def test_a_slow_owner_without_the_take_hook_gives_nothing_and_nothing_is_read_twice(tmp_path: Path) -> None:
    """tests/test_swarm_steal.py's swarm, the slow owner's transfer server built without
    ``on_take`` (what a daemon of the version before TAKE answers: GIVE 0 to every TAKE): the fast
    nodes ask it, are refused, and read none of its chunks."""
    bucket, src, n = _publish(tmp_path)
    swarm = Swarm(tmp_path / "nodes", 5, bucket)
    slow = swarm.daemons[0]
    slow.env["BDN_BUCKET_MBIT"] = "2"
    try:
        env = dict(slow.env, BDN_PEERS=",".join(p for p in swarm.peer_urls if p != slow.peer_url))
        with open(slow.log_path, "ab") as log:
            slow.proc = subprocess.Popen(
                [sys.executable, "-c", _NO_HOOK], env=env, stdout=log, stderr=subprocess.STDOUT
            )
        for d in swarm.daemons[1:]:
            d.start(swarm.peer_urls)
        for d in swarm.daemons:
            d.wait_healthy()
        for d in swarm.daemons:
            assert d.prefetch(IDENTITY)[0] in (200, 202)
        for d in swarm.daemons:
            d.wait_ready(IDENTITY, timeout=600)
        counters = [d.status()["counters"] for d in swarm.daemons]
        assert "TAKE-SEEN" in slow.log_path.read_text(), "nobody asked the slow owner: the test proves nothing"
        assert counters[0]["bucket_reads_given"] == 0, counters[0]
        # no read taken over without a grant, and every chunk read once
        assert sum(c["bucket_chunks_taken_over"] for c in counters) <= sum(c["bucket_reads_given"] for c in counters)
        assert sum(c["bucket_chunks_owner"] for c in counters) == n, counters
        assert sum(c["bucket_chunks_fallback"] for c in counters) == 0, counters
        for d in swarm.daemons:
            _check_bytes(d, src)
    finally:
        swarm.stop()


def test_a_take_for_a_delta_is_never_granted(tmp_path: Path) -> None:
    """A delta's stored chunks are never given (a delta folded here may take a subset of them,
    numbered otherwise than at its peers): GIVE 0 to a live member for every position while the
    delta downloads, and its download completes."""
    from bdn.proto.manifest import MANIFEST_NAME, Manifest
    from support.chains import file_chain, step_id

    chain = file_chain(tmp_path, 1, chunk_size=64 << 10, scale=8, frac=0.5)
    delta = step_id(2)
    m = Manifest.from_json((chain.bucket / delta / MANIFEST_NAME).read_bytes())
    assert m.is_delta
    n = sum(1 for _ in m.stored_chunks())
    with Swarm(
        tmp_path / "nodes", 2, chain.url, extra_env={"BDN_LOAD_STARTUP": "false", "BDN_BUCKET_MBIT": "8"}
    ) as swarm:
        owner, other = swarm.daemons
        assert owner.prefetch(delta)[0] in (200, 202)
        seen_downloading = False
        client = TransferClient(KEYS, other.node_id, io_timeout_s=30)
        try:
            while True:
                state = owner.get(f"/v1/snapshots/{delta}")["state"]
                if state in ("ready", "failed"):
                    break
                seen_downloading = seen_downloading or state == "downloading"
                for i in range(n):
                    assert client.take(_wire_peer(owner), delta, i) is False, (i, state)
        finally:
            client.close()
        assert state == "ready", state
        assert seen_downloading, "the delta was never seen downloading: the test proves nothing"
