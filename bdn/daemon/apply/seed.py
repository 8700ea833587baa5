"""A buffer made by copying a ready snapshot's file (DESIGN.md, "Sparse apply", seeds): the first
delta on a snapshot that no spare holds yet (an anchor, a snapshot loaded without its predecessor)
then applies sparsely too, instead of rebuilding the whole file.

:func:`copy_verified` copies a verified READY file into a spare's mapping one chunk at a time and,
in the same pass, hashes every copied chunk against READY's digest (XXH3-128) and sums each
tensor's Adler-32 over the copied bytes: the buffer's content is verified exactly as a received
chunk is, and its tag can carry every tensor's Adler-32 (the sparse apply then reads no tensor to
learn its base checksum). Blocking (an apply thread); the copy, hash and Adler-32 release the GIL.

Rate: at most ``rate`` bytes a second while nobody waits for the buffer (the engine keeps serving
meanwhile), full speed once ``hurry`` is set (a delta waits for it), abandoned at the next chunk
when ``cancel`` is set (a delta that does not start from it came; set ``hurry`` too to end a wait
on the bound at once).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bdn.proto.chunks import digest
from bdn.proto.delta_tasks import raw_adler32
from bdn.proto.errors import ProtocolError
from bdn.proto.safetensors_fmt import Header


class Cancelled(Exception):
    """The copy was abandoned (``cancel`` set); the buffer holds partial bytes."""


def copy_verified(
    src: Path,
    dst: Any,
    chunk_size: int,
    digests: Sequence[str],
    header: Header,
    *,
    rate: float = 0.0,
    hurry: threading.Event | None = None,
    cancel: threading.Event | None = None,
) -> dict[str, int]:
    """Copy the file at ``src`` into ``dst`` (a writable buffer of exactly its size: a spare's
    mapping) chunk by chunk, checking each copied chunk's XXH3-128 against ``digests[i]`` (READY's
    list for the file, ``chunk_size`` bytes a chunk); returns each tensor of ``header`` (the file's
    parsed safetensors header) by name -> the Adler-32 of its bytes as copied. ``rate`` bytes/s
    (0: unbounded) until ``hurry`` is set.

    Raises:
        ProtocolError: sizes differ, or a copied chunk's digest is not READY's (the message names
            the chunk); ``dst`` then holds partial bytes.
        Cancelled: ``cancel`` was set.
        OSError: ``src`` cannot be read.
    """
    out = np.frombuffer(dst, dtype=np.uint8)
    view = np.memmap(src, dtype=np.uint8, mode="r")
    size = len(view)
    if len(out) != size or header.file_size != size:
        raise ProtocolError(f"{src.name}: the buffer has {len(out)} bytes, the file {size}")
    n = (size + chunk_size - 1) // chunk_size
    if n != len(digests):
        raise ProtocolError(f"{src.name}: {n} chunks, READY lists {len(digests)}")
    tensors = sorted(header.tensors.values(), key=lambda t: t.start)
    adlers = {t.name: 1 for t in tensors}
    t0, ti = time.monotonic(), 0
    for i in range(n):
        if cancel is not None and cancel.is_set():
            raise Cancelled(f"{src.name}: copy abandoned at chunk {i}")
        off, end = i * chunk_size, min((i + 1) * chunk_size, size)
        np.copyto(out[off:end], view[off:end])
        piece = out[off:end]
        if digest(piece) != digests[i]:  # type: ignore[arg-type]  # numpy's stubs give ndarray __buffer__ only from 3.12
            raise ProtocolError(f"{src.name}: chunk {i} copied does not match READY's digest")
        while ti < len(tensors) and tensors[ti].end <= off:
            ti += 1
        for t in tensors[ti:]:
            if t.start >= end:
                break
            a, b = max(t.start, off), min(t.end, end)
            if b > a:
                adlers[t.name] = raw_adler32(out[a:b], adlers[t.name])
        if rate > 0 and not (hurry is not None and hurry.is_set()):
            ahead = end / rate - (time.monotonic() - t0)
            if ahead > 0 and hurry is not None:
                hurry.wait(ahead)
            elif ahead > 0:
                time.sleep(ahead)
    return adlers
