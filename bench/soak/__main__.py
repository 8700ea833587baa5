"""``python -m bench.soak``: the soak under faults (see bench/soak/__init__.py).

    python -m bench.soak --nodes 8 --minutes 30 --seed 1 --out bench/results/soak.json

Exit 0 when the run found nothing (no wrong bytes, no daemon that died or did not come back,
flat memory and fds, every hot-load done, a clean shutdown), 1 when it has findings (printed as
FINDING lines and kept in the JSON), 2 on a usage error, 3 when the harness itself failed.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from bench.soak.chaos import KINDS, ChaosParams
from bench.soak.harness import SoakConfig, run_soak
from bench.soak.report import text_summary


def _range(kind: type, what: str):  # type: ignore[no-untyped-def]
    def parse(v: str):  # type: ignore[no-untyped-def]
        try:
            lo, _, hi = v.partition(",")
            a, b = kind(lo), kind(hi or lo)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be LO,HI, got {v!r}") from None
        if a < 0 or b < a:
            raise argparse.ArgumentTypeError(f"{what} must be 0 <= LO <= HI, got {v!r}")
        return a, b

    return parse


def _kinds(v: str) -> tuple[str, ...]:
    ks = tuple(k for k in v.split(",") if k)
    bad = [k for k in ks if k not in KINDS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown fault kind(s) {', '.join(bad)}; known: {', '.join(KINDS)}")
    return ks


def _assign(v: str) -> tuple[str, str]:
    key, eq, val = v.partition("=")
    if not eq or not key or not key.replace("_", "").isalnum():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {v!r}")
    return key, val


def _node_assign(v: str) -> tuple[str, str, str]:
    node, colon, kv = v.partition(":")
    if not colon or not node.startswith("node") or not node[4:].isdigit():
        raise argparse.ArgumentTypeError(f"expected nodeN:KEY=VALUE, got {v!r}")
    return (node, *_assign(kv))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=8, help="bdnd daemons (default %(default)s)")
    p.add_argument("--minutes", type=float, default=30.0, help="length of the faulted run (default %(default)s)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--out", type=Path, default=Path("bench/results/soak.json"), help="result JSON (default %(default)s)"
    )
    p.add_argument(
        "--workdir",
        type=Path,
        help="logs and trainer files (default: a new temporary directory, removed after a run without findings)",
    )
    p.add_argument("--keep-workdir", action="store_true")
    p.add_argument(
        "--n-embd", type=int, default=384, help="tinygpt width (default %(default)s: with --n-layer 6, 21.8 MB)"
    )
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--chunk-kib", type=int, default=1024, help="manifest chunk size, KiB (default %(default)s)")
    p.add_argument("--anchor-every", type=int, default=10, help="a new anchor every N steps (default %(default)s)")
    p.add_argument(
        "--interval",
        type=_range(float, "--interval"),
        default=(20.0, 30.0),
        help="seconds between hot-load POSTs, LO,HI (default 20,30)",
    )
    p.add_argument(
        "--faults",
        type=_kinds,
        default=KINDS,
        help=f'fault kinds (default {",".join(KINDS)}; "" for a run without faults)',
    )
    p.add_argument(
        "--fault-order",
        choices=("shuffled", "given"),
        default="shuffled",
        help="each round of faults in a seeded order, or in the order of --faults",
    )
    p.add_argument(
        "--chaos-every",
        type=_range(float, "--chaos-every"),
        default=(20.0, 45.0),
        help="seconds between faults, LO,HI (default 20,45)",
    )
    p.add_argument(
        "--down", type=_range(float, "--down"), default=(5.0, 20.0), help="seconds a killed daemon stays down"
    )
    p.add_argument(
        "--liar-stay", type=_range(float, "--liar-stay"), default=(45.0, 90.0), help="seconds the liar stays"
    )
    p.add_argument(
        "--burst",
        type=_range(float, "--burst"),
        default=(5.0, 30.0),
        help="seconds of a bucket 503 burst (every request), LO,HI (default 5,30)",
    )
    p.add_argument(
        "--slow-stay",
        type=_range(float, "--slow-stay"),
        default=(45.0, 90.0),
        help="seconds a daemon runs with its peer uplink limited (fault 'slow'), LO,HI (default 45,90)",
    )
    p.add_argument(
        "--slow-mbit",
        type=float,
        default=0.5,
        help="the slow daemon's peer uplink, Mbit/s (default %(default)s: 64 KB/s)",
    )
    p.add_argument("--max-down", type=int, default=2, help="daemons down at once, at most (default %(default)s)")
    p.add_argument(
        "--quiet-tail", type=float, default=60.0, help="no new faults in the last S seconds (default %(default)s)"
    )
    p.add_argument("--sample-s", type=float, default=5.0)
    p.add_argument(
        "--warmup-s", type=float, default=120.0, help="samples of a life's first S seconds are not in its slope"
    )
    p.add_argument(
        "--term-timeout",
        type=float,
        default=20.0,
        help="at the end, seconds a daemon gets to exit after SIGTERM before SIGKILL (default %(default)s)",
    )
    p.add_argument("--log-level", default="info", help="the daemons' log level (default %(default)s)")
    p.add_argument(
        "--env",
        type=_assign,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an environment variable of every daemon (repeatable), e.g. MALLOC_ARENA_MAX=2",
    )
    p.add_argument(
        "--node-env",
        type=_node_assign,
        action="append",
        default=[],
        metavar="nodeN:KEY=VALUE",
        help="an environment variable of one daemon, over --env (repeatable): an A/B within one run",
    )
    p.add_argument(
        "--spare", default="node0", help="daemons the chaos loop never kills, comma list (default %(default)s)"
    )
    p.add_argument("--engine-node", type=int, default=1, help="the daemon the engine uses (default %(default)s)")
    a = p.parse_args(argv)
    if a.nodes < 2 or a.minutes <= 0 or a.max_down < 1 or a.max_down >= a.nodes:
        p.error("need --nodes >= 2, --minutes > 0 and 1 <= --max-down < --nodes")
    spare = tuple(x for x in a.spare.split(",") if x)
    node_env: dict[str, dict[str, str]] = {}
    for node, k, v in a.node_env:
        node_env.setdefault(node, {})[k] = v
    unknown = sorted(n for n in {*spare, *node_env} if n not in {f"node{i}" for i in range(a.nodes)})
    if unknown:
        p.error(f"--spare / --node-env name daemons this run does not have: {', '.join(unknown)}")
    cfg = SoakConfig(
        nodes=a.nodes,
        minutes=a.minutes,
        seed=a.seed,
        out=a.out,
        workdir=a.workdir,
        keep_workdir=a.keep_workdir,
        n_embd=a.n_embd,
        n_layer=a.n_layer,
        anchor_every=a.anchor_every,
        interval=a.interval,
        chunk_size=a.chunk_kib << 10,
        sample_s=a.sample_s,
        warmup_s=a.warmup_s,
        log_level=a.log_level,
        term_timeout=a.term_timeout,
        daemon_env=dict(a.env),
        node_env=node_env,
        engine_node=a.engine_node,
        chaos=ChaosParams(
            kinds=a.faults,
            every=a.chaos_every,
            down_s=a.down,
            liar_s=a.liar_stay,
            spare=spare,
            burst_s=a.burst,
            slow_s=a.slow_stay,
            slow_mbit=a.slow_mbit,
            max_down=a.max_down,
            quiet_s=a.quiet_tail,
            shuffle=a.fault_order == "shuffled",
        ),
    )

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started with SIGINT ignored (`cmd &`)
    result = run_soak(cfg)
    print(text_summary(result), flush=True)
    if a.out:
        print(f"results: {a.out}")
    if result["harness_errors"]:
        for e in result["harness_errors"]:
            print(f"harness error in {e['thread']}: {e['error']}", file=sys.stderr)
        return 3
    return 1 if result["findings"] or result["interrupted"] else 0


if __name__ == "__main__":
    sys.exit(main())
