"""bdnctl: operator CLI of a node's bdnd, over its local API (README.md, "Local API").

Usage::

    bdnctl [--url URL] [--json] prefetch <identity> [--wait] [--wait-publish] [--timeout S]
    bdnctl [--url URL] [--json] cancel <identity>
    bdnctl [--url URL] [--json] status
    bdnctl [--url URL] [--json] snapshots
    bdnctl [--url URL] [--json] verify <identity | snapshot-dir> [--repair] [--timeout S]
    bdnctl [--url URL] [--json] hot-load <identity> [--previous ID] [--compression-format arc_v2]
                                         [--prompt-cache-policy P] [--inflight-policy P]
                                         [--inflight-wait-s S] [--wait] [--timeout S]
    bdnctl [--url URL] [--json] engines [--remove ENGINE_ID]
    bdnctl [--url URL] [--json] path <identity | current> [--wait] [--timeout S]
    bdnctl [--url URL] [--json] peers
    bdnctl [--url URL] [--json] gc

``--url`` defaults to ``$BDN_URL`` or ``http://127.0.0.1:7081`` (``unix:///path.sock`` also works).
``--json`` prints one JSON document on stdout for every command, errors included
(``{"error": "...", "exit_code": N}``); the human output goes away, the stderr error line stays.
Byte counts are plain integers in JSON and SI units (``MB`` = 10^6 bytes, the progress bar too)
in human output (:mod:`bdn.cli.output`). ``--version`` prints ``bdn <version>``.

``prefetch --wait`` shows a progress bar of fetched/total stored bytes on stderr and ends with
``<identity> ready in <s> s: <path>`` (the bar is drawn only when stderr is a terminal). A
snapshot with nothing in the bucket fails at once, unless ``--wait-publish`` asks the daemon to
wait for it to be published (up to its ``manifest_wait_s``). The prefetch line, the bar and the
snapshot table show the reason of a snapshot that waits (``waiting for ...``): the table's PATH
column shows the directory of a ready snapshot and the reason of any other one that has a
reason. ``cancel`` stops a load in progress on this node (it becomes ``failed``, reason
``cancelled by the operator``; a ready snapshot is left as it is). ``verify`` re-hashes a ready
snapshot's files against its READY marker's digests, on this host (it reads the directory the
daemon reports, or the one given); it changes nothing. ``verify --repair <identity>`` asks bdnd to
re-hash it: every corrupted chunk is quarantined at once (no longer served to peers or engines; the
snapshot leaves ``ready``) and fetched again, and bdnctl waits (``--timeout``) until the snapshot
is ``ready`` again (exit 0) or the repair failed (exit 1).

``hot-load`` asks the fleet (through this daemon, which fans the request out) to serve
``<identity>``; ``--previous`` names the snapshot a delta applies to. With ``--wait`` it shows a
per-replica table (REPLICA, STAGE, IDENTITY, PROGRESS, POLICY_VERSION, SERVING, REASON) from
``GET /hot_load/v1/models/hot_load``, redrawn in place on a terminal and one line per change
otherwise, until every replica is ``done`` serving ``<identity>`` (exit 0) or one reports
``error`` for it (exit 1 with its reason), or ``--timeout`` (default 600 s) passes (exit 1 naming
the replicas not done). ``--prompt-cache-policy``, ``--inflight-policy`` and ``--inflight-wait-s``
are the hot-load's engine options (docs/ENGINES.md). ``engines`` lists the engines registered
with this daemon (``--remove`` drops one: its leases are released). ``path`` prints the directory
of a ready snapshot, or with ``current`` the directory of the snapshot this replica serves (the
``current`` link resolved, so a process started with it reads one snapshot); ``--wait`` waits for
it to exist (default 600 s), for engines a process manager starts: ``vllm serve "$(bdnctl path
current --wait)"``. ``peers`` lists the swarm members this daemon sees;
``gc`` collects old snapshots now (leased, current and target snapshots are kept).

Exit codes:
    0  success
    1  the operation failed (snapshot failed, wait timed out, verification failed, the daemon
       answered with an error)
    2  usage error (bad arguments, bad URL, malformed identity)
    3  the daemon is unreachable (``bdnctl: error: cannot reach bdnd at <url>: <reason>``)
Every failure prints one line ``bdnctl: error: <reason>`` on stderr.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, NoReturn

from tqdm import tqdm

from bdn import retry
from bdn.cli.output import BYTES_BAR, VERSION, emit_json, human_bytes
from bdn.client import (
    DaemonClient,
    DaemonError,
    DaemonUnreachable,
    SnapshotFailed,
    open_snapshot,
)
from bdn.client.fleet import (
    call_json,
    collect_garbage,
    hot_load,
    hot_load_status,
    list_engines,
    remove_engine,
)
from bdn.client.errors import one_line
from bdn.client.ready import read_ready, verify_files
from bdn.proto.errors import BdnError, ChecksumError, IdentityError, PathError

PROG = "bdnctl"
DEFAULT_URL = "http://127.0.0.1:7081"
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3
POLL_SECONDS = 0.2
DEFAULT_WAIT_S = 600.0


class _Fail(Exception):
    """A failure to report as one line with an exit code."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


class _NotYet(Exception):
    """Not every replica serves the snapshot yet (hot-load --wait polls again)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # argparse would print the whole usage block; the rule is one line.
        raise _Fail(f"{message} (see {PROG} --help)", EXIT_USAGE)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Operate the node's bdn daemon (bdnd) through its local API.")
    p.add_argument("--url", default=os.environ.get("BDN_URL") or DEFAULT_URL,
                   help="bdnd local API: http://host:port or unix:///path.sock (default $BDN_URL or %(default)s)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON on stdout")
    p.add_argument("--version", action="version", version=VERSION)
    # --url and --json work after the subcommand too (`bdnctl status --json`); SUPPRESS keeps a
    # subcommand that does not repeat them from resetting what was given before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    pf = sub.add_parser("prefetch", parents=[common], help="start fetching a snapshot onto this node")
    pf.add_argument("identity")
    pf.add_argument("--wait", action="store_true", help="wait until ready, with a progress bar")
    pf.add_argument("--wait-publish", action="store_true",
                    help="if nothing is in the bucket yet, wait for it to be published (else fail at once)")
    pf.add_argument("--timeout", type=float, default=None, metavar="S",
                    help="with --wait: give up after S seconds (exit 1)")
    cf = sub.add_parser("cancel", parents=[common], help="stop a snapshot's load on this node")
    cf.add_argument("identity")
    sub.add_parser("status", parents=[common], help="node, swarm, peers, counters and snapshots")
    sub.add_parser("snapshots", parents=[common], help="table of the snapshots this daemon knows")
    vf = sub.add_parser("verify", parents=[common], help="re-hash a ready snapshot's files against its READY marker")
    vf.add_argument("target", metavar="IDENTITY|DIR", help="an identity (asks bdnd where it is), or a snapshot directory path (holds a '/')")
    vf.add_argument("--repair", action="store_true",
                    help="ask bdnd to re-hash the snapshot, quarantine corrupted chunks and fetch them again")
    vf.add_argument("--timeout", type=float, default=None, metavar="S",
                    help="with --repair: give up waiting for the repair after S seconds (exit 1)")
    hl = sub.add_parser("hot-load", parents=[common], help="make every replica of the fleet serve a snapshot")
    hl.add_argument("identity")
    hl.add_argument("--previous", metavar="ID", default=None,
                    help="the snapshot a delta applies to (previous_snapshot_identity)")
    hl.add_argument("--compression-format", default="arc_v2", metavar="FMT",
                    help="the delta's compression format, with --previous (default %(default)s)")
    hl.add_argument("--prompt-cache-policy", default=None, metavar="P",
                    help="RESET_ALL (default: no sample reuses KV of the old policy) or PRESERVE")
    hl.add_argument("--inflight-policy", default=None, metavar="P",
                    help="wait (default: drain, bounded by --inflight-wait-s), keep or abort")
    hl.add_argument("--inflight-wait-s", type=float, default=None, metavar="S",
                    help="the bound of the wait policy, seconds (default 30)")
    hl.add_argument("--wait", action="store_true", help="follow every replica until it serves the snapshot")
    hl.add_argument("--timeout", type=float, default=DEFAULT_WAIT_S, metavar="S",
                    help="with --wait: give up after S seconds (exit 1; default %(default)g)")
    en = sub.add_parser("engines", parents=[common], help="the engines registered with this daemon")
    en.add_argument("--remove", metavar="ENGINE_ID", default=None,
                    help="drop this engine (its leases are released, the replica goes on without it)")
    pa = sub.add_parser("path", parents=[common], help="the directory of a ready snapshot, or of the one served")
    pa.add_argument("identity", metavar="IDENTITY|current")
    pa.add_argument("--wait", action="store_true", help="wait until it is ready (or, for current, served)")
    pa.add_argument("--timeout", type=float, default=DEFAULT_WAIT_S, metavar="S",
                    help="with --wait: give up after S seconds (exit 1; default %(default)g)")
    sub.add_parser("peers", parents=[common], help="the swarm members this daemon sees")
    sub.add_parser("gc", parents=[common], help="collect old snapshots now")
    return p


# -- output helpers ----------------------------------------------------------------------------

def _cell(value: Any) -> str:
    return "-" if value is None or value == "" else one_line(str(value), 200)


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def _human_bytes(n: Any) -> str:
    return human_bytes(n) if isinstance(n, int | float) and not isinstance(n, bool) else _cell(n)


def _progress(snap: dict[str, Any]) -> str:
    done, total = snap.get("bytes_done"), snap.get("bytes_total")
    if isinstance(done, int) and isinstance(total, int) and total > 0:
        return f"{min(100.0, 100.0 * done / total):.0f}%"
    return "100%" if snap.get("state") == "ready" else "-"


def _snapshot_table(snaps: list[dict[str, Any]]) -> str:
    rows = [
        [s.get("identity"), s.get("kind"), s.get("policy_version"), s.get("state"), _progress(s),
         s.get("path") if s.get("state") == "ready" else s.get("reason")]
        for s in snaps
    ]
    return _table(["IDENTITY", "KIND", "POLICY_VERSION", "STATE", "PROGRESS", "PATH"], rows)


# -- commands ----------------------------------------------------------------------------------

def _cmd_prefetch(client: DaemonClient, args: argparse.Namespace) -> int:
    identity: str = args.identity
    if args.timeout is not None and not args.timeout >= 0:
        raise _Fail("--timeout must be >= 0 seconds", EXIT_USAGE)
    start = time.monotonic()
    snap = client.prefetch(identity, wait_publish=args.wait_publish)
    if not args.wait:
        if snap.get("state") == "failed":
            raise _Fail(f"{identity} failed: {_cell(snap.get('reason'))}")
        if args.json:
            emit_json(snap)
        else:
            reason = f": {_cell(snap.get('reason'))}" if snap.get("reason") else ""
            print(f"{identity}: {_cell(snap.get('state'))} (prefetch started){reason}")
        return EXIT_OK

    # disable=None: no bar when stderr is not a terminal, so logs do not fill with redraws.
    bar = tqdm(total=None, desc=identity, **BYTES_BAR, file=sys.stderr, disable=True if args.json else None, leave=False,
               dynamic_ncols=True, mininterval=0.2)
    shown_state: list[Any] = [None]

    def update(s: dict[str, Any]) -> None:
        total, done = s.get("bytes_total"), s.get("bytes_done")
        if isinstance(total, int) and total > 0 and bar.total != total:
            bar.total = total  # known once the daemon has read the manifest
            bar.refresh()
        if isinstance(done, int) and done >= 0 and done != bar.n:
            bar.update(done - bar.n)
        shown = (s.get("state"), s.get("reason"))
        if shown != shown_state[0]:
            shown_state[0] = shown
            bar.set_postfix_str(_cell(s.get("state")) + (f": {one_line(str(s['reason']), 80)}" if s.get("reason") else ""))
            if s.get("reason") and s.get("state") != "failed" and not args.json and not sys.stderr.isatty():
                print(f"{identity}: {_cell(s.get('state'))}: {_cell(s.get('reason'))}", file=sys.stderr)

    try:
        update(snap)
        if snap.get("state") == "failed":
            raise SnapshotFailed(str(snap.get("reason") or "failed"), snap)
        if snap.get("state") != "ready":
            snap = client.wait(identity, "ready", args.timeout, poll=POLL_SECONDS, on_update=update)
        update(snap)
    except SnapshotFailed as exc:
        raise _Fail(f"{identity} failed: {exc.reason}") from None
    except TimeoutError as exc:
        raise _Fail(str(exc)) from None
    finally:
        bar.close()
    elapsed = time.monotonic() - start
    if args.json:
        emit_json(snap)
    else:
        print(f"{identity} ready in {elapsed:.1f} s: {_cell(snap.get('path'))}")
    return EXIT_OK


def _cmd_cancel(client: DaemonClient, args: argparse.Namespace) -> int:
    snap = client.cancel(args.identity)
    if args.json:
        emit_json(snap)
    elif snap.get("state") == "failed":
        print(f"{args.identity}: cancelled ({_cell(snap.get('reason'))})")
    else:
        print(f"{args.identity}: {_cell(snap.get('state'))}, nothing to cancel")
    return EXIT_OK


def _cmd_status(client: DaemonClient, args: argparse.Namespace) -> int:
    st = client.status()
    if args.json:
        emit_json(st)
        return EXIT_OK
    lines = [f"{k:<9} {_cell(st.get(k))}" for k in ("node_id", "swarm_id", "peer_url", "version")]
    bucket = st.get("bucket")
    if isinstance(bucket, dict):
        extra = ", ".join(
            f"{k} {_human_bytes(v) if k.endswith('bytes') else _cell(v)}" for k, v in bucket.items() if k != "url"
        )
        lines.append(f"{'bucket':<9} {_cell(bucket.get('url'))}" + (f" ({extra})" if extra else ""))
    peers = st.get("peers") if isinstance(st.get("peers"), list) else []
    lines.append(f"\npeers ({len(peers)}):")
    if peers:
        rows = [[p.get("node_id"), p.get("url"), "yes" if p.get("alive") else "no"]
                for p in peers if isinstance(p, dict)]
        lines.append(_indent(_table(["NODE", "URL", "ALIVE"], rows)))
    counters = st.get("counters")
    if isinstance(counters, dict) and counters:
        lines.append("\ncounters:")
        width = max(len(str(k)) for k in counters)
        for k, v in counters.items():
            shown = _human_bytes(v) if "bytes" in str(k) else _cell(v)
            lines.append(f"  {_cell(k):<{width}}  {shown}")
    snaps = [s for s in st.get("snapshots") or [] if isinstance(s, dict)]
    lines.append(f"\nsnapshots ({len(snaps)}):")
    if snaps:
        lines.append(_indent(_snapshot_table(snaps)))
    print("\n".join(lines))
    return EXIT_OK


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())


def _cmd_snapshots(client: DaemonClient, args: argparse.Namespace) -> int:
    snaps = client.snapshots()
    if args.json:
        emit_json({"snapshots": snaps})
    elif snaps:
        print(_snapshot_table(snaps))
    else:
        print("no snapshots")
    return EXIT_OK


def _cmd_repair(client: DaemonClient, args: argparse.Namespace) -> int:
    identity: str = args.target
    if "/" in identity or identity.startswith("."):
        raise _Fail("verify --repair needs an identity (bdnd repairs its own snapshots), not a directory",
                    EXIT_USAGE)
    start = time.monotonic()
    ans = client.repair(identity)
    corrupted = ans.get("corrupted") if isinstance(ans.get("corrupted"), list) else []
    snap = client.snapshot(identity)
    if corrupted:
        try:
            snap = client.wait(identity, "ready", timeout=args.timeout)
        except SnapshotFailed as exc:
            raise _Fail(f"repair of {identity} failed: {exc}") from None
        except TimeoutError:
            raise _Fail(f"repair of {identity} not done after {args.timeout:g} s") from None
    result = {"identity": identity, "ok": True, "chunks": ans.get("chunks"), "corrupted": corrupted,
              "repaired": len(corrupted), "path": snap.get("path"), "seconds": round(time.monotonic() - start, 3)}
    if args.json:
        emit_json(result)
    elif corrupted:
        first = corrupted[0] if isinstance(corrupted[0], dict) else {}
        print(f"{identity} repaired: {len(corrupted)} corrupted chunk(s) quarantined and fetched again "
              f"(first {_cell(first.get('path'))} chunk {_cell(first.get('chunk'))}); ready at {_cell(snap.get('path'))}")
    else:
        print(f"{identity} ok: {_cell(ans.get('chunks'))} chunks match READY, nothing to repair ({_cell(snap.get('path'))})")
    return EXIT_OK


def _cmd_verify(client: DaemonClient, args: argparse.Namespace) -> int:
    if args.repair:
        return _cmd_repair(client, args)
    target: str = args.target
    expect: str | None = None
    if "/" in target or target.startswith("."):
        path = target  # identities never hold '/' nor start with '.', so this is a directory
    else:
        snap = client.snapshot(target)
        if snap.get("state") != "ready":
            raise _Fail(f"{target} is {_cell(snap.get('state'))}, not ready")
        path = snap.get("path")
        if not isinstance(path, str) or not path:
            raise _Fail(f"daemon reports {target} ready without a path")
        expect = target
    start = time.monotonic()
    # Hashes first, from READY alone: a corrupted header must show up as the bad chunk it is,
    # not as a parse error. Then open, which checks headers and the index against each other.
    marker = read_ready(path)
    if expect is not None and marker.identity != expect:
        raise _Fail(f"{path} holds snapshot {marker.identity}, not {expect}")
    try:
        verify_files(path, marker)
    except ChecksumError as exc:
        hint = f"; bdnctl verify --repair {expect} quarantines and re-fetches it" if expect else ""
        raise _Fail(f"{exc}{hint}") from None
    with open_snapshot(path) as s:
        result = {"identity": s.identity, "path": str(s.path), "ok": True, "files": len(s.files()),
                  "bytes": s.ready.total_bytes, "seconds": round(time.monotonic() - start, 3)}
    if args.json:
        emit_json(result)
    else:
        print(f"{result['identity']} ok: {result['files']} files, {_human_bytes(result['bytes'])} "
              f"match READY ({result['path']})")
    return EXIT_OK


def _replica_row(r: dict[str, Any]) -> list[Any]:
    ls = r.get("loading_state") if isinstance(r.get("loading_state"), dict) else {}
    prog = ls.get("progress")
    shown = f"{100.0 * prog:.0f}%" if isinstance(prog, int | float) and not isinstance(prog, bool) else None
    return [r.get("replica_id"), ls.get("stage"), ls.get("identity"), shown, r.get("policy_version"),
            r.get("current_snapshot_identity"), ls.get("reason")]


REPLICA_HEADERS = ["REPLICA", "STAGE", "IDENTITY", "PROGRESS", "POLICY_VERSION", "SERVING", "REASON"]


def _replica_state(r: dict[str, Any]) -> tuple[Any, Any, Any]:
    ls = r.get("loading_state") if isinstance(r.get("loading_state"), dict) else {}
    return ls.get("stage"), ls.get("identity"), ls.get("reason")


def _hot_load_outcome(identity: str, replicas: list[dict[str, Any]], reached: int) -> tuple[bool, str | None]:
    """(every replica serves ``identity``, the first error reported for it or None)."""
    for r in replicas:
        stage, ident, reason = _replica_state(r)
        if stage == "error" and ident == identity:
            return False, f"replica {_cell(r.get('replica_id'))}: {_cell(reason) if reason else 'error'}"
    done = bool(replicas) and len(replicas) >= reached and all(
        _replica_state(r)[0] == "done" and r.get("current_snapshot_identity") == identity for r in replicas
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
            text = _table(REPLICA_HEADERS, rows)
            # Move up over the previous drawing and clear it (ANSI CPL + ED).
            prefix = f"\x1b[{self.drawn}F\x1b[J" if self.drawn else ""
            sys.stdout.write(prefix + text + "\n")
            sys.stdout.flush()
            self.drawn = text.count("\n") + 1
            return
        for row in rows:
            cells = [_cell(v) for v in row]
            key = cells[0]
            if self.last.get(key) != cells:
                self.last[key] = cells
                print("  ".join(f"{h.lower()}={c}" for h, c in zip(REPLICA_HEADERS, cells)), flush=True)


def _cmd_hot_load(client: DaemonClient, args: argparse.Namespace) -> int:
    identity: str = args.identity
    if args.timeout is not None and not args.timeout >= 0:
        raise _Fail("--timeout must be >= 0 seconds", EXIT_USAGE)
    start = time.monotonic()
    ans = hot_load(client, identity, args.previous, compression_format=args.compression_format,
                   prompt_cache_policy=args.prompt_cache_policy, inflight_policy=args.inflight_policy,
                   inflight_wait_s=args.inflight_wait_s)
    if not args.wait:
        if args.json:
            emit_json(ans)
        else:
            print(f"{identity}: hot-load accepted (request {_cell(ans.get('request_id'))}, "
                  f"{_cell(ans.get('replicas'))} replicas reached)")
        return EXIT_OK
    reached = ans.get("replicas") if isinstance(ans.get("replicas"), int) else 0
    live = _LiveTable(not args.json)
    replicas: list[dict[str, Any]] = []
    try:
        # Poll until every replica is done: "not yet" is retried (bdn.retry) every POLL_SECONDS at
        # most, until --timeout.
        for attempt in retry.attempts(deadline_s=args.timeout, first_s=POLL_SECONDS, max_s=POLL_SECONDS,
                                      on=(_NotYet,)):
            with attempt:
                replicas = hot_load_status(client)
                live.update(replicas)
                done, error = _hot_load_outcome(identity, replicas, reached)
                if error is not None:
                    raise _Fail(f"hot-load of {identity} failed: {error}")
                if not done:
                    raise _NotYet
    except _NotYet:
        pending = [r for r in replicas if not (_replica_state(r)[0] == "done"
                                               and r.get("current_snapshot_identity") == identity)]
        where = ", ".join(f"{_cell(r.get('replica_id'))} {_cell(_replica_state(r)[0])}" for r in pending[:5])
        raise _Fail(f"hot-load of {identity} not done after {args.timeout:g} s"
                    + (f" ({where})" if where else f" ({len(replicas)} of {reached} replicas answered)")) from None
    if args.json:
        emit_json({"identity": identity, "request_id": ans.get("request_id"), "replicas": replicas,
                    "seconds": round(time.monotonic() - start, 3)})
    else:
        versions = sorted({str(r.get("policy_version")) for r in replicas})
        print(f"{identity} served by {len(replicas)} replica(s) in {time.monotonic() - start:.1f} s "
              f"(policy version {', '.join(versions)})")
    return EXIT_OK


def _cmd_engines(client: DaemonClient, args: argparse.Namespace) -> int:
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
        swap = e.get("swap") if isinstance(e.get("swap"), dict) else {}
        rows.append([e.get("engine_id"), e.get("name"), e.get("serving"), e.get("offered"),
                     swap.get("mode"), e.get("pause_ms"), e.get("prompt_cache_policy"), e.get("inflight_policy"),
                     e.get("last_seen_s_ago"), e.get("error")])
    print(_table(["ENGINE", "NAME", "SERVING", "OFFERED", "MODE", "PAUSE_MS", "PROMPT_CACHE", "INFLIGHT",
                  "SEEN_S_AGO", "ERROR"], rows))
    return EXIT_OK


def _current_path(client: DaemonClient) -> dict[str, Any] | None:
    try:
        _status, ans = call_json(client, "GET", "/v1/current")
    except DaemonError as exc:
        if exc.status == 404:
            return None
        raise
    if not isinstance(ans, dict) or not isinstance(ans.get("path"), str):
        raise _Fail("daemon answered /v1/current without a path")
    return ans


def _cmd_path(client: DaemonClient, args: argparse.Namespace) -> int:
    identity: str = args.identity
    if not args.timeout >= 0:
        raise _Fail("--timeout must be >= 0 seconds", EXIT_USAGE)
    if identity == "current":
        rec: dict[str, Any] | None = None
        try:
            for attempt in retry.attempts(deadline_s=args.timeout if args.wait else 0.0, first_s=POLL_SECONDS,
                                          max_s=1.0, on=(_NotYet,)):
                with attempt:
                    rec = _current_path(client)
                    if rec is None:
                        raise _NotYet
        except _NotYet:
            raise _Fail("this replica serves no snapshot yet"
                        + (f" (waited {args.timeout:g} s)" if args.wait else " (--wait waits for one)")) from None
        assert rec is not None
        ans = {"identity": rec.get("identity"), "path": rec["path"], "link": rec.get("link")}
    else:
        snap = client.snapshot(identity) if not args.wait else None
        if args.wait:
            client.prefetch(identity)
            try:
                snap = client.wait(identity, "ready", args.timeout, poll=POLL_SECONDS)
            except SnapshotFailed as exc:
                raise _Fail(f"{identity} failed: {exc.reason}") from None
            except TimeoutError as exc:
                raise _Fail(str(exc)) from None
        assert snap is not None
        if snap.get("state") != "ready" or not isinstance(snap.get("path"), str):
            raise _Fail(f"{identity} is {_cell(snap.get('state'))}, not ready")
        ans = {"identity": identity, "path": snap["path"]}
    if args.json:
        emit_json(ans)
    else:
        print(ans["path"])
    return EXIT_OK


def _cmd_peers(client: DaemonClient, args: argparse.Namespace) -> int:
    st = client.status()
    peers = [p for p in st.get("peers") or [] if isinstance(p, dict)]
    if args.json:
        emit_json({"node_id": st.get("node_id"), "swarm_id": st.get("swarm_id"), "peers": peers})
    elif peers:
        print(_table(["NODE", "URL", "ALIVE"], [[p.get("node_id"), p.get("url"), "yes" if p.get("alive") else "no"]
                                               for p in peers]))
    else:
        print("no peers")
    return EXIT_OK


def _cmd_gc(client: DaemonClient, args: argparse.Namespace) -> int:
    ans = collect_garbage(client)
    if args.json:
        emit_json(ans)
        return EXIT_OK
    removed = [str(x) for x in ans.get("removed") or []] if isinstance(ans.get("removed"), list) else []
    kept = [str(x) for x in ans.get("kept") or []] if isinstance(ans.get("kept"), list) else []
    print(f"removed {len(removed)}: {_cell(', '.join(removed))}")
    print(f"kept {len(kept)}: {_cell(', '.join(kept))}")
    return EXIT_OK


COMMANDS = {"prefetch": _cmd_prefetch, "cancel": _cmd_cancel, "status": _cmd_status, "snapshots": _cmd_snapshots,
            "verify": _cmd_verify, "hot-load": _cmd_hot_load, "engines": _cmd_engines, "path": _cmd_path,
            "peers": _cmd_peers, "gc": _cmd_gc}


def main(argv: Sequence[str] | None = None) -> int:
    """Run bdnctl with ``argv`` (default ``sys.argv[1:]``); returns the exit code (see above)."""
    json_mode = "--json" in (sys.argv[1:] if argv is None else argv)
    try:
        try:
            args = _parser().parse_args(argv)
        except SystemExit as exc:  # --help
            return int(exc.code or 0)
        json_mode = args.json
        try:
            client = DaemonClient(args.url)
        except ValueError as exc:
            raise _Fail(str(exc), EXIT_USAGE) from None
        with client:
            return COMMANDS[args.command](client, args)
    except _Fail as exc:
        return _report(str(exc), exc.code, json_mode)
    except DaemonUnreachable as exc:
        return _report(str(exc), EXIT_UNREACHABLE, json_mode)
    except (IdentityError, PathError) as exc:
        return _report(str(exc), EXIT_USAGE, json_mode)
    except DaemonError as exc:
        return _report(f"bdnd answered {exc.status}: {exc.message}", EXIT_FAILED, json_mode)
    except BdnError as exc:
        return _report(str(exc), EXIT_FAILED, json_mode)
    except KeyboardInterrupt:
        return _report("interrupted", 130, json_mode)
    except BrokenPipeError:
        # stdout closed early (`bdnctl snapshots | head`): not an error worth a traceback.
        sys.stderr.close()
        return EXIT_FAILED


def _report(message: str, code: int, json_mode: bool) -> int:
    line = one_line(message, 1000)
    if json_mode:
        emit_json({"error": line, "exit_code": code})
    print(f"{PROG}: error: {line}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
