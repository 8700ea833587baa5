"""Relays (``cut_through_relay``, off by default): a node receiving a stored chunk cut-through
passes it on, cut-through, while it still arrives (bdn.transfer.growing, ``Growing.relay``).

The hook a fetch thread calls when a cut-through answer begins (``TransferClient.fetch_into(...,
relay=)``): a ``Growing`` the chunk's parts are reported to as they land in the target file,
registered and announced (HAVE_GROWING) on the event loop, so this node's transfer server passes
the chunk on to further askers while it arrives (a relay chain: owner -> here -> others, each
link at the bucket read's pace). Why off: on the emulated 8-node cluster it gained nothing
(bench/NOTES.md, "Swarm scheduling, part 7"; docs/DESIGN.md "Cut-through").

Known limits (found in review, not fixed while off): ``GrowingChunks`` is keyed by address, so a
relay's copy replaces another copy of the same bytes growing here (two jobs, duplicate chunks)
until it is indexed; and a relay holds back pieces under 64 KiB, so when its sender stalls, a
downstream asker's "no new byte" timer can run out before the relay's own and blame the relay.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from bdn.daemon.chunklist import ChunkList
from bdn.daemon.snapshot import STORED, SnapshotJob
from bdn.proto.manifest import ChunkRef
from bdn.transfer.growing import Growing

#: Registers and announces a relay's Growing on the loop: (job, address, ref, growing).
Grow = Callable[[SnapshotJob, str, ChunkRef, Growing], None]


def relay_hook(
    job: SnapshotJob, address: str, ref: ChunkRef, target: Path, relayed: list[Growing], grow: Grow,
) -> Callable[[], Growing | None] | None:
    """The ``relay`` hook for one whole-chunk fetch of ``ref`` into ``target`` (call it on the
    event loop), or None when the chunk cannot relay: no swarm ``address``, or not a stored
    chunk of ``job`` (owners read only stored chunks from the bucket). Each ``Growing`` it makes
    is appended to ``relayed`` (the caller unregisters it after the fetch) and handed to
    ``grow`` on the loop (``call_soon_threadsafe``: it runs before the fetch's result does)."""
    if not address:
        return None
    refs = job.refs(STORED)
    if not isinstance(refs, ChunkList) or refs.holds(ref) is None:
        return None
    loop = asyncio.get_running_loop()

    def begin() -> Growing | None:
        g = Growing.relay(str(target), ref.offset, ref.length)
        relayed.append(g)
        loop.call_soon_threadsafe(grow, job, address, ref, g)
        return g
    return begin
