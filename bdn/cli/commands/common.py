"""What bdnctl's command modules share: the failure to report, exit codes, poll and wait defaults,
and the plain-text tables of the human output (cells are bounded, one line each: the daemon's
answers are shown, not trusted)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from bdn.cli.output import human_bytes
from bdn.client.errors import one_line
from bdn.proto.errors import IdentityError
from bdn.proto.identity import validate_identity

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3
POLL_SECONDS = 0.2
DEFAULT_WAIT_S = 600.0

#: ``sub.add_parser``'s owner (argparse's private type has no public name).
Subparsers = Any


def seconds(text: str) -> float:
    """An argparse ``type``: a finite number of seconds >= 0 (else argparse's usage error, exit 2)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 <= v < float("inf"):  # (NaN fails too)
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text!r}")
    return v


def identity_arg(text: str) -> str:
    """An argparse ``type``: a well-formed snapshot identity (else a usage error, exit 2)."""
    try:
        return validate_identity(text)
    except IdentityError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def nonempty(text: str) -> str:
    """An argparse ``type``: any text but an empty one."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


class Fail(Exception):
    """A failure to report as one line with an exit code."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


class NotYet(Exception):
    """Not every replica serves the snapshot yet (hot-load --wait polls again)."""


# -- output helpers ----------------------------------------------------------------------------


def cell(value: Any) -> str:
    """One table cell: ``-`` for None or empty, else ``str(value)`` on one line (at most 200 characters)."""
    return "-" if value is None or value == "" else one_line(str(value), 200)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table: ``headers`` and ``rows`` left-aligned in columns two spaces apart."""
    cells = [[str(h) for h in headers]] + [[cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def bytes_cell(n: Any) -> str:
    """A byte count in SI units (``human_bytes``: B, kB, MB, GB), any other value as a cell."""
    return human_bytes(n) if isinstance(n, int | float) and not isinstance(n, bool) else cell(n)


def ms_cell(ms: Any) -> str:
    """A duration in milliseconds with two decimals (``0.02``; an engine acks its pause unrounded),
    any other value as a cell."""
    return f"{ms:.2f}" if isinstance(ms, int | float) and not isinstance(ms, bool) else cell(ms)


def progress(snap: dict[str, Any]) -> str:
    """A snapshot record's progress as a percentage of ``bytes_total``; ``100%`` once ready, else ``-``."""
    done, total = snap.get("bytes_done"), snap.get("bytes_total")
    if isinstance(done, int) and isinstance(total, int) and total > 0:
        return f"{min(100.0, 100.0 * done / total):.0f}%"
    return "100%" if snap.get("state") == "ready" else "-"


def snapshot_table(snaps: list[dict[str, Any]]) -> str:
    """The snapshots table of ``bdnctl status``: identity, kind, policy version, state, progress, path or reason."""
    rows = [
        [
            s.get("identity"),
            s.get("kind"),
            s.get("policy_version"),
            s.get("state"),
            progress(s),
            s.get("path") if s.get("state") == "ready" else s.get("reason"),
        ]
        for s in snaps
    ]
    return table(["IDENTITY", "KIND", "POLICY_VERSION", "STATE", "PROGRESS", "PATH"], rows)


def indent(text: str) -> str:
    """``text`` with every line indented two spaces."""
    return "\n".join("  " + line for line in text.splitlines())
