"""The soak's short variant (bench/soak, issue 12): four real daemons, 1.75 minutes, every fault kind.

One run of ``python -m bench.soak`` (the same harness as the 30-minute soak: a moto bucket behind
the fault proxy, real bdnd processes, a real engine process, the lying peer, tinygpt checkpoints
published with ``bdn.publish`` and hot-loaded through the fleet API) with faults in a fixed order:
kill -9 + restart, the liar joining, a 2-4 s burst of bucket 503s (within the daemons' retry budget),
and an engine crash (kill -9, no unregister). The tests read its JSON result.

They assert outcomes, never timing: no wrong byte was handed out (every ready snapshot was
re-hashed against the trainer's files while served, the engine's weights digest checked), at
least one hot-load reached ``done`` on every live replica after a fault, after the engine crash
the fleet still delivered a later snapshot to every live daemon, every daemon is alive at the
end, and no daemon's open fds grew past a generous bound.

Known daemon limits this run does NOT assert (the JSON and bench/soak's FINDING lines report
them): an engine killed without unregistering blocks its replica's ``done`` (issue 10, engine
liveness); a 503 burst longer than the bucket client's retries (8 attempts) fails the snapshot,
and every delta based on it.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
NODES = 4
FD_BOUND = 256  # a daemon uses ~30-40; a leak of one per chunk or request would pass this fast

pytestmark = pytest.mark.timeout(300)

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # bench/ is not an installed package


def test_chaos_plan_is_seeded_bounded_and_covers_every_kind() -> None:
    from bench.soak.chaos import KINDS, ChaosParams, plan

    p = ChaosParams(every=(10.0, 20.0), quiet_s=30.0)
    a, b = plan(random.Random(3), p, 100.0, 700.0), plan(random.Random(3), p, 100.0, 700.0)
    assert a == b and a != plan(random.Random(4), p, 100.0, 700.0)
    times = [t for t, _ in a]
    assert times == sorted(times) and 100.0 < times[0] and times[-1] < 700.0 - 30.0
    for i in range(0, len(a) - len(KINDS) + 1, len(KINDS)):  # every full round holds every kind once
        assert sorted(k for _, k in a[i : i + len(KINDS)]) == sorted(KINDS)
    given = plan(random.Random(3), ChaosParams(kinds=("liar", "kill"), shuffle=False), 0.0, 400.0)
    assert [k for _, k in given[:4]] == ["liar", "kill", "liar", "kill"]
    assert plan(random.Random(3), ChaosParams(kinds=()), 0.0, 400.0) == []  # a run without faults


@pytest.fixture(scope="module")
def soak(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("soak")
    out = tmp / "soak.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    cmd = [
        sys.executable,
        "-m",
        "bench.soak",
        "--nodes",
        str(NODES),
        "--minutes",
        "1.75",
        "--seed",
        "7",
        "--out",
        str(out),
        "--workdir",
        str(tmp / "work"),
        "--keep-workdir",
        "--n-embd",
        "256",
        "--n-layer",
        "4",
        "--chunk-kib",
        "256",
        "--anchor-every",
        "5",
        "--interval",
        "10,14",
        "--faults",
        "kill,liar,s3_503,engine_crash,slow",
        "--fault-order",
        "given",
        "--chaos-every",
        "12,16",
        "--down",
        "3,6",
        "--liar-stay",
        "15,25",
        "--burst",
        "2,4",
        "--slow-stay",
        "10,15",
        "--max-down",
        "1",
        "--quiet-tail",
        "15",
        "--sample-s",
        "2",
        "--warmup-s",
        "20",
        "--term-timeout",
        "10",
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=280)
    assert out.exists(), f"no result (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    result = json.loads(out.read_text())
    result["_stdout"] = proc.stdout
    print(proc.stdout)
    return result


def _explain(r: dict[str, Any]) -> str:
    return r["_stdout"][-3000:] + "\nharness errors: " + json.dumps(r["harness_errors"])[:3000]


def test_the_harness_ran_every_fault(soak: dict[str, Any]) -> None:
    assert soak["harness_errors"] == [], _explain(soak)
    assert not soak["interrupted"]
    assert set(soak["faults_by_kind"]) == {"kill", "liar", "s3_503", "engine_crash", "slow"}, soak["chaos"]
    assert soak["hotloads"]["posted"] >= 3, soak["hotload_records"]


def test_no_wrong_bytes_handed_out(soak: dict[str, Any]) -> None:
    v = soak["verify"]
    assert v["wrong_bytes_handed_out"] == 0, v["wrong"]
    # It really looked: snapshots on several daemons, ranges over the API, the engine's weights.
    assert v["distinct_ready"] >= NODES and v["files_hashed"] > 0, v
    assert v["http_range_checks"] > 0 and v["engine_checks"] > 0, v


def test_a_hot_load_completes_after_faults(soak: dict[str, Any]) -> None:
    h = soak["hotloads"]
    assert h["completed_after_faults"] >= 1, json.dumps(soak["hotload_records"], indent=1)[:6000]


def test_the_fleet_delivers_after_the_engine_crash(soak: dict[str, Any]) -> None:
    crash = min(e["t_s"] for e in soak["chaos"] if e.get("fault") == "engine_crash")
    later = [h for h in soak["hotload_records"] if h["t_post"] > crash]
    assert later, "no hot-load was posted after the engine crash"
    assert any(h["ready_s"] is not None for h in later), json.dumps(later, indent=1)[:6000]


def test_every_daemon_alive_at_the_end(soak: dict[str, Any]) -> None:
    end = soak["end"]
    assert sorted(end["alive"]) == [f"node{i}" for i in range(NODES)], (end, soak["unexpected_exits"])
    assert not [e for e in soak["chaos"] if e.get("action") == "restart_failed"], soak["chaos"]


def test_open_fds_stay_bounded(soak: dict[str, Any]) -> None:
    assert soak["samples"], "no resource samples"
    worst = max(soak["samples"], key=lambda s: s[4])
    assert worst[4] < FD_BOUND, f"{worst[1]} (pid {worst[2]}) had {worst[4]} open fds at {worst[0]} s"


def test_memory_split_by_owner_adds_up(soak: dict[str, Any]) -> None:
    # bench/soak/maps.py: glibc main heap + thread arenas + other anonymous ~= RssAnon of the same life
    assert {m[1] for m in soak["maps"]} == {f"node{i}" for i in range(NODES)}, soak["maps"][:5]
    for t, node, pid, heap, arenas, _, other, threads in soak["maps"]:
        near = min((s for s in soak["samples"] if s[2] == pid), key=lambda s: abs(s[0] - t))
        assert heap > 0 and threads >= 1  # 1: a restarted daemon still importing
        assert 0.7 * near[7] < heap + arenas + other < 1.3 * near[7], (node, t, heap, arenas, other, near)


def test_every_daemons_sigterm_exit_is_recorded(soak: dict[str, Any]) -> None:
    # bench/soak/fleet.py Fleet.close: SIGTERM to all at once, each one's exit time and code (or
    # "did not exit in N s" before the SIGKILL), so a slow shutdown shows in the JSON, not silently killed.
    exits = soak["end"]["exits"]
    assert sorted(exits) == [f"node{i}" for i in range(NODES)], exits
    for node, e in exits.items():
        assert isinstance(e["pid"], int) and e["result"] == soak["end"]["shutdown"][node], (node, e)
        if e["rc"] is None:
            assert e["exit_s"] is None and e["result"].startswith("did not exit in "), (node, e)
        else:
            assert e["result"] == f"exit {e['rc']}" and 0 <= e["exit_s"], (node, e)
