"""Waiting for a snapshot nobody published (issue 31, class 10), against a real bdnd: the client
says "not published yet (waited N s)", and the daemon stops looking when its asker gave up.

Before the fix ``DaemonClient.open(identity, timeout=...)`` raised a bare "not ready after N s
(state queued)" while the daemon went on polling the bucket for ``manifest_wait_s`` (600 s).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bdn.client import DaemonClient, NotPublished
from bdn.publish import publish_full
from support.checkpoints import make_state, write_hf_dir
from support.swarm import Daemon, running

pytestmark = pytest.mark.timeout(600)


@pytest.fixture()
def daemon(tmp_path: Path):
    bucket = tmp_path / "bucket"
    publish_full(
        f"file://{bucket}", "step000001", 1, dir=write_hf_dir(tmp_path / "ck", make_state(0), 1), chunk_size=64 << 10
    )
    d = Daemon(
        tmp_path / "w",
        "node0",
        f"file://{bucket}",
        extra_env={"BDN_LOAD_STARTUP": "false", "BDN_STARTUP_SETTLE_S": "0", "BDN_MANIFEST_POLL_S": "0.2"},
    )
    with running(d):
        yield d


def test_open_of_an_unpublished_snapshot_says_so_and_the_daemon_stops_looking(daemon: Daemon) -> None:
    with DaemonClient(daemon.url) as client:
        with pytest.raises(NotPublished) as err:
            client.open("step000009", timeout=3)
        assert isinstance(err.value, TimeoutError)
        msg = str(err.value)
        assert msg.startswith("step000009 is not published yet (waited "), msg
        assert "step000009/bdn.manifest.json" in msg, msg
    # the daemon's polling was bounded by the request: it gives up instead of polling 600 s
    rec = daemon.wait_settled("step000009", timeout=120)
    assert rec["state"] == "failed" and "is not published yet (waited" in rec["reason"], rec
    # a later publication still loads: a new request starts over
    with DaemonClient(daemon.url) as client, client.open("step000001", timeout=120) as snap:
        assert snap.policy_version == 1


def test_bdnctl_prefetch_wait_publish_says_not_published(daemon: Daemon) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bdn.cli.bdnctl",
            "--url",
            daemon.url,
            "prefetch",
            "step000008",
            "--wait",
            "--wait-publish",
            "--timeout",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert out.returncode == 1, out
    last = out.stderr.splitlines()[-1]  # (before it, one line per change of the reason: stderr is no terminal)
    assert last.startswith("bdnctl: error: step000008") and "is not published yet (waited " in last, out.stderr
    rec = daemon.wait_settled("step000008", timeout=120)
    assert rec["state"] == "failed" and "not published yet" in rec["reason"], rec


def test_a_bad_publish_timeout_is_400(daemon: Daemon) -> None:
    for bad in ("soon", "-1", "nan", "inf"):
        status, body = daemon.request("POST", f"/v1/snapshots/step000007/prefetch?wait_publish=1&publish_timeout={bad}")
        assert status == 400 and "publish_timeout" in body["error"], (bad, status, body)
