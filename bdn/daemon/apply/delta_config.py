"""The ``config.json`` check of a delta before it is applied (the rule:
:func:`bdn.daemon.replica.contract.config_mismatch`; Fireworks reports the same failure as
"Config value mismatch for <field>")."""

from __future__ import annotations

import os
from pathlib import Path

from bdn.daemon.errors import Conflict
from bdn.daemon.replica.contract import MAX_CONFIG_BYTES, config_mismatch, parse_config

CONFIG_NAME = "config.json"


def _read(path: Path) -> bytes | None:
    # At most one byte over the limit (parse_config refuses that), but never a buffer of the
    # limit for a file of a few hundred bytes: ``f.read(n)`` allocates ``n`` bytes first, and a
    # 1 MiB block allocated and freed twice per delta fragments glibc's heap
    # (docs/decisions/0025-flat-rss.md).
    try:
        with open(path, "rb") as f:
            return f.read(min(os.fstat(f.fileno()).st_size, MAX_CONFIG_BYTES) + 1)
    except FileNotFoundError:
        return None


def check_delta_config(identity: str, base_identity: str, base_dir: Path, target_dir: Path) -> None:
    """Refuse delta ``identity`` whose ``config.json`` (in ``target_dir``) changes an architecture
    field of its base's (in ``base_dir``). Nothing to compare when either has none. Blocking
    (reads two small files). Raises Conflict: ``"step000002: Config value mismatch for
    hidden_size: base 2048, target 4096 (base step000001)"``, or naming a file that is no JSON."""
    b, t = _read(base_dir / CONFIG_NAME), _read(target_dir / CONFIG_NAME)
    if b is None or t is None:
        return
    bad = config_mismatch(
        parse_config(b, f"{base_identity}/{CONFIG_NAME}"), parse_config(t, f"{identity}/{CONFIG_NAME}")
    )
    if bad is not None:
        raise Conflict(f"{identity}: {bad} (base {base_identity})")
