"""Snapshot identities and the file paths inside a snapshot (DESIGN.md, "Bucket layout").

An identity is one path segment ``[A-Za-z0-9][A-Za-z0-9._-]{0,127}``; ``STARTUP_SNAPSHOT``,
``latest``, ``current`` (the store's link to the served snapshot), ``.`` and ``..`` are reserved. A file path is relative, ``/``-separated, with no
``..`` or ``.`` segment, no empty segment, no leading ``/``, no backslash, no NUL, valid UTF-8
and at most 1024 bytes.
"""

from __future__ import annotations

import re

from bdn.proto.errors import IdentityError, PathError

IDENTITY_RULE = "[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
_IDENTITY_RE = re.compile(rf"\A{IDENTITY_RULE}\Z")
RESERVED_IDENTITIES = frozenset({"STARTUP_SNAPSHOT", "latest", "current", ".", ".."})
MAX_PATH_BYTES = 1024


def validate_identity(identity: object) -> str:
    """Return ``identity`` if it is a valid snapshot identity.

    Raises:
        IdentityError: naming the rule that was broken (one line, safe to send to a client).
    """
    if not isinstance(identity, str):
        raise IdentityError(f"identity must be a string, got {type(identity).__name__}")
    if identity in RESERVED_IDENTITIES:
        raise IdentityError(f"identity {identity!r} is reserved")
    if "/" in identity or "\\" in identity:
        raise IdentityError(f"identity {identity[:140]!r} must be one path segment (no '/')")
    if not _IDENTITY_RE.match(identity):
        raise IdentityError(f"identity {identity[:140]!r} does not match {IDENTITY_RULE}")
    return identity


def validate_relpath(path: object) -> str:
    """Return ``path`` if it is a safe relative file path inside a snapshot.

    Raises:
        PathError: naming the rule that was broken.
    """
    if not isinstance(path, str):
        raise PathError(f"file path must be a string, got {type(path).__name__}")
    shown = path[:200]
    if not path:
        raise PathError("file path is empty")
    try:
        # JSON may carry lone surrogates ("\ud800"): no file system or bucket key can hold them.
        encoded = path.encode("utf-8")
    except UnicodeEncodeError:
        raise PathError(f"file path {shown!r} is not valid UTF-8 (lone surrogate)") from None
    if len(encoded) > MAX_PATH_BYTES:
        raise PathError(f"file path {shown!r} is longer than {MAX_PATH_BYTES} bytes")
    if "\x00" in path:
        raise PathError(f"file path {shown!r} contains NUL")
    if "\\" in path:
        raise PathError(f"file path {shown!r} contains a backslash")
    if path.startswith("/"):
        raise PathError(f"file path {shown!r} is absolute")
    for part in path.split("/"):
        if part in ("", ".", ".."):
            raise PathError(f"file path {shown!r} has a {part or 'empty'!r} segment")
    return path
