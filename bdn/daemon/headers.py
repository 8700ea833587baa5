"""The last check before READY: every ``*.safetensors`` file of a rebuilt snapshot must open in
the safetensors library, the reader every engine uses, and in bdn's own header parser, the one
the daemon serves tensors with (DESIGN.md, "Apply and verify").

The chunk digests prove the bytes are the trainer's; they do not prove the trainer wrote a file
an engine can load. A header with overlapping or gapped tensors, an unknown dtype, JSON the
library refuses or a header over its 100,000,000-byte limit would otherwise reach ``ready`` and
fail in the engine later. The rule is the library's own (``safetensors.safe_open``, which reads
and validates the header against the file's size without reading the tensors), so bdn accepts
exactly the files the installed library accepts. bdn's parser
(``bdn.proto.safetensors_fmt.parse_header``: no duplicate key, exactly ``dtype``/``shape``/
``data_offsets`` per tensor, the header starting with ``{``) is stricter than the library in a few
rules; a file that passed only the library would reach READY and then fail ``GET .../tensors``, so
both run here, and a file READY lets through is one the serving side reads.
"""

from __future__ import annotations

from pathlib import Path

from safetensors import SafetensorError, safe_open

from bdn.fileops import read_header
from bdn.proto.errors import ProtocolError
from bdn.proto.manifest import Manifest
from bdn.proto.safetensors_fmt import SafetensorsError

SUFFIX = ".safetensors"
_REASON_CHARS = 300


class HeaderRefused(ProtocolError):
    """A safetensors file of a snapshot does not open in the safetensors library (names the file)."""


def check_file(path: Path, name: str) -> None:
    """Parse ``path``'s header as bdn serves it, then open it as the safetensors library does
    (header only, both).

    Raises:
        HeaderRefused: "<name>: bdn refuses its header: <reason, naming the key>" or "<name>: the
            safetensors library refuses its header: <its reason>".
    """
    try:
        read_header(path)
    except SafetensorsError as e:
        raise HeaderRefused(f"{name}: bdn refuses its header: {str(e)[:_REASON_CHARS]}") from None
    except OSError as e:
        raise HeaderRefused(f"{name}: cannot read its header: {e.strerror or e}") from None
    try:
        with safe_open(str(path), framework="numpy"):
            pass
    except (SafetensorError, OSError, ValueError) as e:
        why = " ".join(str(e).split()) or type(e).__name__
        raise HeaderRefused(f"{name}: the safetensors library refuses its header: {why[:_REASON_CHARS]}") from None


def check_snapshot(m: Manifest, directory: Path) -> int:
    """Check every ``*.safetensors`` file of ``m`` as rebuilt under ``directory``; the number checked.

    Blocking (reads each header, up to 100 MB of JSON): run it on a disk thread. Raises
    HeaderRefused for the first file refused, in manifest order.
    """
    n = 0
    for f in m.files:
        if f.path.endswith(SUFFIX):
            check_file(directory / f.path, f.path)
            n += 1
    return n
