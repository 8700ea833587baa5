"""The per hot-load engine options of a hot-load request (docs/ENGINES.md, "Per hot-load options").

A hot-load request may carry, at its top level, the options every engine of the fleet applies to
that swap, named as the hosted RL hot-load APIs name them::

    {"identity": "step000002", "incremental_snapshot_metadata": {...},
     "prompt_cache_policy": "RESET_ALL" | "PRESERVE",     # default RESET_ALL (case-insensitive)
     "inflight_policy": "wait" | "keep" | "abort",        # default wait (case-insensitive)
     "inflight_wait_s": 30}                                # seconds in [0, 3600], the bound of wait

They travel with the fleet's target (``Target.options``) to every replica and reach each engine in
its offer. Pure: no I/O, no clock.
"""

from __future__ import annotations

from typing import Any

from bdn.daemon.errors import Invalid
from bdn.engines.options import HotLoadOptions
from bdn.proto.errors import ProtocolError

OPTION_FIELDS = ("prompt_cache_policy", "inflight_policy", "inflight_wait_s")
DEFAULT_OPTIONS = HotLoadOptions()

__all__ = ["DEFAULT_OPTIONS", "OPTION_FIELDS", "HotLoadOptions", "options_from_wire", "parse_options"]


def parse_options(obj: dict[str, Any]) -> HotLoadOptions:
    """The options of a hot-load request object (absent fields take the defaults).

    Raises:
        Invalid: a field of the wrong type or value (one line naming the field and what it accepts).
    """
    try:
        return HotLoadOptions.from_offer({k: obj[k] for k in OPTION_FIELDS if k in obj})
    except ProtocolError as e:
        raise Invalid(str(e).replace("offer field ", "")) from None


def options_from_wire(obj: Any) -> HotLoadOptions | None:
    """The options a peer's target carries (untrusted); defaults when absent, None when malformed."""
    if obj is None:
        return DEFAULT_OPTIONS
    if not isinstance(obj, dict):
        return None
    try:
        return HotLoadOptions.from_offer({k: obj[k] for k in OPTION_FIELDS if k in obj})
    except ProtocolError:
        return None
