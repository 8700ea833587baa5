"""The soak, top to bottom: bring the fleet up, run trainer + chaos + verifier + sampler, report.

:func:`run_soak` is the whole run; it returns the result document (also written to ``cfg.out``)
and, whatever happens (an exception, Ctrl-C, SIGTERM turned into KeyboardInterrupt by the CLI),
kills every process it started before returning or raising.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import threading
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.soak import flat, report
from bench.soak.chaos import Chaos, ChaosParams, plan
from bench.soak.fleet import REPO, Fleet, http_json
from bench.soak.sampler import Sampler
from bench.soak.trainer import Trainer
from bench.soak.verify import Verifier


@dataclass
class SoakConfig:
    """One soak run. Times in seconds unless named ``_min``; ``interval`` is between POSTs."""

    nodes: int = 8
    minutes: float = 30.0
    seed: int = 1
    out: Path | None = Path("bench/results/soak.json")
    workdir: Path | None = None
    n_embd: int = 384  # with n_layer 6: ~10.9 M parameters, a 21.8 MB bf16 model.safetensors
    n_layer: int = 6
    anchor_every: int = 10
    interval: tuple[float, float] = (20.0, 30.0)
    chunk_size: int = 1 << 20
    chaos: ChaosParams = field(default_factory=ChaosParams)
    sample_s: float = 5.0
    reverify_s: float = 30.0
    warmup_s: float = 120.0
    log_level: str = "info"
    term_timeout: float = 20.0
    keep_workdir: bool = False
    daemon_env: dict[str, str] = field(default_factory=dict)  # every daemon (MALLOC_ARENA_MAX=2, BDN_EVENT_LOOP=...)
    node_env: dict[str, dict[str, str]] = field(default_factory=dict)  # per node, over daemon_env: A/B in one run
    engine_node: int = 1


def _thread(name: str, fn: Any, errors: list[dict[str, Any]], *args: Any) -> threading.Thread:
    def body() -> None:
        try:
            fn(*args)
        except Exception as e:  # recorded: a harness loop that died must be visible in the result
            errors.append(
                {"thread": name, "error": f"{type(e).__name__}: {e}"[:500], "tb": traceback.format_exc()[-2000:]}
            )

    th = threading.Thread(target=body, name=name, daemon=True)
    th.start()
    return th


def _wait_fleet_on(trainer: Trainer, identity: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reps = trainer.fleet_view()
        live = {n.daemon.node_id for n in trainer.fleet.live()}
        if reps is not None:
            by = {r.get("replica_id"): r for r in reps}
            if all((by.get(n) or {}).get("current_snapshot_identity") == identity for n in live):
                return True
        time.sleep(0.5)
    return False


def run_soak(cfg: SoakConfig) -> dict[str, Any]:
    """Run one soak (see the package doc); the result document."""
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    rng = random.Random(cfg.seed)
    t_start = time.monotonic()

    def clock() -> float:
        return time.monotonic() - t_start

    workdir = cfg.workdir or Path(tempfile.mkdtemp(prefix="bdn-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    shm_base = Path("/dev/shm") if Path("/dev/shm").is_dir() else workdir
    shm_root = Path(tempfile.mkdtemp(prefix="bdn-soak-shm-", dir=shm_base))
    fleet = Fleet(
        workdir,
        shm_root,
        cfg.nodes,
        clock,
        cfg.log_level,
        cfg.engine_node,
        daemon_env=cfg.daemon_env,
        node_env=cfg.node_env,
    )
    errors: list[dict[str, Any]] = []
    stop = threading.Event()
    chaos = Chaos(fleet, random.Random(rng.randrange(1 << 30)), clock, cfg.chaos)
    trainer = Trainer(
        fleet,
        workdir,
        random.Random(rng.randrange(1 << 30)),
        clock,
        chaos.injected,
        n_embd=cfg.n_embd,
        n_layer=cfg.n_layer,
        anchor_every=cfg.anchor_every,
        interval=cfg.interval,
        chunk_size=cfg.chunk_size,
        end_grace_s=cfg.chaos.quiet_s,  # the quiet tail: no fault holds the last hot-load back
    )
    verifier = Verifier(fleet, trainer, random.Random(rng.randrange(1 << 30)), clock, cfg.reverify_s)
    sampler: Sampler | None = None
    threads: list[threading.Thread] = []
    setup: dict[str, Any] = {}
    end: dict[str, Any] = {"alive": [], "not_alive": [], "shutdown": {}, "exits": {}}
    interrupted = False
    bucket: dict[str, Any] = {}
    t_run0 = t_run1 = 0.0
    schedule: list[tuple[float, str]] = []
    try:
        fleet.start_bucket()
        first = trainer.publish_first()
        setup["anchor"] = {
            "identity": first.identity,
            "stored_bytes": first.stored_bytes,
            "publish_s": round(first.publish_s, 2),
            "files": first.sizes,
        }
        fleet.start_daemons()
        setup["daemons_up_s"] = round(clock(), 1)
        for n in fleet.live():
            n.daemon.wait_ready(first.identity, timeout=300)
        setup["anchor_ready_s"] = round(clock(), 1)
        fleet.start_engine()
        if not _wait_fleet_on(trainer, first.identity, 300):
            raise TimeoutError(f"the fleet (with the engine) did not serve {first.identity} within 300 s")
        setup["fleet_serving_s"] = round(clock(), 1)

        sampler = Sampler(fleet, clock, cfg.sample_s)
        t_run0 = clock()
        end_t = t_run0 + cfg.minutes * 60
        schedule = plan(random.Random(rng.randrange(1 << 30)), cfg.chaos, t_run0, end_t)
        threads = [
            _thread("sampler", sampler.run, errors, stop),
            _thread("verifier", verifier.run, errors, stop),
            _thread("chaos", chaos.run, errors, schedule, stop, end_t),
            _thread("trainer", trainer.run, errors, stop, end_t),
        ]
        while clock() < end_t:
            time.sleep(min(1.0, max(0.0, end_t - clock())))
        for th in threads[2:]:  # chaos does the restarts still due; the trainer ends its step
            th.join(300)
        # The fleet ends whole: every restart due has run; give the last ones time to answer.
        deadline = time.monotonic() + 120
        while fleet.down() and time.monotonic() < deadline:
            time.sleep(0.5)
        t_run1 = clock()
        verifier.one_pass()
        sampler.one()
    except KeyboardInterrupt:
        interrupted = True
    except Exception as e:
        errors.append(
            {"thread": "main", "error": f"{type(e).__name__}: {e}"[:2000], "tb": traceback.format_exc()[-3000:]}
        )
    finally:
        stop.set()
        for th in threads:
            th.join(30)
        try:
            for nid, node in fleet.nodes.items():
                try:
                    status, _ = http_json("GET", node.daemon.url + "/v1/health", timeout=10)
                    (end["alive"] if status == 200 else end["not_alive"]).append(nid)
                except OSError:
                    end["not_alive"].append(nid)
            bucket = bucket_stats(fleet, trainer)
            end["exits"] = fleet.close(cfg.term_timeout)
            end["shutdown"] = {nid: e["result"] for nid, e in end["exits"].items()}
        finally:
            fleet.kill_all()
    if not t_run1:
        t_run1 = clock()
    result = build_result(
        cfg,
        fleet,
        trainer,
        chaos,
        verifier,
        sampler,
        schedule,
        setup,
        end,
        errors,
        interrupted,
        t_run0,
        t_run1,
        workdir,
    )
    result["bucket"] = bucket
    if cfg.out is not None:
        cfg.out.parent.mkdir(parents=True, exist_ok=True)
        cfg.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    if not cfg.keep_workdir and not errors and not result["findings"]:
        shutil.rmtree(workdir, ignore_errors=True)
    return result


def bucket_stats(fleet: Fleet, trainer: Trainer) -> dict[str, Any]:
    """What the daemons asked of the bucket (the proxy's records): requests, 503s, egress."""
    if fleet.proxy is None:
        return {}
    recs = fleet.proxy.requests()
    gets = [r for r in recs if r.method == "GET" and not r.injected]
    stored = sum(p.stored_bytes for p in trainer.published.values())
    egress = sum(r.response_bytes for r in gets)
    return {
        "requests": len(recs),
        "answered_503": sum(1 for r in recs if r.injected),
        "chunk_gets": sum(1 for r in gets if r.range),
        "egress_bytes": egress,
        "published_stored_bytes": stored,
        "egress_over_stored": round(egress / stored, 3) if stored else None,
    }


def build_result(
    cfg: SoakConfig,
    fleet: Fleet,
    trainer: Trainer,
    chaos: Chaos,
    verifier: Verifier,
    sampler: Sampler | None,
    schedule: list[tuple[float, str]],
    setup: dict[str, Any],
    end: dict[str, Any],
    errors: list[dict[str, Any]],
    interrupted: bool,
    t0: float,
    t1: float,
    workdir: Path,
) -> dict[str, Any]:
    minutes = max(0.0, t1 - t0) / 60
    samples = sampler.samples if sampler else []
    hot = trainer.records()
    conf = asdict(cfg)
    conf["out"] = str(cfg.out) if cfg.out else None
    conf["workdir"] = str(workdir)
    r: dict[str, Any] = {
        "bench": "soak",
        "config": conf,
        "model": {
            "n_embd": cfg.n_embd,
            "n_layer": cfg.n_layer,
            "bytes": sum(trainer.published[trainer.order[0]].sizes.values()) if trainer.order else 0,
        },
        "interrupted": interrupted,
        "harness_errors": errors,
        "elapsed_min": round(minutes, 2),
        "setup": setup,
        "schedule": schedule,
        "chaos": chaos.events,
        "faults_by_kind": dict(Counter(e["fault"] for e in chaos.events if e.get("fault"))),
        "hotloads": report.hotload_stats(hot),
        "hotload_records": hot,
        "published": [
            {"identity": p.identity, "kind": p.kind, "stored_bytes": p.stored_bytes, "publish_s": round(p.publish_s, 2)}
            for p in trainer.published.values()
        ],
        "verify": verifier.summary(),
        "resources": report.resources(samples, cfg.warmup_s, min(300.0, cfg.minutes * 60 / 3), cfg.minutes),
        "flat": flat.judge(samples),
        "second_half": report.second_half(samples),
        "memory_owners": report.memory_owners(sampler.maps if sampler else [], cfg.warmup_s),
        "logs": report.log_rates(samples, minutes),
        "top_log_lines": report.top_log_lines({nid: n.daemon.log_path for nid, n in fleet.nodes.items()}),
        "liar_bad_chunks_taken": report.liar_hits({nid: n.daemon.log_path for nid, n in fleet.nodes.items()}),
        "penalties": report.penalties({nid: n.daemon.log_path for nid, n in fleet.nodes.items()}),
        "lives": {nid: [asdict(lf) for lf in n.lives] for nid, n in fleet.nodes.items()},
        "engine_lives": [asdict(lf) for lf in fleet.engine_lives],
        "unexpected_exits": fleet.unexpected_exits,
        "shutdown_logs": fleet.shutdown_logs,
        "engine_node": fleet.engine_node,
        "end": end,
        "samples_columns": ["t_s", "node", "pid", "rss_kb", "fds", "cpu_s", "log_lines", "anon_kb"],
        "samples": samples,
        "maps_columns": ["t_s", "node", "pid", "heap_kb", "arenas_kb", "arena_heaps", "other_kb", "threads"],
        "maps": sampler.maps if sampler else [],
    }
    r["not_done_why"] = report.classify_not_done(r)
    r["findings"] = report.findings(r)
    return r
