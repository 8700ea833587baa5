"""The check every foreign snapshot passes before READY (docs/TRUST.md, "Before READY").

:func:`check_ready` is called on the staged directory, after every stored object was verified
(:func:`bdn.foreign.checksum.verify_object`, repaired where needed) and, for a delta, after the
diffs were applied (which checks each rebuilt tensor's Adler-32). It refuses the snapshot, with one
line naming the file, unless:

* every stored object (every file of a full snapshot; every diff file and copied file of a
  delta) has an ``ok`` verdict for the version token in the table, or an ``unverifiable`` one
  and the caller's policy accepts those (``allow_unverifiable``: the bucket keeps no checksum,
  ``file://``);
* every file of the table is in the directory, a regular file of the table's result size;
* every ``*.safetensors`` file's header passes bdn's parser (the format's rules, the safetensors
  library's 100,000,000-byte header limit, the file covered exactly) and then the safetensors
  library's own ``safe_open`` (what the engine will run: a dtype it does not know, or any rule a
  newer library adds, fails here rather than in the engine).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path

from safetensors import safe_open

from bdn.foreign.checksum import OK, UNVERIFIABLE, Verdict
from bdn.proto.foreign import MAX_HEADER_BYTES, ForeignSnapshotError, ForeignTable, header_span
from bdn.proto.safetensors_fmt import SafetensorsError, parse_header


def check_header(path: str | os.PathLike[str]) -> None:
    """Validate the safetensors header of the file at ``path`` (reads 8 + N bytes).

    Raises ForeignSnapshotError naming the file (bad header, N over 100,000,000, not covering
    the file), OSError when it cannot be read.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        first = f.read(8)
        try:
            need = header_span(first, size)
        except ForeignSnapshotError as e:
            raise ForeignSnapshotError(f"{os.fspath(path)}: {e}") from None
        head = first + f.read(min(need, 8 + MAX_HEADER_BYTES) - 8)
    try:
        parse_header(head, size)
    except SafetensorsError as e:
        raise ForeignSnapshotError(f"{os.fspath(path)}: {e}") from None
    try:
        with safe_open(os.fspath(path), framework="numpy"):
            pass  # opening parses and checks the header only; no tensor is read
    except Exception as e:  # the library raises its own SafetensorError, or OSError
        raise ForeignSnapshotError(
            f"{os.fspath(path)}: the safetensors library refuses it: {' '.join(str(e).split())[:200]}"
        ) from None


def check_ready(
    table: ForeignTable,
    directory: str | os.PathLike[str],
    verdicts: Mapping[str, Verdict],
    *,
    allow_unverifiable: bool = False,
) -> None:
    """Refuse (ForeignSnapshotError, one line naming the file) a staged foreign snapshot that is
    not fit for READY; return None when it is.

    ``directory``: the staged snapshot (the rebuilt files, by table path). ``verdicts``: per
    stored object path, the verdict of its assembled bytes, for the object's version token.
    """
    root = Path(directory)
    for obj in table.objects:
        v = verdicts.get(obj.path)
        if v is None or v.key != obj.key:
            raise ForeignSnapshotError(f"{obj.key} was not verified against the bucket")
        if v.status == UNVERIFIABLE and not allow_unverifiable:
            raise ForeignSnapshotError(f"{obj.key}: {v.reason}, and unverifiable objects are not accepted")
        if v.status not in (OK, UNVERIFIABLE):
            raise ForeignSnapshotError(v.reason or f"{obj.key} failed verification")
    for entry in table.manifest.files:
        path = root / entry.path
        try:
            st = os.lstat(path)
        except OSError:
            raise ForeignSnapshotError(f"{entry.path} is missing from the staged snapshot") from None
        if not stat.S_ISREG(st.st_mode):
            raise ForeignSnapshotError(f"{entry.path} in the staged snapshot is not a regular file")
        if st.st_size != entry.result_size:
            raise ForeignSnapshotError(
                f"{entry.path} is {st.st_size} bytes in the staged snapshot, the table says {entry.result_size}"
            )
        if entry.path.endswith(".safetensors"):
            check_header(path)
