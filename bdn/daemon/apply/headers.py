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

A header of ``CHILD_BYTES`` or more is checked in a child process (``python -m
bdn.daemon.apply.headers PATH NAME``): parsing 100 MB of JSON takes the CPU for seconds and, on a worker
thread, holds the daemon's GIL against its event loop for most of them (a 98 MB header kept a
snapshot ``verifying`` for minutes on a loaded machine, the loop seconds late).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from safetensors import SafetensorError, safe_open

from bdn.fileops import read_header
from bdn.proto.errors import ProtocolError
from bdn.proto.manifest import Manifest
from bdn.proto.safetensors_fmt import SafetensorsError, header_length

SUFFIX = ".safetensors"
_REASON_CHARS = 300
#: Headers this long (bytes) or longer are checked in a child process.
CHILD_BYTES = 4 << 20
#: Seconds a child's check may take (100 MB of JSON on a loaded machine) before the file is refused.
CHILD_TIMEOUT_S = 900.0


class HeaderRefused(ProtocolError):
    """A safetensors file of a snapshot does not open in the safetensors library (names the file)."""


def check_file(path: Path, name: str) -> None:
    """Open ``path`` as the safetensors library does, then parse its header as bdn serves it
    (header only, both).

    Raises:
        HeaderRefused: "<name>: the safetensors library refuses its header: <its reason>" or
            "<name>: bdn refuses its header: <reason, naming the key>" (a file the library opens).
    """
    try:
        with open(path, "rb") as fh:
            big = header_length(fh.read(8)) >= CHILD_BYTES
    except (SafetensorsError, OSError):
        big = False  # refused below, in this process, with the reason
    if big:
        _check_in_child(path, name)
        return
    _check_here(path, name)


def _check_in_child(path: Path, name: str) -> None:
    """``_check_here`` in a child interpreter; its one-line refusal raised here as HeaderRefused."""
    try:
        r = subprocess.run(
            [sys.executable, "-m", "bdn.daemon.apply.headers", os.fspath(path), name],
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT_S,
            check=False,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
    except subprocess.TimeoutExpired:
        raise HeaderRefused(f"{name}: its header check did not finish within {CHILD_TIMEOUT_S:g} s") from None
    if r.returncode != 0:
        lines = r.stderr.strip().splitlines()
        raise HeaderRefused(lines[-1] if lines else f"{name}: its header check exited {r.returncode}")


def _check_here(path: Path, name: str) -> None:
    # the library first: a file it refuses is named with its reason, as engines would see it;
    # then bdn's parser, stricter in a few rules
    try:
        with safe_open(str(path), framework="numpy"):
            pass
    except (SafetensorError, OSError, ValueError) as e:
        why = " ".join(str(e).split()) or type(e).__name__
        raise HeaderRefused(f"{name}: the safetensors library refuses its header: {why[:_REASON_CHARS]}") from None
    try:
        read_header(path)
    except SafetensorsError as e:
        raise HeaderRefused(f"{name}: bdn refuses its header: {str(e)[:_REASON_CHARS]}") from None
    except OSError as e:
        raise HeaderRefused(f"{name}: cannot read its header: {e.strerror or e}") from None


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


if __name__ == "__main__":  # the child of _check_in_child: exit 0, or 1 with the refusal on stderr
    try:
        _check_here(Path(sys.argv[1]), sys.argv[2])
    except HeaderRefused as e:
        print(str(e), file=sys.stderr)
        sys.exit(1)
