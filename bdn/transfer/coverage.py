"""Which bytes of a cut-through answer arrived (bdn.transfer.growing, PART frames of
bdn.proto.wire): the receiver's check that the parts never overlap, stay bounded, and in the end
cover the range asked."""

from __future__ import annotations

import bisect

from bdn.proto.errors import ProtocolError

#: Disjoint byte intervals a cut-through answer may leave open at once. An honest sender's
#: parts grow from the starts of its bucket parts (at most ``bucket_concurrency`` of them, plus
#: the held-back end), so its coverage has a handful of intervals; a sender that holds the
#: secret could otherwise send 1-byte parts with gaps between them and make the receiver keep
#: ``n / 2`` intervals (two Python lists of ints: ~70 bytes per interval, 280 MB for a 8 MiB
#: chunk) and insert into them in O(n) each.
MAX_INTERVALS = 1024


class Coverage:
    """Which bytes of an ``n``-byte range arrived, as merged ``[start, end)`` intervals: the
    receiver's check that a cut-through answer's parts never overlap and cover the range.
    At most ``MAX_INTERVALS`` disjoint intervals (bounded memory and work per answer)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._starts: list[int] = []
        self._ends: list[int] = []
        self.bytes = 0

    def add(self, off: int, length: int) -> None:
        """Count ``[off, off + length)``. Raises ProtocolError if it overlaps what arrived or
        would open more than ``MAX_INTERVALS`` disjoint intervals."""
        end = off + length
        i = bisect.bisect_right(self._starts, off)
        if (i and self._ends[i - 1] > off) or (i < len(self._starts) and self._starts[i] < end):
            raise ProtocolError(f"cut-through part {off}+{length} overlaps bytes already received")
        if i and self._ends[i - 1] == off:  # extends the interval before it
            i -= 1
            self._ends[i] = end
        elif i < len(self._starts) and self._starts[i] == end:  # extends the interval after it
            self._starts[i] = off
        else:
            if len(self._starts) >= MAX_INTERVALS:
                raise ProtocolError(f"cut-through parts leave more than {MAX_INTERVALS} gaps open")
            self._starts.insert(i, off)
            self._ends.insert(i, end)
        if i + 1 < len(self._starts) and self._starts[i + 1] == end:  # meets the next one
            self._ends[i] = self._ends.pop(i + 1)
            self._starts.pop(i + 1)
        self.bytes += length

    @property
    def full(self) -> bool:
        """Every byte of the range arrived."""
        return self.bytes == self.n


__all__ = ["MAX_INTERVALS", "Coverage"]
