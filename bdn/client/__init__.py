"""bdn.client: what a serving process uses to get checkpoints from the node's bdnd.

- ``DaemonClient(url)``: the daemon's local API (health, status, prefetch, wait for a state, pull
  files and tensors over HTTP, ``open()`` the ready directory, prefetching it first if needed).
  Blocking; HTTP on httpx (``bdn.client.transport``).
- ``EngineLink`` / ``run_hot_swap_loop``: the engine hand-off of a hot-load (register, long-poll
  for the next READY snapshot, prepare while serving, swap, acknowledge with the pause); the fleet
  calls ``hot_load``/``hot_load_status``, leases and ``collect_garbage``.
- ``open_snapshot(path)`` / ``Snapshot``: a READY snapshot directory, tensors as zero-copy
  read-only numpy views into the daemon's shared memory, ``verify()`` against READY's digests.

Example::

    from bdn.client import DaemonClient
    with DaemonClient() as bdn, bdn.open("step000002", timeout=600) as snap:
        weights = snap.tensors()         # {name: np.ndarray}, no copies
        engine.load(weights, policy_version=snap.policy_version)
"""

from bdn.client.daemon import DEFAULT_URL, STATES, DaemonClient
from bdn.client.engine import EngineLink, run_hot_swap_loop
from bdn.client.errors import (
    DaemonError,
    DaemonUnreachable,
    NotPublished,
    SnapshotFailed,
)
from bdn.client.fleet import (
    call_json,
    collect_garbage,
    hot_load,
    hot_load_status,
    list_engines,
    release_lease,
    remove_engine,
    take_lease,
)
from bdn.client.ready import ReadyFile, ReadyMarker, read_ready
from bdn.client.snapshot import Snapshot, open_snapshot

__all__ = [
    "DEFAULT_URL",
    "STATES",
    "DaemonClient",
    "DaemonError",
    "DaemonUnreachable",
    "EngineLink",
    "NotPublished",
    "ReadyFile",
    "ReadyMarker",
    "Snapshot",
    "SnapshotFailed",
    "call_json",
    "collect_garbage",
    "hot_load",
    "hot_load_status",
    "list_engines",
    "open_snapshot",
    "read_ready",
    "release_lease",
    "remove_engine",
    "run_hot_swap_loop",
    "take_lease",
]
