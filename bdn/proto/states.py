"""The one definition of bdn's state names (DESIGN.md, "Snapshot states" and "Replica stages").

Pure data: the daemon, the client, ``bdnctl`` and the metrics all import these tuples, so a new
state is added in one place.
"""

from __future__ import annotations

#: A snapshot's life on one node, in order; ``ready`` and ``failed`` are terminal.
SNAPSHOT_STATES: tuple[str, ...] = ("queued", "downloading", "applying", "verifying", "ready", "failed")
TERMINAL: tuple[str, ...] = ("ready", "failed")
#: States a ``wait`` request may name (waiting for ``failed`` makes no sense).
WAITABLE: tuple[str, ...] = SNAPSHOT_STATES[:-1]

#: A replica's hot-load stage, as ``GET /hot_load/v1/models/hot_load`` reports it: the snapshot
#: states while it is built here, then ``loading`` (an engine prepares it), ``done`` (every engine
#: acknowledged the swap) or ``error`` (with a reason).
REPLICA_STAGES: tuple[str, ...] = (
    "queued",
    "downloading",
    "applying",
    "verifying",
    "ready",
    "loading",
    "done",
    "error",
)
