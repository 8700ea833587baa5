"""Engines that stop polling (issue 31, round 3): one real bdnd, real engine processes
(examples/engine/server.py) killed with SIGKILL, so nothing unregisters them.

The daemon marks an engine it has not heard from for ``engine_stale_s`` stale (the replica stops
waiting for it and names it in its reason; with no live engine left the replica is in ``error``),
and drops it after ``engine_ttl_s`` (docs/ENGINES.md, "Liveness"). Every step waits on the
daemon's reported state with a generous deadline; nothing depends on a wall-clock window.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bdn.client import hot_load, hot_load_status, list_engines
from bdn.publish import publish_delta, publish_full, publish_startup
from support.api import http, wait_for
from support.swarm import Swarm, free_port

ROOT = Path(__file__).resolve().parents[1]
SERVER = ROOT / "examples" / "engine" / "server.py"
sys.path.insert(0, str(SERVER.parent))
import tinygpt  # noqa: E402

CFG = tinygpt.TinyGPTConfig(n_layer=2, n_head=4, n_embd=64, n_positions=256)
CHUNK = 64 << 10
STALE_S, TTL_S = 2.0, 8.0


class EngineProc:
    """One examples/engine/server.py process registered with ``daemon_url`` as ``name``."""

    def __init__(self, workdir: Path, daemon_url: str, name: str) -> None:
        self.port = free_port()
        self.name = name
        self.log_path = workdir / f"engine-{name}.log"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    str(SERVER),
                    "--bdn-url",
                    daemon_url,
                    "--listen",
                    f"127.0.0.1:{self.port}",
                    "--replica-id",
                    "node0",
                    "--name",
                    name,
                    "--poll-timeout",
                    "2",
                    "--log-level",
                    "debug",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def policy(self) -> int | None:
        assert self.proc.poll() is None, f"engine {self.name} exited {self.proc.returncode}:\n{self.log()}"
        try:
            status, body = http("GET", f"http://127.0.0.1:{self.port}/health", timeout=5)
        except OSError:
            return None
        return body.get("policy_version") if status == 200 else None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc.wait()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[dict[str, Any]]:
    bucket = f"file://{tmp_path}/bucket"
    w = [tinygpt.init_weights(CFG, 0)]
    for step in (1, 2):
        w.append(tinygpt.optimizer_step(w[-1], 0.02, step))
    dirs = [tinygpt.save_checkpoint(tmp_path / "trainer" / f"step00000{i + 1}", CFG, wi) for i, wi in enumerate(w)]
    publish_full(bucket, "step000001", 1, dir=dirs[0], chunk_size=CHUNK)
    publish_startup(bucket, "step000001")
    for i in (1, 2):
        publish_delta(
            bucket, f"step00000{i + 1}", i + 1, f"step00000{i}", dir=dirs[i], base_dir=dirs[i - 1], chunk_size=CHUNK
        )
    env = {"BDN_ENGINE_STALE_S": str(STALE_S), "BDN_ENGINE_TTL_S": str(TTL_S)}
    engines: list[EngineProc] = []
    with Swarm(tmp_path / "nodes", 1, bucket, extra_env=env) as swarm:
        try:
            yield {"url": swarm.daemons[0].url, "engines": engines, "tmp": tmp_path, "daemon": swarm.daemons[0]}
        finally:
            for e in engines:
                e.stop()


def _row(url: str) -> dict[str, Any]:
    (row,) = hot_load_status(url)
    return row


def _engine_ids(url: str) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in list_engines(url)["engines"]}


@pytest.mark.timeout(900)  # a deadline for a hang: three engine start-ups took 221 s at load 25 on 2 cores
def test_a_killed_engine_goes_stale_then_is_dropped_and_the_hot_load_says_why(node: dict[str, Any]) -> None:
    url, engines = node["url"], node["engines"]
    for name in ("doomed", "survivor"):
        engines.append(EngineProc(node["tmp"], url, name))
    for e in engines:
        wait_for(e.policy, 180, f"engine {e.name} on policy 1", 0.2, until=lambda v: v == 1, detail=e.log)
    wait_for(
        lambda: _row(url),
        120,
        "the replica done on step000001 with both engines",
        0.2,
        until=lambda r: (
            r["loading_state"]["stage"] == "done"
            and r["engines"] == 2
            and r["current_snapshot_identity"] == "step000001"
        ),
    )
    doomed, survivor = engines
    doomed_id = _engine_ids(url)["doomed"]["engine_id"]
    doomed.proc.kill()  # SIGKILL: no DELETE, no last words
    doomed.proc.wait()

    hot_load(url, "step000002", previous="step000001")
    wait_for(survivor.policy, 180, "the live engine on policy 2", 0.2, until=lambda v: v == 2, detail=survivor.log)
    # the replica stops waiting for the killed engine once it is stale, and says so
    row = wait_for(
        lambda: _row(url),
        120,
        "the replica done on step000002 without the killed engine",
        0.2,
        until=lambda r: r["loading_state"]["stage"] == "done" and r["current_snapshot_identity"] == "step000002",
    )
    assert row["engines"] == 1, row
    reason = row["loading_state"]["reason"]
    assert reason.startswith(f"not counted: engine {doomed_id} (doomed) not seen for"), row
    assert f"(stale after {STALE_S:g} s, dropped after {TTL_S:g} s)" in reason
    listed = _engine_ids(url)
    assert listed["doomed"]["stale"] is True and listed["survivor"]["stale"] is False
    # engine_ttl_s later it is gone from the table and from the reason
    wait_for(lambda: _engine_ids(url), 120, "the killed engine dropped", 0.2, until=lambda d: set(d) == {"survivor"})
    row = wait_for(lambda: _row(url), 60, "the reason cleared", 0.2, until=lambda r: r["loading_state"]["reason"] == "")
    assert row["loading_state"]["stage"] == "done" and row["engines"] == 1

    # The last engine killed: the next hot-load reports the replica in error, naming it (not "loading" forever)
    survivor_id = _engine_ids(url)["survivor"]["engine_id"]
    survivor.proc.kill()
    survivor.proc.wait()
    hot_load(url, "step000003", previous="step000002")
    row = wait_for(
        lambda: _row(url),
        120,
        "the replica in error: its only engine stopped polling",
        0.2,
        until=lambda r: r["loading_state"]["stage"] == "error" and r["loading_state"]["identity"] == "step000003",
    )
    assert row["loading_state"]["reason"].startswith(
        f"every engine stopped polling: engine {survivor_id} (survivor)"
    ), row
    assert row["current_snapshot_identity"] == "step000002" and row["engines"] == 0
    # a new engine registering takes the target; the replica is done again
    engines.append(EngineProc(node["tmp"], url, "replacement"))
    wait_for(
        engines[-1].policy,
        180,
        "the replacement engine on policy 3",
        0.2,
        until=lambda v: v == 3,
        detail=engines[-1].log,
    )
    wait_for(
        lambda: _row(url),
        120,
        "the replica done on step000003 with the replacement",
        0.2,
        until=lambda r: r["loading_state"]["stage"] == "done" and r["current_snapshot_identity"] == "step000003",
    )
    log = node["daemon"].log_path.read_text(errors="replace")
    assert f"engine {doomed_id} (doomed) not seen for over {STALE_S:g} s: stale" in log
    assert f"engine {doomed_id} (doomed) not seen for over {TTL_S:g} s: dropped" in log
