"""bench/fleetsim runs bdnd's own fetch policy (bdn.daemon.fetch.policy) and upload admission
(bdn.daemon.serve.uploads), not policies of its own (issue 27): this fails if it stops importing and
calling them, and a small run shows that it exercises them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytest.importorskip("simpy")

from bench.fleetsim.scenario import Scenario
from bench.fleetsim.sim import FleetSim

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9


def _uses(path: Path, module: str) -> set[str]:
    """The names ``path`` imports from ``module`` and also uses (called or read) in its code."""
    tree = ast.parse(path.read_text())
    imported = {
        a.asname or a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and n.module == module
        for a in n.names
    }
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return imported & used


def test_the_simulator_imports_and_calls_the_daemons_fetch_policy_and_upload_admission() -> None:
    sim = ROOT / "bench" / "fleetsim" / "sim.py"
    assert "SourceBook" in _uses(sim, "bdn.daemon.fetch.policy")
    assert {"Uploads", "Admission"} <= _uses(sim, "bdn.daemon.serve.uploads")
    # the peer sets it runs pick holders and race the endgame by the daemon's rules
    assert {"endgame", "holder_key"} <= _uses(ROOT / "bdn" / "control" / "peerset.py", "bdn.daemon.fetch.policy")
    # and bdnd's fetcher ranks holders by the same policy module
    assert "policy" in _uses(ROOT / "bdn" / "daemon" / "fetch" / "fetcher.py", "bdn.daemon.fetch")
    assert not (ROOT / "bdn" / "control" / "uploadq.py").exists()  # the simulator-only upload queue


def test_a_small_run_exercises_the_policy_objects() -> None:
    sim = FleetSim(
        Scenario("t", 12, 2 * GB, 16, 100e9 / 8, 10 * GB, 100e6, bucket_concurrency=32, endgame_chunks=4, max_uploads=2)
    )
    r = sim.run()
    assert r["done_nodes"] == r["live_nodes"] == 12
    nodes = list(sim.nodes.values())
    # every upload went through Uploads.admit and gave its slot back
    assert sum(sum(x.sent_by_chunk.values()) for x in nodes) > 0
    assert all(x.upl is not None and x.upl.running == 0 and not x.upl.by_address for x in nodes)
    # the SourceBook of the receivers measured their peers' rates, on the simulated clock
    rated = [x for x in nodes if x.book is not None and x.book.median_rate() is not None]
    assert len(rated) >= 6
    assert all(0 < x.book.median_rate() <= 100e9 / 8 * 1.0001 for x in rated)
