"""The files of a checkpoint directory, as a snapshot will list them.

Source: DESIGN.md ("Bucket layout"): a snapshot's file paths are relative, ``/``-separated,
with no ``..``. Every regular file under the directory is published (nothing is skipped
silently); a symlink is followed only if it stays inside the directory, and anything that is
neither a regular file nor a directory (fifo, socket, device) is refused.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from bdn.proto.errors import PathError
from bdn.proto.identity import validate_relpath
from bdn.proto.manifest import MANIFEST_NAME
from bdn.proto.reserved import reserved_path


@dataclass(frozen=True)
class LocalFile:
    """One file to publish: its snapshot path (``/``-separated), where it is on disk, its size."""

    path: str
    local: Path
    size: int


def scan_dir(root: str | os.PathLike[str]) -> list[LocalFile]:
    """Every regular file under ``root``, sorted by snapshot path.

    Raises:
        PathError: ``root`` is not a directory, it holds no file, a symlink leads outside it,
            an entry is not a regular file or directory, a name is not valid UTF-8, or a path
            breaks the snapshot path rule (or is ``bdn.manifest.json``, which bdn writes itself).
    """
    top = Path(root)
    if not top.is_dir():
        raise PathError(f"{str(top)!r} is not a directory")
    real_top = top.resolve()
    out: list[LocalFile] = []
    # Symlinked directories are walked too, so guard against loops by real path.
    seen_dirs: set[Path] = {real_top}
    stack: list[tuple[Path, str]] = [(top, "")]
    while stack:
        here, prefix = stack.pop()
        try:
            entries = sorted(os.scandir(here), key=lambda e: e.name)
        except OSError as e:
            raise PathError(f"cannot list {str(here)!r}: {e.strerror or e}") from None
        for entry in entries:
            rel = f"{prefix}{entry.name}"
            try:
                rel.encode("utf-8")
            except UnicodeEncodeError:
                raise PathError(f"file name {rel.encode('utf-8', 'surrogateescape')!r} is not UTF-8") from None
            local = Path(entry.path)
            if entry.is_symlink():
                real = local.resolve()
                if real != real_top and real_top not in real.parents:
                    raise PathError(f"{rel!r} is a symlink to {str(real)!r}, outside {str(real_top)!r}")
            try:
                st = local.stat()  # follows an (inside) symlink
            except OSError as e:
                raise PathError(f"cannot stat {rel!r}: {e.strerror or e}") from None
            if stat.S_ISDIR(st.st_mode):
                real = local.resolve()
                if real in seen_dirs:
                    raise PathError(f"{rel!r} leads back to a directory already published (symlink loop)")
                seen_dirs.add(real)
                stack.append((local, rel + "/"))
            elif stat.S_ISREG(st.st_mode):
                validate_relpath(rel)
                if rel == MANIFEST_NAME:
                    raise PathError(f"{rel!r} is written by bdn itself; remove it from the directory")
                if reserved_path(rel):
                    raise PathError(reserved_path(rel))
                out.append(LocalFile(rel, local, st.st_size))
            else:
                raise PathError(f"{rel!r} is not a regular file or directory")
    if not out:
        raise PathError(f"{str(top)!r} holds no files to publish")
    out.sort(key=lambda f: f.path)
    return out
