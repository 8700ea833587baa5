"""bdnctl hot-load and engines: the fleet's move to a snapshot, followed per replica, and this node's engines."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from bdn import retry
from bdn.cli.commands.common import (
    DEFAULT_WAIT_S,
    EXIT_OK,
    EXIT_USAGE,
    POLL_SECONDS,
    Fail,
    NotYet,
    Subparsers,
    cell,
    identity_arg,
    ms_cell,
    nonempty,
    seconds,
    table,
)
from bdn.cli.output import emit_json
from bdn.client import DaemonClient
from bdn.client.fleet import hot_load, hot_load_status, list_engines, remove_engine
from bdn.client.swap_report import describe_swap


def add_hot_load(sub: Subparsers, common: argparse.ArgumentParser) -> None:
    hl = sub.add_parser("hot-load", parents=[common], help="make every replica of the fleet serve a snapshot")
    hl.add_argument("identity", help="the snapshot's identity, as published (e.g. step000002)")
    hl.add_argument(
        "--previous",
        metavar="ID",
        default=None,
        type=identity_arg,
        help="what the fleet serves now (or is loading), the delta's base "
        "(previous_snapshot_identity); leave it out to load a delta over its chain",
    )
    hl.add_argument(
        "--compression-format",
        default=None,
        metavar="FMT",
        help="the delta's compression format, with --previous (default: the manifest's)",
    )
    hl.add_argument(
        "--prompt-cache-policy",
        default=None,
        metavar="P",
        type=str.upper,
        choices=("RESET_ALL", "PRESERVE"),
        help="RESET_ALL (default: no sample reuses KV of the old policy) or PRESERVE",
    )
    hl.add_argument(
        "--inflight-policy",
        default=None,
        metavar="P",
        type=str.lower,
        choices=("wait", "keep", "abort"),
        help="wait (default: drain, bounded by --inflight-wait-s), keep or abort",
    )
    hl.add_argument(
        "--inflight-wait-s",
        type=seconds,
        default=None,
        metavar="S",
        help="the bound of the wait policy, seconds (default 30)",
    )
    hl.add_argument("--wait", action="store_true", help="follow every replica until it serves the snapshot")
    hl.add_argument(
        "--timeout",
        type=seconds,
        default=DEFAULT_WAIT_S,
        metavar="S",
        help="with --wait: give up after S seconds (exit 1; default %(default)g)",
    )
    hl.set_defaults(run=_hot_load)


def add_engines(sub: Subparsers, common: argparse.ArgumentParser) -> None:
    en = sub.add_parser("engines", parents=[common], help="the engines registered with this daemon")
    en.add_argument(
        "--remove",
        metavar="ENGINE_ID",
        default=None,
        type=nonempty,
        help="drop this engine (its leases are released, the replica goes on without it)",
    )
    en.set_defaults(run=_engines)


def _replica_row(r: dict[str, Any]) -> list[Any]:
    ls = s if isinstance(s := r.get("loading_state"), dict) else {}
    prog = ls.get("progress")
    shown = f"{100.0 * prog:.0f}%" if isinstance(prog, int | float) and not isinstance(prog, bool) else None
    return [
        r.get("replica_id"),
        ls.get("stage"),
        ls.get("identity"),
        shown,
        r.get("policy_version"),
        r.get("current_snapshot_identity"),
        ls.get("reason"),
    ]


REPLICA_HEADERS = ["REPLICA", "STAGE", "IDENTITY", "PROGRESS", "POLICY_VERSION", "SERVING", "REASON"]


def _replica_state(r: dict[str, Any]) -> tuple[Any, Any, Any]:
    ls = s if isinstance(s := r.get("loading_state"), dict) else {}
    return ls.get("stage"), ls.get("identity"), ls.get("reason")


def _hot_load_outcome(identity: str, replicas: list[dict[str, Any]], reached: int) -> tuple[bool, str | None]:
    """(every replica serves ``identity``, the first error reported for it or None)."""
    for r in replicas:
        stage, ident, reason = _replica_state(r)
        if stage == "error" and ident == identity:
            return False, f"replica {cell(r.get('replica_id'))}: {cell(reason) if reason else 'error'}"
    done = (
        bool(replicas)
        and len(replicas) >= reached
        and all(_replica_state(r)[0] == "done" and r.get("current_snapshot_identity") == identity for r in replicas)
    )
    return done, None


class _LiveTable:
    """The per-replica table: redrawn in place on a terminal, one line per change otherwise."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.tty = enabled and sys.stdout.isatty()
        self.drawn = 0
        self.last: dict[str, list[str]] = {}

    def update(self, replicas: list[dict[str, Any]]) -> None:
        if not self.enabled:
            return
        rows = [_replica_row(r) for r in replicas]
        if self.tty:
            text = table(REPLICA_HEADERS, rows)
            # Move up over the previous drawing and clear it (ANSI CPL + ED).
            prefix = f"\x1b[{self.drawn}F\x1b[J" if self.drawn else ""
            sys.stdout.write(prefix + text + "\n")
            sys.stdout.flush()
            self.drawn = text.count("\n") + 1
            return
        for row in rows:
            cells = [cell(v) for v in row]
            key = cells[0]
            if self.last.get(key) != cells:
                self.last[key] = cells
                print("  ".join(f"{h.lower()}={c}" for h, c in zip(REPLICA_HEADERS, cells)), flush=True)


def _hot_load(client: DaemonClient, args: argparse.Namespace) -> int:
    identity: str = args.identity
    if args.timeout is not None and not args.timeout >= 0:
        raise Fail("--timeout must be >= 0 seconds", EXIT_USAGE)
    start = time.monotonic()
    ans = hot_load(
        client,
        identity,
        args.previous,
        compression_format=args.compression_format,
        prompt_cache_policy=args.prompt_cache_policy,
        inflight_policy=args.inflight_policy,
        inflight_wait_s=args.inflight_wait_s,
    )
    if not args.wait:
        if args.json:
            emit_json(ans)
        else:
            print(
                f"{identity}: hot-load accepted (request {cell(ans.get('request_id'))}, "
                f"{cell(ans.get('replicas'))} replicas reached)"
            )
        return EXIT_OK
    reached = n if isinstance(n := ans.get("replicas"), int) else 0
    live = _LiveTable(not args.json)
    replicas: list[dict[str, Any]] = []
    try:
        # Poll until every replica is done: "not yet" is retried (bdn.retry) every POLL_SECONDS at
        # most, until --timeout.
        for attempt in retry.attempts(deadline_s=args.timeout, first_s=POLL_SECONDS, max_s=POLL_SECONDS, on=(NotYet,)):
            with attempt:
                replicas = hot_load_status(client)
                live.update(replicas)
                done, error = _hot_load_outcome(identity, replicas, reached)
                if error is not None:
                    raise Fail(f"hot-load of {identity} failed: {error}")
                if not done:
                    raise NotYet
    except NotYet:
        pending = [
            r
            for r in replicas
            if not (_replica_state(r)[0] == "done" and r.get("current_snapshot_identity") == identity)
        ]
        where = ", ".join(f"{cell(r.get('replica_id'))} {cell(_replica_state(r)[0])}" for r in pending[:5])
        raise Fail(
            f"hot-load of {identity} not done after {args.timeout:g} s"
            + (f" ({where})" if where else f" ({len(replicas)} of {reached} replicas answered)")
        ) from None
    if args.json:
        emit_json(
            {
                "identity": identity,
                "request_id": ans.get("request_id"),
                "replicas": replicas,
                "seconds": round(time.monotonic() - start, 3),
            }
        )
    else:
        versions = sorted({str(r.get("policy_version")) for r in replicas})
        print(
            f"{identity} served by {len(replicas)} replica(s) in {time.monotonic() - start:.1f} s "
            f"(policy version {', '.join(versions)})"
        )
    return EXIT_OK


def _engines(client: DaemonClient, args: argparse.Namespace) -> int:
    if args.remove is not None:
        remove_engine(client, args.remove)
        if args.json:
            emit_json({"removed": args.remove})
        else:
            print(f"engine {args.remove} removed")
        return EXIT_OK
    ans = list_engines(client)
    if args.json:
        emit_json(ans)
        return EXIT_OK
    engines = ans["engines"]
    if not engines:
        print("no engines registered")
        return EXIT_OK
    rows = []
    for e in engines:
        swap = e.get("swap") if isinstance(e.get("swap"), dict) else None
        rows.append(
            [
                e.get("engine_id"),
                e.get("name"),
                e.get("serving"),
                e.get("offered"),
                ms_cell(e.get("pause_ms")),
                e.get("prompt_cache_policy"),
                e.get("inflight_policy"),
                e.get("last_seen_s_ago"),
                e.get("error"),
                describe_swap(swap) if swap is not None else None,
            ]
        )
    print(
        table(
            [
                "ENGINE",
                "NAME",
                "SERVING",
                "OFFERED",
                "PAUSE_MS",
                "PROMPT_CACHE",
                "INFLIGHT",
                "SEEN_S_AGO",
                "ERROR",
                "LAST_SWAP",
            ],
            rows,
        )
    )
    return EXIT_OK
