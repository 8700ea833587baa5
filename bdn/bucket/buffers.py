"""A read-only, seekable file over a sequence of buffers, for uploads from memory (no join)."""

from __future__ import annotations

import bisect
import io
import os
from collections.abc import Sequence
from typing import Any


class BuffersReader(io.RawIOBase):
    """The concatenation of ``buffers`` (bytes-like objects) as a binary file: ``read``,
    ``readinto``, ``seek``, ``tell``. Each read copies only the bytes it returns."""

    def __init__(self, buffers: Sequence[Any]) -> None:
        super().__init__()
        self._views = [memoryview(b).cast("B") for b in buffers]
        self._views = [v for v in self._views if len(v)]
        self._starts: list[int] = []
        pos = 0
        for v in self._views:
            self._starts.append(pos)
            pos += len(v)
        self.size = pos
        self._pos = 0

    def readable(self) -> bool:
        """Always True."""
        return True

    def seekable(self) -> bool:
        """Always True (s3transfer seeks back to retry a part)."""
        return True

    def tell(self) -> int:
        """The current position, in bytes from the start."""
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        """Move to ``offset`` from the start, the current position or the end; the new position."""
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, out: Any) -> int:
        """Copy up to ``len(out)`` bytes from the position into ``out``; how many (0 at the end)."""
        dst = memoryview(out).cast("B")
        done = 0
        i = bisect.bisect_right(self._starts, self._pos) - 1
        while done < len(dst) and 0 <= i < len(self._views) and self._pos < self.size:
            v, start = self._views[i], self._starts[i]
            off = self._pos - start
            n = min(len(v) - off, len(dst) - done)
            dst[done : done + n] = v[off : off + n]
            done += n
            self._pos += n
            i += 1
        return done
