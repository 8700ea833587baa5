"""Issue 31, class 7: ``<store>/current`` replaced by a directory (or a file) by someone else. The
daemon never deletes or renames over what it did not make: it reports it in one clear line, at
start and at each change of the served snapshot, keeps serving, and makes the link again once
the operator moved the directory away. Real daemon, a file:// bucket."""

from __future__ import annotations

from pathlib import Path

from bdn.publish import publish_startup
from support.api import http, wait_fleet, wait_for
from support.chains import chain_states, publish_chain, write_chain
from support.swarm import Daemon

CHUNK = 64 << 10
HOT_LOAD = "/hot_load/v1/models/hot_load"


def test_a_directory_named_current_is_reported_and_left_alone(tmp_path: Path) -> None:
    bucket = f"file://{tmp_path}/bucket"
    publish_chain(bucket, write_chain(tmp_path / "ck", chain_states(1, scale=2, frac=0.02)), chunk_size=CHUNK)
    publish_startup(bucket, "step000001")
    d = Daemon(tmp_path / "nodes", "lone", bucket, extra_env={"BDN_STARTUP_SETTLE_S": "0"})
    try:
        d.start([])
        d.wait_healthy()
        wait_fleet(d.url, "step000001")
        link = d.store / "current"
        assert link.is_symlink()
        # someone replaces the link with a directory of their own
        link.unlink()
        link.mkdir()
        (link / "theirs.txt").write_text("not bdn's")
        assert http("POST", d.url + HOT_LOAD, {"identity": "step000002"})[0] == 200
        wait_fleet(d.url, "step000002")  # serving goes on
        line = f"{link} is a directory, not the symlink bdn makes: bdn did not make it and leaves it as it is"
        wait_for(lambda: line in d.log(), 60, "the directory reported")
        assert (link / "theirs.txt").read_text() == "not bdn's" and not link.is_symlink()
        assert not list(d.store.glob(".current.*"))  # no temporary link left behind
        assert d.get("/v1/health")["status"] == "ok"

        d.stop()
        d.start([])  # at start: reported again, still left alone (the link cannot say what was
        d.wait_healthy()  # served; the hot-load target kept across the restart does: step000002)
        wait_fleet(d.url, "step000002")
        wait_for(lambda: d.log().count(line) >= 2, 120, "the directory reported at start")
        assert (link / "theirs.txt").read_text() == "not bdn's"

        # the operator moves it away: the next change makes the link again
        (link / "theirs.txt").unlink()
        link.rmdir()
        assert http("POST", d.url + HOT_LOAD, {"identity": "step000001"})[0] == 200
        wait_fleet(d.url, "step000001")
        wait_for(lambda: link.is_symlink(), 60, "the link made again")
        assert link.resolve() == (d.store / "step000001").resolve()
    finally:
        d.stop()
