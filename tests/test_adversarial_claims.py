"""A member (it holds the partition secret) pushes hot-load targets whose order fields lie: the
policy version ``pv`` and publish time ``at`` a receiver orders targets by. Once the receiver has
read the snapshot's manifest from the bucket itself, a push that contradicts it is refused (400,
one line), and a target adopted before that read takes the manifest's values, so a claim of
policy version 2^63 - 1 no longer wins over every later hot-load (docs/TRUST.md, "Attacks
tried"). On a real daemon, with real signed pushes on its peer port.
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest

from bdn.daemon.replica.target import published_at
from bdn.proto.keys import derive_keys, sign_request
from bdn.publish import publish_full
from tests.support import api
from tests.support.api import HOT_LOAD, wait_for
from tests.support.checkpoints import make_state, write_hf_dir
from tests.support.swarm import SECRET, Daemon, running

pytestmark = pytest.mark.timeout(300)
KEYS = derive_keys(SECRET)
LIE_PV = 2**63 - 1


@pytest.fixture()
def daemon(tmp_path: Path) -> Iterator[tuple[Daemon, Path]]:
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    for i in (1, 2, 3):
        ck = write_hf_dir(tmp_path / f"ck{i}", make_state(i), i)
        publish_full(f"file://{bucket}", f"step00000{i}", i, dir=ck, chunk_size=64 << 10)
    d = Daemon(tmp_path / "work", "victim", f"file://{bucket}", extra_env={"BDN_LOAD_STARTUP": "false"})
    with running(d):
        yield d, bucket


def _truth(bucket: Path, identity: str) -> tuple[int, float]:
    m = json.loads((bucket / identity / "bdn.manifest.json").read_bytes())
    return m["policy_version"], published_at(m["created_at"])


def _push(d: Daemon, identity: str, pv: int, at: float, gen: int = 5) -> tuple[int, bytes]:
    target = {
        "identity": identity,
        "seq": time.time_ns(),
        "origin": "liar",
        "request_id": f"liar-{identity}-{pv}",
        "gen": gen,
        "pv": pv,
        "at": at,
    }
    path = f"/bdn/v1/{KEYS.swarm_id}/hot_load"
    conn = http.client.HTTPConnection("127.0.0.1", d.peer_port, timeout=60)
    try:
        conn.request(
            "POST",
            path,
            body=msgpack.packb(target),
            headers={"Authorization": sign_request(KEYS, "POST", path, "liar", to=d.node_id)},
        )
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def _loading(d: Daemon) -> str | None:
    status, body = api.http("GET", d.url + HOT_LOAD)
    assert status == 200, body
    me = next(r for r in body["replicas"] if r["replica_id"] == d.node_id)
    return me["loading_state"]["identity"]


def test_a_push_contradicting_a_manifest_read_here_is_refused(daemon: tuple[Daemon, Path]) -> None:
    d, bucket = daemon
    assert d.prefetch("step000001")[0] == 202
    d.wait_ready("step000001")  # its manifest is read here now
    pv, at = _truth(bucket, "step000001")
    status, body = _push(d, "step000001", LIE_PV, at)
    assert status == 400, body  # 200 before: the claim was taken as it came
    line = body.decode()
    assert f"claims policy version {LIE_PV}" in line and f"its manifest says policy version {pv}" in line, line
    status, body = _push(d, "step000001", pv, at + 1000.0)  # the publish time is checked too
    assert status == 400 and b"published at" in body, body
    assert _push(d, "step000001", pv, at)[0] == 200  # the truth is taken
    assert "Traceback" not in d.log()


def test_a_lie_adopted_before_the_manifest_was_read_is_corrected(daemon: tuple[Daemon, Path]) -> None:
    """The lie arrives first (nothing of step000002 is known here): it is adopted, and corrected
    when the manifest is read, so the next honest target with the same gen and a higher policy
    version wins (before: the claim of 2^63 - 1 outranked every later one for good)."""
    d, bucket = daemon
    status, body = _push(d, "step000002", LIE_PV, 9.9e10)
    assert status == 200, body
    wait_for(lambda: _loading(d) == "step000002", 120, "the pushed target to be adopted")
    d.wait_ready("step000002")
    wait_for(
        lambda: "the target takes the manifest's" in d.log_path.read_text(errors="replace"),
        120,
        "the correction to be logged",
    )
    pv3, at3 = _truth(bucket, "step000003")
    assert _push(d, "step000003", pv3, at3)[0] == 200
    wait_for(lambda: _loading(d) == "step000003", 120, "the honest later target to win")
    d.wait_ready("step000003")


def test_a_claim_for_an_identity_nobody_published_is_voided(daemon: tuple[Daemon, Path]) -> None:
    """An invented identity has no manifest to correct the claim with: its load fails at once
    (one listing, not after manifest_wait_s), the claim is voided, the same request pushed again
    is refused, and the next honest target of the same gen wins (before: the invented target
    at policy version 2^63 - 1 outranked it while its load waited 600 s for publication)."""
    d, bucket = daemon
    status, body = _push(d, "step000077", LIE_PV, 9.9e10)
    assert status == 200, body
    wait_for(lambda: "it orders as unknown" in d.log_path.read_text(errors="replace"), 120, "the claim to be voided")
    assert d.get("/v1/snapshots/step000077")["state"] == "failed"
    status, body = _push(d, "step000077", LIE_PV, 9.9e10)  # the same request id again
    assert status == 400 and b"no manifest of it could be read here" in body, body
    pv3, at3 = _truth(bucket, "step000003")
    assert _push(d, "step000003", pv3, at3)[0] == 200
    wait_for(lambda: _loading(d) == "step000003", 120, "the honest later target to win")
    d.wait_ready("step000003")
