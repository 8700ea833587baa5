"""bdnctl status, peers and gc: the node, its swarm and its store."""

from __future__ import annotations

import argparse

from bdn.cli.commands.common import EXIT_OK, Subparsers, bytes_cell, cell, indent, snapshot_table, table
from bdn.cli.output import emit_json
from bdn.client import DaemonClient
from bdn.client.fleet import collect_garbage


def add_status(sub: Subparsers, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "status", parents=[common], help="node, readiness (and why not), swarm, peers, counters and snapshots"
    )
    p.set_defaults(run=_status)


def add_peers(sub: Subparsers, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("peers", parents=[common], help="the swarm members this daemon sees")
    p.set_defaults(run=_peers)


def add_gc(sub: Subparsers, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("gc", parents=[common], help="collect old snapshots now")
    p.set_defaults(run=_gc)


def _status(client: DaemonClient, args: argparse.Namespace) -> int:
    st = client.status()
    if args.json:
        emit_json(st)
        return EXIT_OK
    lines = [f"{k:<9} {cell(st.get(k))}" for k in ("node_id", "swarm_id", "peer_url", "version")]
    lines += _readiness(st.get("readiness"))
    bucket = st.get("bucket")
    if isinstance(bucket, dict):
        extra = ", ".join(
            f"{k} {bytes_cell(v) if k.endswith('bytes') else cell(v)}" for k, v in bucket.items() if k != "url"
        )
        lines.append(f"{'bucket':<9} {cell(bucket.get('url'))}" + (f" ({extra})" if extra else ""))
    peers = p if isinstance(p := st.get("peers"), list) else []
    lines.append(f"\npeers ({len(peers)}):")
    if peers:
        rows = [
            [p.get("node_id"), p.get("url"), "yes" if p.get("alive") else "no"] for p in peers if isinstance(p, dict)
        ]
        lines.append(indent(table(["NODE", "URL", "ALIVE"], rows)))
    counters = st.get("counters")
    if isinstance(counters, dict) and counters:
        lines.append("\ncounters:")
        width = max(len(str(k)) for k in counters)
        for k, v in counters.items():
            shown = bytes_cell(v) if "bytes" in str(k) else cell(v)
            lines.append(f"  {cell(k):<{width}}  {shown}")
    snaps = [s for s in st.get("snapshots") or [] if isinstance(s, dict)]
    lines.append(f"\nsnapshots ({len(snaps)}):")
    if snaps:
        lines.append(indent(snapshot_table(snaps)))
    print("\n".join(lines))
    return EXIT_OK


def _readiness(doc: object) -> list[str]:
    """``/v1/status``'s readiness as lines: ready yes/no, one line per reason and warning, and
    what the daemon waits for (``-`` from a daemon that does not report it)."""
    if not isinstance(doc, dict):
        return [f"{'ready':<9} -"]
    lines = [f"{'ready':<9} {'yes' if doc.get('ready') is True else 'no'}"]
    for key, label in (("reasons", "because"), ("warnings", "warning")):
        items = doc.get(key)
        lines += [f"{label:<9} {cell(r)}" for r in (items if isinstance(items, list) else [])]
    if doc.get("waiting_for"):
        lines.append(f"{'waiting':<9} for {cell(doc.get('waiting_for'))}")
    return lines


def _peers(client: DaemonClient, args: argparse.Namespace) -> int:
    st = client.status()
    peers = [p for p in st.get("peers") or [] if isinstance(p, dict)]
    if args.json:
        emit_json({"node_id": st.get("node_id"), "swarm_id": st.get("swarm_id"), "peers": peers})
    elif peers:
        print(
            table(
                ["NODE", "URL", "ALIVE", "ALSO"],
                [
                    [p.get("node_id"), p.get("url"), "yes" if p.get("alive") else "no", ", ".join(p.get("also") or [])]
                    for p in peers
                ],
            )
        )
    else:
        print("no peers")
    return EXIT_OK


def _gc(client: DaemonClient, args: argparse.Namespace) -> int:
    ans = collect_garbage(client)
    if args.json:
        emit_json(ans)
        return EXIT_OK
    removed = [str(x) for x in ans.get("removed") or []] if isinstance(ans.get("removed"), list) else []
    kept = [str(x) for x in ans.get("kept") or []] if isinstance(ans.get("kept"), list) else []
    print(f"removed {len(removed)}" + (f": {', '.join(removed)}" if removed else " (nothing to collect)"))
    print(f"kept {len(kept)}" + (f": {', '.join(kept)}" if kept else ""))
    return EXIT_OK
