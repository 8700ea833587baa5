"""What ``bdnctl`` and ``bdn-publish`` print in common: the version line and byte counts.

One unit rule for both commands: JSON carries plain byte counts; human output
and progress bars use SI decimal units, ``kB`` = 10^3, ``MB`` = 10^6, ``GB`` = 10^9 bytes (the
label always matches the divisor).
"""

from __future__ import annotations

import json
from typing import Any

from bdn import __version__

#: ``--version`` prints this line.
VERSION = f"bdn {__version__}"
#: tqdm arguments for a progress bar of bytes: SI prefixes on 1000, so "MB" means 10^6 bytes.
BYTES_BAR: dict[str, Any] = {"unit": "B", "unit_scale": True, "unit_divisor": 1000}
_UNITS = ("B", "kB", "MB", "GB", "TB", "PB")


def human_bytes(n: Any) -> str:
    """``n`` bytes in SI units: ``"999 B"``, ``"1.5 kB"``, ``"12.3 MB"``; other values as ``str``."""
    if not isinstance(n, int | float) or isinstance(n, bool):
        return str(n)
    value = float(n)
    for unit in _UNITS:
        if abs(value) < 1000 or unit == _UNITS[-1]:
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


def emit_json(obj: Any) -> None:
    """Print one JSON document on stdout (sorted keys, indented)."""
    print(json.dumps(obj, indent=2, sort_keys=True))
