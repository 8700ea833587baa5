"""msgpack encoding for the daemon's messages (have tables, hot-load targets, replica rows,
progress files) without a 256 KiB allocation per message.

``msgpack.packb(obj)`` builds a new ``Packer`` per call, and a ``Packer`` allocates its whole
``buf_size`` up front (256 KiB by default, msgpack 1.x). A daemon packs a few messages a second,
each of a few hundred bytes, so that was a 256 KiB block allocated and freed a few times a second
(perf on a daemon under an hour of hot-loads: 982 of the 1,004 ``malloc`` calls of 128 KiB or more in 4 minutes).
Blocks that size are where glibc's heap fragments: past the first free of one, glibc raises its
mmap threshold above it (mallopt(3), the dynamic threshold) and later ones are carved from the
heap between small long-lived objects (docs/decisions/0025-flat-rss.md). Here the
buffer starts at :data:`BUF_SIZE` bytes and grows only for a message that needs it.
"""

from __future__ import annotations

from typing import Any

import msgpack

#: The packer's first buffer, bytes (msgpack doubles it while a message needs more).
BUF_SIZE = 4096


def packb(obj: Any) -> bytes:
    """``obj`` as msgpack (bin type for ``bytes``, str8 for ``str``: the same bytes as
    ``msgpack.packb(obj, use_bin_type=True)``). Raises what ``msgpack.packb`` raises (TypeError
    for an object msgpack cannot encode, ValueError for one too large)."""
    return msgpack.Packer(use_bin_type=True, buf_size=BUF_SIZE).pack(obj)  # type: ignore[call-arg]  # msgpack-types has the pure-Python Packer's arguments; the C Packer takes buf_size
