"""bdnctl verify [--repair]: a ready snapshot's files re-hashed against its READY marker, here or by bdnd."""

from __future__ import annotations

import argparse
import time

from bdn.cli.commands.common import EXIT_OK, EXIT_USAGE, Fail, Subparsers, bytes_cell, cell, seconds
from bdn.cli.output import emit_json
from bdn.client import DaemonClient, SnapshotFailed, open_snapshot
from bdn.client.ready import read_ready, verify_files
from bdn.proto.errors import ChecksumError


def add_verify(sub: Subparsers, common: argparse.ArgumentParser) -> None:
    vf = sub.add_parser("verify", parents=[common], help="re-hash a ready snapshot's files against its READY marker")
    vf.add_argument(
        "target",
        metavar="IDENTITY|DIR",
        help="an identity (asks bdnd where it is), or a snapshot directory path (holds a '/')",
    )
    vf.add_argument(
        "--repair",
        action="store_true",
        help="ask bdnd to re-hash the snapshot, quarantine corrupted chunks and fetch them again",
    )
    vf.add_argument(
        "--timeout",
        type=seconds,
        default=None,
        metavar="S",
        help="with --repair: give up waiting for the repair after S seconds (exit 1)",
    )
    vf.set_defaults(run=_verify)


def _repair(client: DaemonClient, args: argparse.Namespace) -> int:
    identity: str = args.target
    if "/" in identity or identity.startswith("."):
        raise Fail("verify --repair needs an identity (bdnd repairs its own snapshots), not a directory", EXIT_USAGE)
    start = time.monotonic()
    ans = client.repair(identity)
    corrupted = c if isinstance(c := ans.get("corrupted"), list) else []
    snap = client.snapshot(identity)
    if corrupted:
        try:
            snap = client.wait(identity, "ready", timeout=args.timeout)
        except SnapshotFailed as exc:
            raise Fail(f"repair of {identity} failed: {exc}") from None
        except TimeoutError:
            raise Fail(f"repair of {identity} not done after {args.timeout:g} s") from None
    result = {
        "identity": identity,
        "ok": True,
        "chunks": ans.get("chunks"),
        "corrupted": corrupted,
        "repaired": len(corrupted),
        "path": snap.get("path"),
        "seconds": round(time.monotonic() - start, 3),
    }
    if args.json:
        emit_json(result)
    elif corrupted:
        first = corrupted[0] if isinstance(corrupted[0], dict) else {}
        print(
            f"{identity} repaired: {len(corrupted)} corrupted chunk(s) quarantined and fetched again "
            f"(first {cell(first.get('path'))} chunk {cell(first.get('chunk'))}); ready at {cell(snap.get('path'))}"
        )
    else:
        print(
            f"{identity} ok: {cell(ans.get('chunks'))} chunks match READY, nothing to repair ({cell(snap.get('path'))})"
        )
    return EXIT_OK


def _verify(client: DaemonClient, args: argparse.Namespace) -> int:
    if args.repair:
        return _repair(client, args)
    target: str = args.target
    expect: str | None = None
    path: str | None
    if "/" in target or target.startswith("."):
        path = target  # identities never hold '/' nor start with '.', so this is a directory
    else:
        snap = client.snapshot(target)
        if snap.get("state") != "ready":
            raise Fail(f"{target} is not ready (state {cell(snap.get('state'))})")
        path = snap.get("path")
        if not isinstance(path, str) or not path:
            raise Fail(f"daemon reports {target} ready without a path")
        expect = target
    start = time.monotonic()
    # Hashes first, from READY alone: a corrupted header must show up as the bad chunk it is,
    # not as a parse error. Then open, which checks headers and the index against each other.
    marker = read_ready(path)
    if expect is not None and marker.identity != expect:
        raise Fail(f"{path} holds snapshot {marker.identity}, not {expect}")
    try:
        verify_files(path, marker)
    except ChecksumError as exc:
        hint = f"; bdnctl verify --repair {expect} quarantines and re-fetches it" if expect else ""
        raise Fail(f"{exc}{hint}") from None
    with open_snapshot(path) as s:
        result = {
            "identity": s.identity,
            "path": str(s.path),
            "ok": True,
            "files": len(s.files()),
            "bytes": s.ready.total_bytes,
            "seconds": round(time.monotonic() - start, 3),
        }
    if args.json:
        emit_json(result)
    else:
        print(
            f"{result['identity']} ok: {result['files']} files, {bytes_cell(result['bytes'])} "
            f"match READY ({result['path']})"
        )
    return EXIT_OK
