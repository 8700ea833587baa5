"""Attacks on the peer API's ``POST bad_chunk`` (bdn/daemon/http/peer.py, bdn/daemon/serve/chunkcheck.py)
on a real bdnd: a member that floods reports about good chunks and chunks that do not exist, to
make an honest daemon quarantine what it serves. A regression test (no defect found): every
report is answered 202 or 503 with one line, each good chunk is re-hashed once, none is dropped.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgpack
import pytest

from bdn.daemon.snapshots.catalog import MAX_FAILED
from bdn.proto.keys import derive_keys, sign_request
from bdn.publish import publish_full
from bdn.transfer import Outcome
from tests.support.api import wait_for
from tests.support.checkpoints import make_state, write_hf_dir
from tests.support.swarm import SECRET, Daemon, running
from tests.support.transfer import ask_daemon

pytestmark = pytest.mark.timeout(300)
CHUNK = 64 << 10
KEYS = derive_keys(SECRET)


def _metric(d: Daemon, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", d.get("/metrics").decode(), re.M)
    assert m, f"no {name}"
    return float(m.group(1))


def _digests(root: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in root.iterdir() if p.name != "READY"}


def test_a_flood_of_bad_chunk_reports_quarantines_nothing_and_each_good_chunk_is_hashed_once(tmp_path: Path) -> None:
    bucket = f"file://{tmp_path}/bucket"
    ck = write_hf_dir(tmp_path / "ck", make_state(0, scale=2), 1)
    m = publish_full(bucket, "step000001", 1, dir=ck, chunk_size=CHUNK)
    real = list(dict.fromkeys(KEYS.address(c) for f in m.files for c in f.chunks))
    assert 1 < len(real) < 256  # they all fit the queue
    unknown = [os.urandom(16).hex() for _ in range(400)]
    with running(Daemon(tmp_path / "work", "node0", bucket, extra_env={"BDN_LOAD_STARTUP": "false"})) as d:
        assert d.prefetch("step000001")[0] == 202
        path = Path(d.wait_ready("step000001")["path"])
        before = _digests(path)
        conn = http.client.HTTPConnection("127.0.0.1", d.peer_port, timeout=60)
        url = f"/bdn/v1/{KEYS.swarm_id}/bad_chunk"
        answers: dict[int, set[bytes]] = {}
        try:
            for address in real + unknown + real * 3:
                body = msgpack.packb({"address": address, "snapshot": "step000001"})
                conn.request(
                    "POST",
                    url,
                    body=body,
                    headers={"Authorization": sign_request(KEYS, "POST", url, "flooder", to=d.node_id)},
                )
                r = conn.getresponse()
                answers.setdefault(r.status, set()).add(r.read())
        finally:
            conn.close()
        assert set(answers) <= {202, 503}, answers
        assert answers[202] == {b"chunk queued for a re-hash\n"}, answers
        assert answers.get(503, {b"too many chunk reports queued\n"}) == {b"too many chunk reports queued\n"}, answers
        wait_for(
            lambda: _metric(d, "bdn_bad_chunk_reports_refuted_total") >= len(real),
            120,
            "every real report refuted",
            0.1,
            detail=d.log,
        )
        # repeats while queued or just refuted are not hashed again; nothing was dropped
        assert _metric(d, "bdn_bad_chunk_reports_refuted_total") == len(real)
        assert _metric(d, "bdn_chunks_quarantined_total") == 0
        assert d.get("/v1/snapshots/step000001")["state"] == "ready"
        assert _digests(path) == before == _digests(ck)
        assert "Traceback" not in d.log(), d.log()


def _hint(d: Daemon, identity: str, me: str) -> Outcome:
    """A member ``me`` asks ``d``'s transfer server for a random chunk of ``identity`` (held up
    to 0.1 s): the outcome."""
    outcome, _ = ask_daemon(
        KEYS, d.node_id, d.transfer_port, os.urandom(16).hex(), 1024, wait_s=0.1, snapshot=identity, me=me
    )
    return outcome


def test_a_chunk_request_hinting_a_snapshot_nobody_published_fails_it_at_once(tmp_path: Path) -> None:
    """Join on hint: a daemon asked (over the transfer wire) for a chunk of a snapshot it does not
    know starts loading it.
    Before the fix an invented identity was loaded as ``wait_publish``: each one a job polling
    the bucket every ``manifest_poll_s`` for ``manifest_wait_s`` (600 s), so a member (or a
    buggy one) made one bucket request per second per invented name."""
    (tmp_path / "bucket").mkdir()
    with running(
        Daemon(tmp_path / "work", "node0", f"file://{tmp_path}/bucket", extra_env={"BDN_LOAD_STARTUP": "false"})
    ) as d:
        for i in range(3):
            assert _hint(d, f"invented{i:04d}", "hinter") is Outcome.NOT_HERE
        for i in range(3):
            ident = f"invented{i:04d}"
            rec = wait_for(
                lambda ident=ident: d.get(f"/v1/snapshots/{ident}"),
                120,
                f"{ident} to fail",
                0.1,
                until=lambda rec: rec["state"] == "failed",
            )
            assert (
                rec["reason"] == f"snapshot {ident}: nothing is published under {ident}/ in file://{tmp_path}/bucket"
            ), rec


def test_invented_hints_leave_a_bounded_number_of_failed_records(tmp_path: Path) -> None:
    """Each invented identity fails at once (above), but its record stayed in the catalog for the
    daemon's lifetime: a stream of hints grew it without bound. At most MAX_FAILED are kept."""
    (tmp_path / "bucket").mkdir()
    n = MAX_FAILED + 20
    with running(
        Daemon(tmp_path / "work", "node0", f"file://{tmp_path}/bucket", extra_env={"BDN_LOAD_STARTUP": "false"})
    ) as d:

        def hints(first: int) -> None:  # 8 askers at once: each answer waits its 0.1 s
            for i in range(first, n, 8):
                assert _hint(d, f"invented{i:04d}", f"hinter{first}") is Outcome.NOT_HERE

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(hints, range(8)))
        snaps = wait_for(
            lambda: d.get("/v1/status")["snapshots"],
            120,
            "every invented identity failed",
            0.1,
            until=lambda snaps: (
                snaps
                and all(s["state"] == "failed" for s in snaps)
                and d.get(f"/v1/snapshots/invented{n - 1:04d}").get("state") == "failed"
            ),
        )
        assert len(snaps) <= MAX_FAILED, len(snaps)
        assert f"invented{n - 1:04d}" in {s["identity"] for s in snaps}  # the newest are kept
        assert d.get("/v1/health")["status"] == "ok"
