"""What this node may advertise of a snapshot: its have-bits less the chunks of files that are
gone or shorter than the manifest says on disk (deleted or truncated by someone else). A peer
that trusted such bits would ask for chunks this node cannot send.

The files are looked at (one ``stat`` each, of the files with a chunk held) at most once per
``CHECK_EVERY_S`` per snapshot layer; the have answers (HTTP ``have``, the wire's BITFIELD to a
new subscriber) use the masked bits. The index is not changed here: a request for a chunk of a
missing file is answered "not here" by the transfer server's own look at the file.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict

import numpy as np

from bdn.daemon.process.clock import SYSTEM, Clock
from bdn.daemon.snapshots.layers import STORED
from bdn.daemon.snapshots.snapshot import SnapshotJob
from bdn.daemon.store.bitfield import Bitfield
from bdn.daemon.store.chunklist import ChunkList

#: Seconds a look at a snapshot layer's files is reused.
CHECK_EVERY_S = 1.0
#: Snapshot layers whose last look is kept.
KEEP = 64


class HeldFiles:
    """``advertised(job, layer)``: the bits to advertise (see the module docstring)."""

    def __init__(self, clock: Clock = SYSTEM) -> None:
        self.clock = clock
        self._seen: OrderedDict[tuple[str, str], tuple[float, list[tuple[int, int]]]] = OrderedDict()
        self._lock = threading.Lock()  # asked on the loop (HTTP have) and on connection threads (BITFIELD)

    def advertised(self, job: SnapshotJob, layer: str) -> Bitfield | None:
        """``job.bits(layer)``, or a copy with the positions of gone or short files cleared."""
        bits = job.bits(layer)
        refs = job.refs(layer)
        if bits is None or not bits.count or not isinstance(refs, ChunkList):
            return bits
        gone = self._gone(job, layer, refs, bits)
        if not gone:
            return bits
        out = Bitfield(bits.n, bits.to_bytes())
        for start, end in gone:
            for i in range(start, end):
                out.clear(i)
        return out

    def _gone(self, job: SnapshotJob, layer: str, refs: ChunkList, bits: Bitfield) -> list[tuple[int, int]]:
        key = (job.identity, layer)
        now = self.clock.monotonic()
        with self._lock:
            hit = self._seen.get(key)
        if hit is not None and now - hit[0] < CHECK_EVERY_S:
            return hit[1]
        m = job.manifest
        assert m is not None
        gone: list[tuple[int, int]] = []
        held = bits.set_positions()
        start = 0
        for fi, f in enumerate(m.files):
            n = len(f.chunks if layer == STORED else f.result_chunks)
            if n and np.searchsorted(held, start) < np.searchsorted(held, start + n):
                need = f.size if layer == STORED else f.result_size
                try:
                    short = os.stat(job.file_path(layer, fi)).st_size < need
                except OSError:
                    short = True
                if short:
                    gone.append((start, start + n))
            start += n
        with self._lock:
            self._seen[key] = (now, gone)
            self._seen.move_to_end(key)
            while len(self._seen) > KEEP:
                self._seen.popitem(last=False)
        return gone
