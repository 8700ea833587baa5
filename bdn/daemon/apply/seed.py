"""A buffer made by copying a ready snapshot's file (DESIGN.md, "Sparse apply", seeds): the first
delta on a snapshot that no spare holds yet (an anchor, a snapshot loaded without its predecessor)
then applies sparsely too, instead of rebuilding the whole file.

:func:`copy_file` writes a verified READY file into a new spare with ``pwrite`` one chunk at a time
(the kernel fills the file's pages from the source's: on tmpfs a page written whole is never
zeroed first, as one first touched through a mapping is); :func:`verify_copy` then hashes every
chunk of the buffer (through its mapping) against READY's digest (XXH3-128) and sums each tensor's
Adler-32 over the same bytes: the buffer's content is verified exactly as a received chunk is, and
its tag can carry every tensor's Adler-32 (the sparse apply then reads no tensor to learn its base
checksum). Blocking (an apply thread); the copy, hash and Adler-32 release the GIL.

Rate: at most ``rate`` bytes a second while nobody waits for the buffer (the engine keeps serving
meanwhile), full speed once ``hurry`` is set (a delta waits for it), abandoned at the next chunk
when ``cancel`` is set (a snapshot came, ``Forward.settle``; set ``hurry`` too to end a wait
on the bound at once).
"""

from __future__ import annotations

import os
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

#: Longest single wait on the rate bound, s (the bound itself may ask for longer: waited in slices).
WAIT_SLICE_S = 3600.0


class Cancelled(Exception):
    """The copy was abandoned (``cancel`` set); the buffer holds partial bytes."""


def copy_file(
    src: Path,
    dst: Path,
    chunk_size: int,
    *,
    rate: float = 0.0,
    hurry: threading.Event | None = None,
    cancel: threading.Event | None = None,
) -> int:
    """Copy the file at ``src`` over the start of the existing file ``dst`` (a new spare of the
    same size), ``chunk_size`` bytes a ``pwrite``, at most ``rate`` bytes/s (0: unbounded) until
    ``hurry`` is set; returns the bytes copied.

    Raises:
        Cancelled: ``cancel`` was set.
        ProtocolError: ``dst`` is not ``src``'s size.
        OSError: a file cannot be read or written.
    """
    size = os.stat(src).st_size
    if os.stat(dst).st_size != size:
        raise ProtocolError(f"{src.name}: the buffer has {os.stat(dst).st_size} bytes, the file {size}")
    view = np.memmap(src, dtype=np.uint8, mode="r") if size else np.zeros(0, dtype=np.uint8)
    fd = os.open(dst, os.O_WRONLY | os.O_CLOEXEC)
    try:
        t0 = time.monotonic()
        for off in range(0, size, chunk_size):
            if cancel is not None and cancel.is_set():
                raise Cancelled(f"{src.name}: copy abandoned at byte {off}")
            end = min(off + chunk_size, size)
            piece = memoryview(view[off:end])  # type: ignore[arg-type]
            done = 0
            while done < len(piece):
                done += os.pwrite(fd, piece[done:], off + done)
            # (waits in slices of at most WAIT_SLICE_S: a rate of a few bits a day, which the
            # config allows, would ask for a wait past what the platform's clock can hold)
            while rate > 0 and not (hurry is not None and hurry.is_set()):
                ahead = end / rate - (time.monotonic() - t0)
                if ahead <= 0:
                    break
                if hurry is not None:
                    hurry.wait(min(ahead, WAIT_SLICE_S))
                else:
                    time.sleep(min(ahead, WAIT_SLICE_S))
    finally:
        os.close(fd)
    return size


def verify_copy(buf: Any, chunk_size: int, digests: Sequence[str], header: Header, name: str) -> dict[str, int]:
    """Check every chunk of ``buf`` (a copied file's bytes: its mapping) against ``digests[i]``
    (READY's list, ``chunk_size`` bytes a chunk); returns each tensor of ``header`` (the file's
    parsed safetensors header) by name -> the Adler-32 of its bytes in ``buf``. ``name`` labels
    errors.

    Raises:
        ProtocolError: sizes differ, or a chunk's digest is not READY's (the message names the
            chunk).
    """
    out = np.frombuffer(buf, dtype=np.uint8)
    size = len(out)
    if header.file_size != size:
        raise ProtocolError(f"{name}: the buffer has {size} bytes, the file {header.file_size}")
    n = (size + chunk_size - 1) // chunk_size
    if n != len(digests):
        raise ProtocolError(f"{name}: {n} chunks, READY lists {len(digests)}")
    tensors = sorted(header.tensors.values(), key=lambda t: t.start)
    adlers = {t.name: 1 for t in tensors}
    ti = 0
    for i in range(n):
        off, end = i * chunk_size, min((i + 1) * chunk_size, size)
        if digest(out[off:end]) != digests[i]:  # type: ignore[arg-type]  # numpy's stubs give ndarray __buffer__ only from 3.12
            raise ProtocolError(f"{name}: chunk {i} copied does not match READY's digest")
        while ti < len(tensors) and tensors[ti].end <= off:
            ti += 1
        for t in tensors[ti:]:
            if t.start >= end:
                break
            a, b = max(t.start, off), min(t.end, end)
            if b > a:
                adlers[t.name] = raw_adler32(out[a:b], adlers[t.name])
    return adlers
