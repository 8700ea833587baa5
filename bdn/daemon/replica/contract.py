"""The hosted hot-load contract's rules, as pure functions (README "Hot-load API",
docs/OPERATIONS.md "Concurrency of hot-loads").

The hosted services (Fireworks, CoreWeave, the hosted RL service) name things their way; these
rules make bdn answer as they do:

- :func:`checksum_format`: ``alder32`` (as the APIs spell it) and ``adler32`` are one format;
- :func:`request_key`: two POSTs with equal keys are the same hot-load (a re-POST is answered
  200 with the first one's request id, not 409);
- :func:`check_previous`: ``previous_snapshot_identity`` names what this replica serves, or the
  target it is loading (a trainer that posts the next delta before the fleet finished the last);
- :func:`chain_length`: deltas between a snapshot and its anchor, capped by ``max_delta_chain``
  (ModelExpress' default 64; CoreWeave allows 128), past which a full snapshot is required;
- :func:`keep_superseded`: a superseded load keeps running only when the new target needs it
  (its base, or a base further down its chain); otherwise it is cancelled;
- :func:`config_mismatch`: a delta whose ``config.json`` changes an architecture field against
  its base's fails naming the field, as Fireworks reports ``Config value mismatch for <field>``.

Errors are the daemon's domain errors (``bdn.daemon.errors``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from bdn.daemon.errors import Conflict, Unsupported
from bdn.proto.arc import CHECKSUM_FORMATS

#: Spellings of the one checksum format, lower-case -> the manifest's spelling.
CHECKSUM_ALIASES: dict[str, str] = {"alder32": "alder32", "adler32": "alder32"}

#: ``config.json`` fields that define the architecture: a delta may not change them (the base's
#: tensors would not fit). Others (``torch_dtype``, ``transformers_version``, generation
#: defaults) may change.
ARCHITECTURE_FIELDS: tuple[str, ...] = (
    "architectures",
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "tie_word_embeddings",
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
)

#: The most bytes of ``config.json`` read for the check.
MAX_CONFIG_BYTES = 1 << 20


def checksum_format(value: str | None) -> str | None:
    """The manifest's spelling (``"alder32"``) of a request's ``checksum_format``, or None when
    absent. Case-insensitive. Raises Unsupported for anything else."""
    if value is None:
        return None
    got = CHECKSUM_ALIASES.get(value.lower())
    if got is None or got not in CHECKSUM_FORMATS:
        raise Unsupported(f"unsupported checksum_format {value!r}: bdn supports alder32 (also spelled adler32)")
    return got


def request_key(identity: str, meta: Mapping[str, Any] | None) -> tuple[str, str | None, str | None, str | None]:
    """What makes two hot-load requests the same one: ``(identity, previous_snapshot_identity,
    compression_format lower-cased, checksum_format normalised)``; absent fields are None."""
    meta = meta or {}
    cf = meta.get("compression_format")
    return (
        identity,
        meta.get("previous_snapshot_identity"),
        cf.lower() if isinstance(cf, str) else None,
        checksum_format(meta.get("checksum_format")),
    )


def check_previous(previous: str | None, current: str | None, target: str | None) -> None:
    """A request's ``previous_snapshot_identity`` against this replica. Raises Conflict unless it
    is absent, nothing is served yet, or it names the served snapshot or the target being loaded."""
    if previous is None or current is None or previous in (current, target):
        return
    raise Conflict(
        f"previous_snapshot_identity {previous!r} is not the snapshot being served ({current!r} is)"
        + (f" nor the one being loaded ({target!r})" if target and target != current else "")
        + "; to load a delta over its chain of deltas, leave incremental_snapshot_metadata out"
    )


def chain_length(identity: str, base_of: Callable[[str], str | None], limit: int) -> int:
    """Deltas from ``identity`` down to its anchor (0 for an anchor); ``base_of(id)`` gives a
    snapshot's base (None for an anchor). Raises Conflict past ``limit`` deltas (saying a full
    snapshot is required) and for a chain that loops."""
    n, seen, ident = 0, {identity}, identity
    while True:
        base = base_of(ident)
        if base is None:
            return n
        n += 1
        if n > limit:
            raise Conflict(
                f"snapshot {identity!r} is more than {limit} deltas from its anchor (max_delta_chain):"
                " a full snapshot is required; publish an anchor"
            )
        if base in seen:
            raise Conflict(f"the delta chain of {identity!r} loops at {base!r}")
        seen.add(base)
        ident = base


def base_chain(identity: str | None, base_of: Callable[[str], str | None], limit: int = 1024) -> list[str]:
    """``identity`` and its bases down to the anchor as far as ``base_of`` knows them (at most
    ``limit`` entries, no loop); empty for None."""
    out: list[str] = []
    while identity is not None and identity not in out and len(out) < limit:
        out.append(identity)
        identity = base_of(identity)
    return out


def keep_superseded(old: str, new_chain: Iterable[str]) -> bool:
    """Whether the load of superseded target ``old`` goes on: only when the new target's chain
    (:func:`base_chain` of it) needs it."""
    return old in set(new_chain)


def parse_config(data: bytes, what: str) -> dict[str, Any]:
    """An untrusted ``config.json``'s object. Raises Conflict (one line naming ``what``)."""
    if len(data) > MAX_CONFIG_BYTES:
        raise Conflict(f"{what} is {len(data)} bytes, over the {MAX_CONFIG_BYTES}-byte limit")
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise Conflict(f"{what} is not JSON: {str(e)[:120]}") from None
    if not isinstance(obj, dict):
        raise Conflict(f"{what} is not a JSON object")
    return obj


def config_mismatch(base: Mapping[str, Any], target: Mapping[str, Any]) -> str | None:
    """The first architecture field (:data:`ARCHITECTURE_FIELDS`, then the same fields of a nested
    ``text_config``) whose value differs between a delta's base and target ``config.json``, as
    ``"Config value mismatch for <field>: base <v>, target <v>"``; None when they agree. A field
    absent from both agrees; present in one only is a mismatch."""
    for prefix, b, t in (("", base, target), ("text_config.", base.get("text_config"), target.get("text_config"))):
        if not isinstance(b, Mapping) or not isinstance(t, Mapping):
            if prefix and (isinstance(b, Mapping) != isinstance(t, Mapping)):
                return f"Config value mismatch for text_config: base {_short(b)}, target {_short(t)}"
            continue
        for name in ARCHITECTURE_FIELDS:
            if b.get(name) != t.get(name):
                return f"Config value mismatch for {prefix}{name}: base {_short(b.get(name))}, target {_short(t.get(name))}"
    return None


def _short(v: Any) -> str:
    s = json.dumps(v, sort_keys=True, default=str)
    return s if len(s) <= 80 else s[:77] + "..."
