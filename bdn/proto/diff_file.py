"""Diff files, the container of every delta format: a safetensors file whose tensors are 1-D ``U8``
streams, one per tensor of the shard it patches, and whose ``__metadata__`` maps every tensor name
to the decimal Adler-32 of the target tensor (format: :mod:`bdn.proto.arc`'s docstring).

Parsing and validating that container; the streams inside are the codecs' business
(:mod:`bdn.proto.arc`, :mod:`bdn.proto.planes`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from bdn.proto.errors import ProtocolError
from bdn.proto.safetensors_fmt import Header, _q, parse_header

_DECIMAL_U32 = re.compile(r"0|[1-9][0-9]{0,9}")


@dataclass(frozen=True)
class DiffTensor:
    """One tensor's stream in a diff file: absolute byte offsets ``[frame_start, frame_end)``."""

    name: str
    frame_start: int
    frame_end: int
    target_adler32: int


def diff_tensors(header: Header) -> dict[str, DiffTensor]:
    """Check that a parsed safetensors header is a valid diff file; return its streams by name.

    Every tensor must be 1-D ``U8``; ``__metadata__`` must hold, for every tensor, the canonical
    decimal of an unsigned 32-bit Adler-32. Other metadata keys are ignored. Raises ProtocolError.
    """
    out: dict[str, DiffTensor] = {}
    for name, info in header.tensors.items():
        if info.dtype != "U8" or len(info.shape) != 1:
            raise ProtocolError(f"diff tensor {_q(name)} is {info.dtype} {list(info.shape)}, expected a 1-D U8 stream")
        value = header.metadata.get(name)
        if value is None:
            raise ProtocolError(f"diff file has no adler32 in __metadata__ for tensor {_q(name)}")
        if not _DECIMAL_U32.fullmatch(value) or int(value) >= 1 << 32:
            raise ProtocolError(f"diff __metadata__ for tensor {_q(name)} is not an adler32 decimal: {_q(value)}")
        out[name] = DiffTensor(name, info.start, info.end, int(value))
    return out


def read_diff_header(buf: Any, file_size: int) -> tuple[Header, dict[str, DiffTensor]]:
    """Parse and validate a diff file's header (``buf`` holds at least its first 8 + N bytes).

    Raises SafetensorsError / ProtocolError (one line, naming the tensor).
    """
    header = parse_header(buf, file_size)
    return header, diff_tensors(header)


DiffHeaderLike = Header | tuple[Header, Mapping[str, DiffTensor]]


def streams_of(diff_header: DiffHeaderLike) -> Mapping[str, DiffTensor]:
    """The per-tensor streams of a diff header (a parsed ``Header`` or ``read_diff_header``'s pair)."""
    if isinstance(diff_header, Header):
        return diff_tensors(diff_header)
    return diff_header[1]


def check_names(base_header: Header, streams: Mapping[str, DiffTensor]) -> None:
    """Raise ProtocolError unless ``streams`` has exactly the tensor names of ``base_header``
    (one line naming the first missing or extra tensor)."""
    for name in base_header.tensors:
        if name not in streams:
            raise ProtocolError(f"diff file has no stream for tensor {_q(name)} of the base")
    for name in streams:
        if name not in base_header.tensors:
            raise ProtocolError(f"diff file has a stream for tensor {_q(name)}, which the base lacks")


def target_size(base_header: Header, diff_header: DiffHeaderLike) -> int:
    """Size in bytes of the reconstructed file: the base file's size (same header, same layout).

    Raises ProtocolError when the diff's tensor names are not the base's.
    """
    check_names(base_header, streams_of(diff_header))
    return base_header.file_size


#: A diff file's content, as ``bdn.fileops.save_raw`` writes it: ``({name: ("U8", (len,),
#: stream)}, {name: decimal Adler-32 of the target tensor})``.
DiffContent = tuple[dict[str, tuple[str, tuple[int, ...], bytes]], dict[str, str]]


def content(frames: dict[str, bytes], checksums: dict[str, str]) -> DiffContent:
    """A diff file's content for ``bdn.fileops.save_raw``: one ``U8`` tensor per stream, and the checksums."""
    return {name: ("U8", (len(f),), f) for name, f in frames.items()}, checksums
