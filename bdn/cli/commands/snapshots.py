"""bdnctl prefetch, cancel, snapshots and path: one snapshot's load on this node and where it is."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from tqdm import tqdm

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
    seconds,
    snapshot_table,
)
from bdn.cli.output import BYTES_BAR, emit_json
from bdn.client import DaemonClient, DaemonError, SnapshotFailed
from bdn.client.errors import one_line
from bdn.client.fleet import call_json

#: The reason ``DELETE /v1/snapshots/{id}`` gives a load it stopped (``catalog.delete``).
CANCELLED = "cancelled by the operator"


def add_prefetch(sub: Subparsers, common: argparse.ArgumentParser) -> None:
    pf = sub.add_parser("prefetch", parents=[common], help="start fetching a snapshot onto this node")
    pf.add_argument("identity", help="the snapshot's identity, as published (e.g. step000002)")
    pf.add_argument("--wait", action="store_true", help="wait until ready, with a progress bar")
    pf.add_argument(
        "--wait-publish",
        action="store_true",
        help="if nothing is in the bucket yet, wait for it to be published (else fail at once)",
    )
    pf.add_argument(
        "--timeout",
        type=seconds,
        default=None,
        metavar="S",
        help="with --wait: give up after S seconds (exit 1; default: no limit)",
    )
    pf.set_defaults(run=_prefetch)


def add_cancel(sub: Subparsers, common: argparse.ArgumentParser) -> None:
    cf = sub.add_parser("cancel", parents=[common], help="stop a snapshot's load on this node")
    cf.add_argument("identity", help="the snapshot's identity")
    cf.set_defaults(run=_cancel)


def add_snapshots(sub: Subparsers, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("snapshots", parents=[common], help="table of the snapshots this daemon knows")
    p.set_defaults(run=_snapshots)


def add_path(sub: Subparsers, common: argparse.ArgumentParser) -> None:
    pa = sub.add_parser("path", parents=[common], help="the directory of a ready snapshot, or of the one served")
    pa.add_argument(
        "identity", metavar="IDENTITY|current", help="a snapshot's identity, or current: the one this replica serves"
    )
    pa.add_argument("--wait", action="store_true", help="wait until it is ready (or, for current, served)")
    pa.add_argument(
        "--timeout",
        type=seconds,
        default=DEFAULT_WAIT_S,
        metavar="S",
        help="with --wait: give up after S seconds (exit 1; default %(default)g)",
    )
    pa.set_defaults(run=_path)


def _prefetch(client: DaemonClient, args: argparse.Namespace) -> int:
    identity: str = args.identity
    if args.timeout is not None and not args.timeout >= 0:
        raise Fail("--timeout must be >= 0 seconds", EXIT_USAGE)
    start = time.monotonic()
    # the daemon looks for the publication no longer than this command waits
    snap = client.prefetch(
        identity, wait_publish=args.wait_publish, publish_timeout=args.timeout if args.wait else None
    )
    if not args.wait:
        if snap.get("state") == "failed":
            raise Fail(f"{identity} failed: {_reason(identity, snap.get('reason'))}")
        # The daemon answers once it looked at the bucket, so a request that fails at once (nothing
        # published, a manifest refused, no room) is a failed record here: exit 1, above.
        if args.json:
            emit_json(snap)
        elif snap.get("state") == "ready":
            print(f"{identity}: ready: {cell(snap.get('path'))}")
        else:
            reason = f": {cell(snap.get('reason'))}" if snap.get("reason") else ""
            print(f"{identity}: {cell(snap.get('state'))} (prefetch started){reason}")
        return EXIT_OK

    # disable=None: no bar when stderr is not a terminal, so logs do not fill with redraws.
    bar = tqdm(
        total=None,
        desc=identity,
        **BYTES_BAR,
        file=sys.stderr,
        disable=True if args.json else None,
        leave=False,
        dynamic_ncols=True,
        mininterval=0.2,
    )
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
            bar.set_postfix_str(
                cell(s.get("state")) + (f": {one_line(str(s['reason']), 80)}" if s.get("reason") else "")
            )
            if s.get("reason") and s.get("state") != "failed" and not args.json and not sys.stderr.isatty():
                print(f"{identity}: {cell(s.get('state'))}: {cell(s.get('reason'))}", file=sys.stderr)

    try:
        update(snap)
        if snap.get("state") == "failed":
            raise SnapshotFailed(str(snap.get("reason") or "failed"), snap)
        if snap.get("state") != "ready":
            snap = client.wait(identity, "ready", args.timeout, poll=POLL_SECONDS, on_update=update)
        update(snap)
    except SnapshotFailed as exc:
        raise Fail(f"{identity} failed: {_reason(identity, exc.reason)}") from None
    except TimeoutError as exc:
        why = str(shown_state[0][1] or "") if shown_state[0] else ""
        if "not published yet" in why:
            raise Fail(f"{identity} is not published yet (waited {time.monotonic() - start:.0f} s): {why}") from None
        raise Fail(str(exc)) from None
    finally:
        bar.close()
    elapsed = time.monotonic() - start
    if args.json:
        emit_json(snap)
    else:
        print(f"{identity} ready in {elapsed:.1f} s: {cell(snap.get('path'))}")
    return EXIT_OK


def _reason(identity: str, reason: Any) -> str:
    """A failed snapshot's reason without the daemon's ``snapshot <identity>: `` prefix (the
    line names the identity already)."""
    return cell(str(reason or "failed").removeprefix(f"snapshot {identity}: ").removeprefix(f"snapshot {identity!r}: "))


def _cancel(client: DaemonClient, args: argparse.Namespace) -> int:
    snap = client.cancel(args.identity)
    if args.json:
        emit_json(snap)
    elif snap.get("state") == "failed" and snap.get("reason") == CANCELLED:
        print(f"{args.identity}: {CANCELLED}")
    elif snap.get("state") == "failed":  # it had failed before: its record is dropped
        print(f"{args.identity}: had failed already, record dropped ({cell(snap.get('reason'))})")
    else:
        print(f"{args.identity}: {cell(snap.get('state'))}, nothing to cancel")
    return EXIT_OK


def _snapshots(client: DaemonClient, args: argparse.Namespace) -> int:
    snaps = client.snapshots()
    if args.json:
        emit_json({"snapshots": snaps})
    elif snaps:
        print(snapshot_table(snaps))
    else:
        print("no snapshots")
    return EXIT_OK


def _current_path(client: DaemonClient) -> dict[str, Any] | None:
    try:
        _status, ans = call_json(client, "GET", "/v1/current")
    except DaemonError as exc:
        if exc.status == 404:
            return None
        raise
    if not isinstance(ans, dict) or not isinstance(ans.get("path"), str):
        raise Fail("daemon answered /v1/current without a path")
    return ans


def _path(client: DaemonClient, args: argparse.Namespace) -> int:
    identity: str = args.identity
    if not args.timeout >= 0:
        raise Fail("--timeout must be >= 0 seconds", EXIT_USAGE)
    if identity == "current":
        rec: dict[str, Any] | None = None
        try:
            for attempt in retry.attempts(
                deadline_s=args.timeout if args.wait else 0.0, first_s=POLL_SECONDS, max_s=1.0, on=(NotYet,)
            ):
                with attempt:
                    rec = _current_path(client)
                    if rec is None:
                        raise NotYet
        except NotYet:
            raise Fail(
                "this replica serves no snapshot yet"
                + (f" (waited {args.timeout:g} s)" if args.wait else " (--wait waits for one)")
            ) from None
        assert rec is not None
        ans = {"identity": rec.get("identity"), "path": rec["path"], "link": rec.get("link")}
    else:
        snap = client.snapshot(identity) if not args.wait else None
        if args.wait:
            client.prefetch(identity)
            try:
                snap = client.wait(identity, "ready", args.timeout, poll=POLL_SECONDS)
            except SnapshotFailed as exc:
                raise Fail(f"{identity} failed: {exc.reason}") from None
            except TimeoutError as exc:
                raise Fail(str(exc)) from None
        assert snap is not None
        if snap.get("state") != "ready" or not isinstance(snap.get("path"), str):
            raise Fail(f"{identity} is not ready (state {cell(snap.get('state'))})")
        ans = {"identity": identity, "path": snap["path"]}
    if args.json:
        emit_json(ans)
    else:
        print(ans["path"])
    return EXIT_OK
