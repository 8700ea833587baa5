"""Reading and re-verifying a snapshot directory's ``READY`` marker on the serving host.

The marker's format and parser live in :mod:`bdn.proto.ready` (shared with the daemon, which
writes it); this module adds the file-system side: read it from a directory, re-hash the files.
"""

from __future__ import annotations

import os
from pathlib import Path

from bdn.fileops import first_mismatch
from bdn.proto.errors import ChecksumError, ProtocolError
from bdn.proto.ready import MAX_READY_BYTES, READY_FORMAT, READY_NAME, ReadyFile, ReadyMarker, parse_ready

__all__ = ["READY_FORMAT", "READY_NAME", "ReadyFile", "ReadyMarker", "parse_ready", "read_ready", "verify_files"]


def read_ready(directory: str | os.PathLike[str]) -> ReadyMarker:
    """Read and validate ``<directory>/READY``.

    Raises:
        ProtocolError: the directory does not exist, has no READY marker (so it is not a complete
            snapshot), or the marker is invalid.
    """
    d = Path(directory)
    if not d.is_dir():
        raise ProtocolError(f"{d} is not a directory")
    marker = d / READY_NAME
    try:
        with open(marker, "rb") as f:
            if not os.path.isfile(marker):
                raise ProtocolError(f"{marker} is not a regular file")
            data = f.read(MAX_READY_BYTES + 1)
    except FileNotFoundError:
        raise ProtocolError(f"{d} is not a ready bdn snapshot: no {READY_NAME} marker") from None
    except OSError as exc:
        raise ProtocolError(f"cannot read {marker}: {exc.strerror or exc}") from None
    if len(data) > MAX_READY_BYTES:
        raise ProtocolError(f"{marker} is larger than {MAX_READY_BYTES} bytes")
    return parse_ready(data, str(marker))


def verify_files(directory: str | os.PathLike[str], marker: ReadyMarker) -> None:
    """Re-hash every file ``marker`` lists under ``directory`` against its xxh3-128 chunk digests.

    Needs nothing but READY, so a file whose bytes are too broken to parse (a safetensors header)
    is still reported as the checksum failure it is. Reads each file once (``bdn.fileops``).

    Raises:
        ChecksumError: naming the file and the first bad chunk (index and byte range), or a file
            whose size differs from READY's.
        ProtocolError: a listed file is missing or unreadable.
    """
    d = Path(directory)
    chunk_size = marker.chunk_size
    for f in marker.files:
        full = d.joinpath(*f.path.split("/"))
        try:
            size = os.stat(full).st_size
            if size != f.size:
                raise ChecksumError(f"{d}: {f.path} has {size} bytes, READY says {f.size}")
            bad = first_mismatch(full, chunk_size, f.chunks)
        except OSError as exc:
            raise ProtocolError(f"{d}: cannot open {f.path}: {exc.strerror or exc}") from None
        if bad is not None:
            index, got = bad
            offset = index * chunk_size
            end = min(offset + chunk_size, size)
            raise ChecksumError(
                f"{d}: {f.path} chunk {index} (bytes {offset}-{end}) has xxh3-128 {got}, READY says {f.chunks[index]}"
            )
