"""The names bdn itself writes inside a rebuilt snapshot directory, which no snapshot may use.

Source: DESIGN.md ("The store"). Only the ``READY`` marker is written inside a snapshot directory
(its temporary file and the progress files live outside it). A snapshot with a file or a
directory under one of these names at its top level is refused at publish (``bdn-publish``) and
at load (``Manifest.from_json``), rather than have the trainer's file replaced by bdn's.
"""

from __future__ import annotations

READY_NAME = "READY"
RESERVED_NAMES: tuple[str, ...] = (READY_NAME,)


def reserved_path(path: str) -> str:
    """ "" if a snapshot may hold ``path`` (a valid relative path), else why not (one line).

    A path whose first segment is one of ``RESERVED_NAMES`` (``READY``, or ``READY/x``: a
    directory there would block the marker) is reserved for bdn's own files.
    """
    first = path.split("/", 1)[0]
    if first in RESERVED_NAMES:
        return (
            f"{path!r} is reserved: bdn writes its {first} marker at the top of every rebuilt "
            "snapshot directory; rename that file in the checkpoint"
        )
    return ""
