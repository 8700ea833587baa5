"""Attacks on a real bdnd that once crashed a handler or left a wrong state: a bearer token
that is not ASCII, JSON's non-numbers in an engine body, an engine that leaves mid hot-load.

One daemon over a ``file://`` bucket under ``tmp_path`` (``tests/support/swarm.py``); requests
go over real loopback sockets, some byte for byte (``raw``) so no client normalises them.
"""

from __future__ import annotations

import json
import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from bdn.proto.keys import derive_keys, sign_request
from bdn.publish import publish_full
from tests.support.api import wait_for
from tests.support.checkpoints import make_state, write_hf_dir
from tests.support.liar import Liar
from tests.support.swarm import SECRET, Daemon, running

CHUNK = 64 << 10
TOKEN = "attack-test-token"

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("attacks")
    bucket = root / "bucket"
    bucket.mkdir()
    ck = write_hf_dir(root / "src" / "step000001", make_state(0), 1)
    publish_full(f"file://{bucket}", "step000001", 1, dir=ck, chunk_size=CHUNK)
    ck = write_hf_dir(root / "src" / "step000002", make_state(1), 2)
    publish_full(f"file://{bucket}", "step000002", 2, dir=ck, chunk_size=CHUNK)
    with running(
        Daemon(
            root / "work", "node0", f"file://{bucket}", extra_env={"BDN_LOAD_STARTUP": "false", "BDN_API_TOKEN": TOKEN}
        )
    ) as d:
        yield d


def raw(port: int, data: bytes) -> tuple[int, bytes]:
    """Send ``data`` as is on a fresh connection (it must ask ``Connection: close``); status, body."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    head, _, body = out.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def test_a_bearer_token_that_is_not_ascii_gets_401_not_500(daemon: Daemon) -> None:
    for token in (b"\xff\xfe", "jeton-\u00e9".encode(), b"\x80" + TOKEN.encode()):
        status, body = raw(
            daemon.peer_port,
            b"GET /hot_load/v1/models/hot_load HTTP/1.1\r\nHost: x\r\n"
            b"Authorization: Bearer " + token + b"\r\nConnection: close\r\n\r\n",
        )
        assert status == 401, (token, status, body)
    assert "Traceback" not in daemon.log()
    status, _ = raw(
        daemon.peer_port,
        b"GET /hot_load/v1/models/hot_load HTTP/1.1\r\nHost: x\r\n"
        b"Authorization: Bearer " + TOKEN.encode() + b"\r\nConnection: close\r\n\r\n",
    )
    assert status == 200


def _post(d: Daemon, path: str, body: bytes) -> tuple[int, object]:
    status, ans = raw(
        d.local_port,
        b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body,
    )
    return status, json.loads(ans, parse_constant=_strict)


def _strict(name: str) -> None:
    raise AssertionError(f"the daemon answered {name}, which is not JSON")


def _register(d: Daemon) -> str:
    status, ans = _post(d, "/v1/engines", b'{"name": "attacker"}')
    assert status == 201, ans
    return ans["engine_id"]  # type: ignore[index]


def _offered(d: Daemon, identity: str, eid: str | None = None) -> str:
    """A registered engine (``eid``, else a new one) that has been offered ``identity`` (the target)."""
    eid = eid or _register(d)
    offer = d.get(f"/v1/engines/{eid}/next?timeout=60")
    assert offer["identity"] == identity, offer
    return eid


def _hot_load(d: Daemon, identity: str) -> None:
    status, ans = _post(d, "/hot_load/v1/models/hot_load", json.dumps({"identity": identity}).encode())
    assert status == 200, ans
    d.wait_ready(identity, 120)


def test_nan_and_infinity_in_an_engine_ack_are_400_and_never_reach_the_fleet_answer(daemon: Daemon) -> None:
    _hot_load(daemon, "step000001")
    eid = _offered(daemon, "step000001")
    try:
        for bad in (b"NaN", b"Infinity", b"-Infinity", b"1e999", b"1" + b"0" * 400, b"-0.5"):
            status, ans = _post(
                daemon, f"/v1/engines/{eid}/ack", b'{"identity": "step000001", "pause_ms": ' + bad + b"}"
            )
            assert status == 400, (bad, ans)
            assert "pause_ms" in ans["error"] or "JSON" in ans["error"], ans  # type: ignore[index]
        status, ans = raw(
            daemon.local_port, b"GET /hot_load/v1/models/hot_load HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        replica = json.loads(ans, parse_constant=_strict)["replicas"][0]
        assert status == 200 and replica["last_swap_pause_ms"] is None, replica
        assert _post(daemon, f"/v1/engines/{eid}/ack", b'{"identity": "step000001", "pause_ms": 3.5}')[0] == 200
    finally:
        daemon.request("DELETE", f"/v1/engines/{eid}")


def test_an_engine_that_leaves_mid_hot_load_does_not_leave_the_replica_done_but_serving_nothing(daemon: Daemon) -> None:
    """Two engines are offered the target; one acknowledges, the other unregisters instead (it
    crashed and its supervisor cleaned up). Every remaining engine serves the target: the replica
    is done *and* reports it as current, as it would had the second engine never registered."""
    stays, leaves = _register(daemon), _register(daemon)  # before the target is ready
    _hot_load(daemon, "step000002")
    _offered(daemon, "step000002", stays), _offered(daemon, "step000002", leaves)
    try:
        assert _post(daemon, f"/v1/engines/{stays}/ack", b'{"identity": "step000002", "pause_ms": 2}')[0] == 200
        status, _ = daemon.request("DELETE", f"/v1/engines/{leaves}")
        assert status == 200
        replica = daemon.get("/hot_load/v1/models/hot_load")["replicas"][0]
        assert replica["loading_state"]["stage"] == "done", replica
        assert replica["current_snapshot_identity"] == "step000002" and replica["readiness"] is True, replica
        assert replica["last_swap_pause_ms"] == 2.0, replica
    finally:
        daemon.request("DELETE", f"/v1/engines/{stays}")
        daemon.request("DELETE", f"/v1/engines/{leaves}")


def test_a_member_that_stalls_every_chunk_is_penalised_after_its_first_timeout(tmp_path: Path) -> None:
    """A peer that answers membership exchanges (so it stays alive) and claims every chunk, but
    sends each over the transfer wire at a byte every few seconds: its first timed-out chunk
    request penalises it, so the other chunks are not queued behind it one timeout after
    another."""
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    ck = write_hf_dir(tmp_path / "src", make_state(3, scale=2), 1)
    m = publish_full(f"file://{bucket}", "step000001", 1, dir=ck, chunk_size=CHUNK)
    n_chunks = sum(len(f.chunks) for f in m.files)
    liar = Liar(tmp_path, f"file://{bucket}", SECRET, trickle_s=2.0).start()
    d = Daemon(
        tmp_path / "work",
        "node0",
        f"file://{bucket}",
        extra_env={
            "BDN_LOAD_STARTUP": "false",
            "BDN_PEER_TIMEOUT_S": "2",
            "BDN_MAX_PER_PEER": "1",
            "BDN_PENALTY_S": "600",
        },
    )
    try:
        d.start([liar.url])
        d.wait_healthy()
        wait_for(lambda: any(p["alive"] for p in d.status()["peers"]), 120, "a live peer", 0.1, detail=d.log)
        assert d.prefetch("step000001")[0] == 202
        d.wait_ready("step000001", 120)
        keys = derive_keys(SECRET)
        path = f"/bdn/v1/{keys.swarm_id}/liar/stats"
        req = urllib.request.Request(
            liar.url + path, headers={"Authorization": sign_request(keys, "GET", path, "tester", to=liar.node_id)}
        )
        asked = json.loads(urllib.request.urlopen(req, timeout=60).read())
        # cut by the body's deadline ("stalled") or the lag watch ("is slow"), then penalised
        assert ("stalled" in d.log() or "is slow" in d.log()) and "penalised" in d.log(), d.log()
        assert asked["wire_lied"] == asked["chunks_lied"] > 0, asked
        # one request in flight to it at a time (max_per_peer 1): the one that timed out, and at
        # most the one already queued behind it; without the penalty, every chunk waits its turn
        assert asked["chunks_lied"] <= 2 < n_chunks, (asked, n_chunks)
    finally:
        d.stop()
        liar.stop()
