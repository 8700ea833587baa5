"""Repair of a ready snapshot (bdn/daemon/snapshots/runner.py ``repair``) attacked with real bdnd
processes: many repair requests at once, a watcher reading the snapshot's record and files all
along, and kill -9 while a repair re-fetches (the bucket throttled so that it is in flight), then a
restart.

Promises checked: every answer is 200 or 409 with one line, never a 5xx; exactly one request
starts the repair; whenever the record says ``ready``, its path holds every file at its size and
the local API serves the trainer's bytes; after kill -9 and a restart the snapshot is ready again
with the trainer's bytes."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from bdn.publish import publish_full
from support.api import wait_for
from support.checkpoints import flip_byte, make_state, write_hf_dir
from support.swarm import Daemon

CHUNK = 64 << 10
IDENT = "step000001"
SHARD = "model-00001-of-00002.safetensors"

pytestmark = pytest.mark.timeout(900)


class Watcher:
    """Reads the snapshot's record over and over; each time it says ``ready``, checks that its
    path holds every file of the trainer's directory at its size. ``problems`` lists what was
    wrong (empty: every hand-out pointed at complete files)."""

    def __init__(self, d: Daemon, ck: Path) -> None:
        self.d, self.sizes = d, {p.name: p.stat().st_size for p in ck.iterdir()}
        self.problems: list[str] = []
        self.readies = 0
        self.raced = 0  # answers 'ready' whose directory a repair moved before it was looked at
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                status, rec = self.d.request("GET", f"/v1/snapshots/{IDENT}", timeout=30)
            except OSError:
                continue  # the daemon is down (killed): nothing handed out
            if status >= 500:
                self.problems.append(f"GET answered {status}: {rec}")
            if status != 200 or rec.get("state") != "ready":
                continue
            self.readies += 1
            path = Path(rec["path"])
            for name, size in self.sizes.items():
                try:
                    got = (path / name).stat().st_size
                except OSError as e:
                    # a repair that began after the answer moves the directory (a reader racing
                    # it sees that, unavoidably): wrong only if the daemon STILL says ready
                    again = self.d.request("GET", f"/v1/snapshots/{IDENT}", timeout=30)
                    if again[0] == 200 and again[1].get("state") == "ready" and not (path / name).exists():
                        self.problems.append(f"ready (asked twice), but {path / name}: {e.strerror}")
                    else:
                        self.raced += 1
                    continue
                if got != size:
                    self.problems.append(f"ready, but {path / name} has {got} bytes, not {size}")

    def close(self) -> None:
        self.stop.set()
        self.thread.join(60)


def _start(d: Daemon) -> None:
    d.start([])
    d.wait_healthy(240)


def test_concurrent_repairs_and_kill_9_mid_repair_never_hand_out_missing_files(tmp_path: Path) -> None:
    bucket = f"file://{tmp_path}/bucket"
    ck = write_hf_dir(tmp_path / "ck", make_state(0, scale=4), 1)
    publish_full(bucket, IDENT, 1, dir=ck, chunk_size=CHUNK)
    good = (ck / SHARD).read_bytes()
    # 2 Mbit/s from the bucket: a re-fetch of a few 64 KiB chunks takes a second or more, so that
    # the kill -9 below lands while the repair is in flight
    d = Daemon(tmp_path / "work", "n1", bucket, extra_env={"BDN_LOAD_STARTUP": "false", "BDN_BUCKET_MBIT": "2"})
    _start(d)
    w = Watcher(d, ck)
    try:
        assert d.prefetch(IDENT)[0] == 202
        path = Path(d.wait_ready(IDENT, 300)["path"])
        # round 1: eight repair requests at once on a snapshot with bad bytes in four chunks
        for k in range(4):
            flip_byte(path / SHARD, k * 3 * CHUNK + 11)
        answers: list[tuple[int, object]] = []
        go = threading.Barrier(8)

        def repair() -> None:
            go.wait()
            answers.append(d.request("POST", f"/v1/snapshots/{IDENT}/repair", timeout=120))

        threads = [threading.Thread(target=repair) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        statuses = sorted(s for s, _ in answers)
        assert len(answers) == 8 and set(statuses) <= {200, 409}, answers
        started = [a for s, a in answers if s == 200 and a["corrupted"]]  # type: ignore[index]
        assert len(started) == 1, answers
        d.wait_ready(IDENT, 300)
        assert (path / SHARD).read_bytes() == good
        # round 2: kill -9 while the repair re-fetches, then a restart
        for k in range(4):
            flip_byte(path / SHARD, k * 3 * CHUNK + 11)
        status, rep = d.request("POST", f"/v1/snapshots/{IDENT}/repair")
        assert status == 200 and rep["corrupted"], rep
        assert rep["state"] == "downloading", rep
        d.kill()
        _start(d)
        # the interrupted repair resumes (before the fix: the restart removed the staging
        # directory as a leftover, and the snapshot was unknown, 404, until loaded from scratch)
        wait_for(
            lambda: d.request("GET", f"/v1/snapshots/{IDENT}")[0],
            60,
            f"{IDENT} known after the restart",
            0.1,
            until=lambda st: st != 404,
            detail=d.log,
        )
        rec = d.wait_ready(IDENT, 300)
        assert (Path(rec["path"]) / SHARD).read_bytes() == good
        for p in ck.iterdir():
            assert (Path(rec["path"]) / p.name).read_bytes() == p.read_bytes(), p.name
        assert d.request("POST", f"/v1/snapshots/{IDENT}/repair")[1]["corrupted"] == []
    finally:
        w.close()
        d.stop()
    assert w.readies > 0
    assert w.problems == [], w.problems[:5]
    assert "Traceback" not in d.log()


def _post_json(d: Daemon, path: str, body: object) -> tuple[int, object]:
    req = urllib.request.Request(
        d.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_an_engine_that_failed_on_a_snapshot_under_repair_is_offered_it_again_once_repaired(tmp_path: Path) -> None:
    """An engine serving step 1 is offered step 2 (a lease on its directory); before it reads the
    files, one byte of step 2 goes bad and a repair runs (a peer's report, the scrub, or
    ``bdnctl verify --repair``). The repair takes the directory away (nothing hands out a
    snapshot whose bytes are being re-fetched), so the engine's read fails and it acks the error.
    Once step 2 is ready again it is offered to that engine again (the driver polls ``after`` the
    failed identity), and the engine completes the hot-load; a second failure of the same ready
    snapshot is final (not offered in a loop)."""
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    for v in (1, 2):
        ck = write_hf_dir(tmp_path / "src" / f"step00000{v}", make_state(v, scale=4), v)
        publish_full(f"file://{bucket}", f"step00000{v}", v, dir=ck, chunk_size=CHUNK)
    d = Daemon(tmp_path / "work", "n1", f"file://{bucket}", extra_env={"BDN_LOAD_STARTUP": "false"})
    _start(d)
    try:
        status, reg = _post_json(d, "/v1/engines", {"name": "engine"})
        assert status == 201, reg
        eid = reg["engine_id"]  # type: ignore[index]
        assert _post_json(d, "/hot_load/v1/models/hot_load", {"identity": "step000001"})[0] == 200
        assert d.get(f"/v1/engines/{eid}/next?timeout=60")["identity"] == "step000001"
        assert _post_json(d, f"/v1/engines/{eid}/ack", {"identity": "step000001", "pause_ms": 1})[0] == 200
        assert _post_json(d, "/hot_load/v1/models/hot_load", {"identity": "step000002"})[0] == 200
        offer = d.get(f"/v1/engines/{eid}/next?after=step000001&timeout=60")
        assert offer["identity"] == "step000002", offer
        offered = Path(offer["path"])
        flip_byte(offered / SHARD, 100)
        status, rep = d.request("POST", "/v1/snapshots/step000002/repair")
        assert status == 200 and rep["corrupted"], rep
        # the engine's read of the offered files fails while they are re-fetched: it acks the error
        error = {"identity": "step000002", "pause_ms": 0, "error": "FileNotFoundError: shard gone"}
        assert _post_json(d, f"/v1/engines/{eid}/ack", error)[0] == 200
        d.wait_ready("step000002")
        again = d.get(f"/v1/engines/{eid}/next?after=step000002&timeout=120")
        assert again["identity"] == "step000002" and Path(again["path"]) == offered, again
        want = {p.name: p.read_bytes() for p in (tmp_path / "src" / "step000002").iterdir()}
        assert {n: (offered / n).read_bytes() for n in want} == want  # repaired, whole, at the offered path
        engines = d.get("/v1/engines")["engines"]
        assert engines[0]["error"] is None and engines[0]["offered"] == "step000002", engines
        # failing again on the same ready snapshot is final: the replica reports the error
        assert _post_json(d, f"/v1/engines/{eid}/ack", dict(error, error="shape mismatch"))[0] == 200
        assert d.request("GET", f"/v1/engines/{eid}/next?after=step000002&timeout=2")[0] == 204
        # a good ack of the re-offered snapshot completes the hot-load
        assert _post_json(d, f"/v1/engines/{eid}/ack", {"identity": "step000002", "pause_ms": 1})[0] == 200

        def done() -> bool:
            (row,) = d.get("/hot_load/v1/models/hot_load")["replicas"]
            return row["loading_state"]["stage"] == "done" and row["current_snapshot_identity"] == "step000002"

        wait_for(done, 120, "the replica done on step 2")
    finally:
        d.stop()
