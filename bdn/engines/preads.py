"""Reading byte ranges of a snapshot file into memory a caller owns, with ``os.preadv``.

Standard library only: vLLM's worker (``bdn.engines.vllm_worker``) imports it inside vLLM's
own environment, and the transformers engine (``bdn.engines.weights``) uses the same loop.
"""

from __future__ import annotations

import os
from pathlib import Path

#: Bytes per ``preadv`` call (a large range is read in pieces of this size).
PREAD_PIECE = 64 << 20


class ShortFile(ValueError):
    """The file ended before a range did (one line naming the file and the byte counts)."""


def pread_spans(path: Path, offset: int, view: memoryview, spans: list[tuple[int, int]]) -> int:
    """``view[start:end]`` = ``path``'s bytes from ``offset + start`` for each ``(start, end)`` of
    ``spans`` (byte offsets into ``view``; one open file, ``os.preadv`` in pieces of
    :data:`PREAD_PIECE`); the rest of ``view`` is left as it is. Returns the bytes read.
    Raises :class:`ShortFile` when the file ends first, OSError when it cannot be read."""
    fd = os.open(path, os.O_RDONLY)
    total = 0
    try:
        for start, end in spans:
            done = start
            while done < end:
                got = os.preadv(fd, [view[done : min(end, done + PREAD_PIECE)]], offset + done)
                if got <= 0:
                    raise ShortFile(f"{path.name}: ends after {offset + done} bytes, the tensor needs {offset + end}")
                done += got
            total += end - start
    finally:
        os.close(fd)
    return total
