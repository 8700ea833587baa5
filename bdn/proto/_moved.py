"""Names that left ``bdn/proto`` for :mod:`bdn.fileops` when ``bdn/proto`` became I/O-free.

Transitional: callers outside the plumbing layer (``bdn/daemon``, ``bench``, ``examples``) still
import the old names. Each old name resolves, on first use, to the same function in
``bdn.fileops`` with a DeprecationWarning naming the new home. Delete this module (and the three
``__getattr__`` lines that use it in arc.py, chunks.py and safetensors_fmt.py) once nothing
imports the old names; ``tests/test_proto_pure.py`` lists them.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any


def fileops_attr(name: str) -> Any:
    """``bdn.fileops.<name>``, imported on use (bdn.fileops imports bdn/proto, never the reverse)."""
    return getattr(importlib.import_module("bdn.fileops"), name)


def moved_to_fileops(module: str, *names: str) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` (PEP 562) serving ``names`` from ``bdn.fileops``.

    A name is ``"x"`` (same name there) or ``"old:new"`` (renamed on the way).
    """
    table = dict(n.split(":", 1) if ":" in n else (n, n) for n in names)

    def __getattr__(name: str) -> Any:
        if name not in table:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(f"{module}.{name} moved to bdn.fileops.{table[name]}", DeprecationWarning, stacklevel=2)
        return fileops_attr(table[name])

    return __getattr__
