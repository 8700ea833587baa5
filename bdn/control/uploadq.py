"""Which waiting request a freed upload slot serves: the chunk this node has sent least.

A holder with all its upload slots busy keeps a few requests waiting (the rest are told busy).
When a slot frees, first-come-first-served hands it to whatever was asked first, and under a
herd (every peer of a bucket reader asks it for its newest chunk) that is often a chunk the
reader already sent to several peers, who could forward it, while its newest chunk has no
other holder yet. Serving the chunk sent *least* so far (the oldest request among equals)
makes every chunk leave its first holder a few times before any leaves it many times, so more
holders forward each fresh chunk sooner: BitTorrent's "super-seeding" idea (BEP 16: a seed
spreads distinct pieces first), applied to the order of a holder's queue rather than to what
it announces.

bench/fleetsim (N = 100, 20 GB delta, 3 seeds) measures the effect against FIFO; bdnd's
uploads (``bdn/daemon/uploads.py``) admit or refuse and do not queue yet, so this order runs
in the simulator only until they do.

:func:`may_wait` decides which requests wait at all (the rest are told busy).

Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def may_wait(chunk: int, waiting: Sequence[int], uploading: Mapping[int, int], limit: int) -> bool:
    """May a request for ``chunk`` wait for a slot at a holder whose upload slots are all taken?
    Only while fewer than ``limit`` requests wait, none of them for the same chunk, and the
    holder is not sending that chunk now (``uploading``: chunk -> uploads running): a chunk it
    is sending already has receivers that forward it within one real chunk, so the asker is
    told busy and takes it from one of them (its HAVE wakes the asker) instead of waiting a
    whole copy here. At the end of a snapshot every node wants the same last chunks, and FIFO
    waiting at their first holders made that herd one queue deep per hop (bench/NOTES.md,
    "Issue 13, part 6"); a fresh chunk (a bucket reader's newest) still waits for the next slot.
    """
    if len(waiting) >= limit or uploading.get(chunk, 0) > 0:
        return False
    return chunk not in waiting


def next_upload(waiting: Sequence[int], sent: Mapping[int, int]) -> int:
    """Index into ``waiting`` (the chunk index of each waiting request, oldest first) of the
    request to serve: the chunk with the fewest uploads started so far (``sent``: chunk ->
    count, missing = 0), the oldest among equals. ``waiting`` must not be empty.

    Raises:
        ValueError: ``waiting`` is empty.
    """
    if not waiting:
        raise ValueError("no waiting request")
    best, best_sent = 0, sent.get(waiting[0], 0)
    for k in range(1, len(waiting)):
        c = sent.get(waiting[k], 0)
        if c < best_sent:
            best, best_sent = k, c
    return best
