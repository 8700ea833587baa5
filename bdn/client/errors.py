"""Errors the client raises when the daemon answers with an error or cannot be reached.

They extend the shared ``BdnError`` (bdn/proto/errors.py) so a serving process can catch every
failure of bdn with one ``except BdnError``.
"""

from __future__ import annotations

from typing import Any

from bdn.proto.errors import BdnError

_MAX_MESSAGE = 500


def one_line(text: str, limit: int = _MAX_MESSAGE) -> str:
    """First line of ``text`` with control characters replaced, cut to ``limit`` characters.

    The daemon's messages are shown to operators verbatim; a hostile or broken answer must not
    smuggle terminal escapes or a multi-line wall of text into a log line.
    """
    line = text.strip().splitlines()[0] if text.strip() else ""
    line = "".join(c if c.isprintable() else "?" for c in line)
    return line if len(line) <= limit else line[: limit - 3] + "..."


class DaemonError(BdnError):
    """The daemon answered a request with an error status.

    Attributes:
        status: the HTTP status code (400 bad input, 404 unknown, 409 wrong state, ...).
        message: the daemon's one-line ``{"error": ...}`` text (also ``str(err)``).
    """

    def __init__(self, status: int, message: str) -> None:
        self.status = status
        self.message = one_line(message) or f"HTTP {status}"
        super().__init__(self.message)


class SnapshotFailed(DaemonError):
    """A snapshot the caller waits for reached state ``failed``.

    Attributes:
        reason: the daemon's one-line reason (also ``message`` and ``str(err)``).
        snapshot: the daemon's ``<snapshot>`` object when it sent one, else ``None``.
    """

    def __init__(self, reason: str, snapshot: dict[str, Any] | None = None, status: int = 409) -> None:
        super().__init__(status, reason)
        self.reason = self.message
        self.snapshot = snapshot


class DaemonUnreachable(BdnError, ConnectionError):
    """The daemon could not be reached (refused, no such socket, timed out, connection broken).

    Attributes:
        url: the daemon URL the client was given.
        reason: one line saying what went wrong.
    """

    def __init__(self, url: str, reason: str) -> None:
        self.url = url
        self.reason = one_line(reason) or "unknown error"
        super().__init__(f"cannot reach bdnd at {url}: {self.reason}")


class NotPublished(TimeoutError):
    """``DaemonClient.open`` waited ``waited`` seconds for a snapshot nobody has published yet
    (no ``<identity>/bdn.manifest.json`` in the bucket). A ``TimeoutError``: the caller's time
    ran out; the message says what was missing: ``<identity> is not published yet (waited N s):
    <the daemon's reason>``.

    Attributes:
        identity: the snapshot asked for.
        waited: seconds the caller waited.
        reason: the daemon's last one-line reason.
    """

    def __init__(self, identity: str, waited: float, reason: str) -> None:
        self.identity = identity
        self.waited = waited
        self.reason = one_line(reason)
        super().__init__(f"{identity} is not published yet (waited {waited:.0f} s): {self.reason}")
