"""The ``current`` link: ``<shm_dir>/<swarm_id>/current``, a symlink to the snapshot this replica serves.

For engines a process manager starts (``vllm serve "$(bdnctl path current)"``, or a pod spec
naming ``/dev/shm/bdn/<swarm_id>/current``): the link always names a complete READY directory,
never a half-built one. It is replaced atomically: a new symlink under a temporary name, then
``rename(2)`` over the old one (POSIX: a reader sees the old or the new link, never none). The
link is relative (``current -> step000003``), so it resolves inside a container that mounts the
store at another path.

A reader that loads files *through* the link while it is replaced may read two snapshots; resolve
it once (``os.path.realpath``, as ``bdnctl path current`` does) and read from that directory.
``current`` is a reserved identity (``bdn.proto.identity``), so no snapshot can take the name.

bdn only ever replaces a symlink there. Anything else under the name (a directory or a file
someone else put there) is not bdn's: it is left exactly as it is, never deleted or renamed over,
and every attempt to re-point the link raises :class:`CurrentBlocked` saying so; the link is
made again at the next change once the operator moved it away.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from bdn.proto.errors import BdnError

log = logging.getLogger("bdn.current")

LINK_NAME = "current"

__all__ = ["LINK_NAME", "CurrentBlocked", "CurrentLink"]


class CurrentBlocked(BdnError, OSError):
    """``current`` exists and is not a symlink (someone else's directory or file): bdn leaves it
    alone. An OSError too, so callers that treat the link as a convenience go on serving."""


class CurrentLink:
    """``<root>/current``; ``point(identity)`` re-points it (raises OSError if it cannot)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.path = root / LINK_NAME

    def problem(self) -> str | None:
        """Why the link cannot be managed (one line: something other than a symlink holds the
        name), or None (a symlink, or nothing yet)."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return None
        except OSError as e:
            return f"{self.path}: {e.strerror or e}"
        if stat.S_ISLNK(st.st_mode):
            return None
        what = "a directory" if stat.S_ISDIR(st.st_mode) else "a file"
        return (
            f"{self.path} is {what}, not the symlink bdn makes: bdn did not make it and leaves it as it is "
            f"(never deleted); the link naming the served snapshot is not updated until it is moved away"
        )

    def point(self, identity: str) -> None:
        """Make ``current`` name ``<root>/<identity>`` (atomic replace).

        Raises:
            CurrentBlocked: a directory or file that is not bdn's holds the name (left as it is).
            OSError: the link cannot be written.
        """
        why = self.problem()
        if why is not None:
            raise CurrentBlocked(why)
        tmp = self.root / f".{LINK_NAME}.{os.getpid()}.tmp"
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass
        os.symlink(identity, tmp)
        try:
            # (rename(2) of a symlink over a directory fails, EISDIR; over a file it would
            # succeed: problem() above is what keeps someone's file, this what keeps a
            # directory that appeared in between)
            os.replace(tmp, self.path)
        except OSError:
            tmp.unlink(missing_ok=True)
            why = self.problem()
            if why is not None:
                raise CurrentBlocked(why) from None
            raise
        log.info("current -> %s", identity)

    def target(self) -> str | None:
        """The identity the link names, or None (no link yet, or not a link: :meth:`problem`)."""
        try:
            return os.readlink(self.path)
        except OSError:
            return None
