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

``prefetch`` without ``--wait`` returns once the daemon has looked at the bucket: a request that
fails at once (nothing published under the identity, a manifest refused, no room in shm) exits
1 with the reason, one that is accepted prints the state (``ready`` with its path, or what it
waits for). ``prefetch --wait`` shows a progress bar of fetched/total stored bytes on stderr and ends with
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

The commands are :mod:`bdn.cli.commands` (one module per group); this module is the entry point:
the global options, the subcommands in ``--help`` order, and errors mapped to exit codes.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from bdn.cli.commands import fleet, node, snapshots, verify
from bdn.cli.commands.common import EXIT_FAILED, EXIT_UNREACHABLE, EXIT_USAGE, Fail
from bdn.cli.helpfmt import DefaultsFormatter
from bdn.cli.output import VERSION, emit_json
from bdn.client import DaemonClient, DaemonError, DaemonUnreachable
from bdn.client.errors import one_line
from bdn.proto.errors import BdnError, IdentityError, PathError

PROG = "bdnctl"
DEFAULT_URL = "http://127.0.0.1:7081"
#: The subcommands, in the order ``--help`` lists them.
_COMMANDS = (
    snapshots.add_prefetch,
    snapshots.add_cancel,
    node.add_status,
    snapshots.add_snapshots,
    verify.add_verify,
    fleet.add_hot_load,
    fleet.add_engines,
    snapshots.add_path,
    node.add_peers,
    node.add_gc,
)


EPILOG = """\
examples:
  bdnctl prefetch step000002 --wait     fetch a snapshot onto this node, with a progress bar
  bdnctl snapshots                      what this node holds, loads or failed (with the reason)
  bdnctl hot-load step000002 --wait     move the whole fleet to it, one table row per replica
  bdnctl COMMAND --help                 the options of one command

exit status: 0 success; 1 the operation failed (a request the daemon refused or failed at once,
a failed snapshot, a wait that timed out, a verification that failed); 2 usage error (bad
arguments, bad URL, malformed identity); 3 bdnd unreachable. Every failure prints one line
"bdnctl: error: ..." on stderr (and {"error", "exit_code"} on stdout with --json)."""


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # no prefix matching: "--partition-secret X" was taken as --partition-secret-file X
        # (a new user's report; the error then printed the secret as a file name)
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", DefaultsFormatter)  # every --help shows the defaults
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        # argparse would print the whole usage block; the rule is one line, exit 2 (usage).
        raise Fail(f"{message} (see {PROG} --help)", EXIT_USAGE)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Operate the node's bdn daemon (bdnd) through its local API.", epilog=EPILOG)
    p.add_argument(
        "--url",
        default=os.environ.get("BDN_URL") or DEFAULT_URL,
        help="bdnd local API: http://host:port or unix:///path.sock (default $BDN_URL or %(default)s)",
    )
    p.add_argument("--json", action="store_true", help="print machine-readable JSON on stdout")
    p.add_argument("--version", action="version", version=VERSION)
    # --url and --json work after the subcommand too (`bdnctl status --json`); SUPPRESS keeps a
    # subcommand that does not repeat them from resetting what was given before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for add in _COMMANDS:
        add(sub, common)
    return p


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
            raise Fail(str(exc), EXIT_USAGE) from None
        with client:
            return int(args.run(client, args))
    except Fail as exc:
        return _report(str(exc), exc.code, json_mode)
    except DaemonUnreachable as exc:
        return _report(str(exc), EXIT_UNREACHABLE, json_mode)
    except (IdentityError, PathError) as exc:
        return _report(str(exc), EXIT_USAGE, json_mode)
    except DaemonError as exc:
        hint = ""
        if exc.status == 401:
            # the local API has no authentication: a 401 comes from a peer port (7080 by default)
            hint = (
                f" ({args.url} looks like bdnd's peer port; bdnctl talks to its local API: "
                "local_listen, default http://127.0.0.1:7081, or local_socket)"
            )
        return _report(f"bdnd answered {exc.status}: {exc.message}{hint}", EXIT_FAILED, json_mode)
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
