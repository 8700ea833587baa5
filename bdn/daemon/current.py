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
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger("bdn.current")

LINK_NAME = "current"

__all__ = ["LINK_NAME", "CurrentLink"]


class CurrentLink:
    """``<root>/current``; ``point(identity)`` re-points it (raises OSError if it cannot)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.path = root / LINK_NAME

    def point(self, identity: str) -> None:
        """Make ``current`` name ``<root>/<identity>`` (atomic replace)."""
        tmp = self.root / f".{LINK_NAME}.{os.getpid()}.tmp"
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass
        os.symlink(identity, tmp)
        os.replace(tmp, self.path)
        log.info("current -> %s", identity)

    def target(self) -> str | None:
        """The identity the link names, or None (no link yet)."""
        try:
            return os.readlink(self.path)
        except OSError:
            return None
