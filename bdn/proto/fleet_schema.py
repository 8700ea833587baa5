"""The fleet hot-load GET's answer, written down once (README.md "Fleet hot-load API",
docs/DESIGN.md "Replica stages").

``GET /hot_load/v1/models/hot_load`` answers one page::

    {"identity": str | None,        # the hot-load target the page is about (None: none known yet)
     "replicas": [row, ...],        # sorted by replica_id
     "next_page_token": str,        # "" on the last page
     "replica_count": int,          # over the whole fleet
     "stages": {stage: int}}        # every stage of REPLICA_STAGES, 0 included

and every row, in every stage, has every key of :data:`REPLICA_ROW` (the types of
:data:`ROW_TYPES`; ``loading_state`` every key of :data:`LOADING_STATE`). The daemon builds its
rows with :func:`replica_row` and completes the rows other daemons report with
:func:`complete_row`; the client completes what it receives the same way, so a documented key
is never missing (no ``KeyError``), whichever daemon version answered. Pure: no I/O.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

from bdn.proto.errors import ProtocolError
from bdn.proto.states import REPLICA_STAGES

#: ``loading_state``: the replica's work on the target; ``identity`` None only when no target is known.
LOADING_STATE: dict[str, Any] = {"stage": "queued", "identity": None, "progress": 0.0, "reason": ""}

#: A replica row's keys and their values when the replica has nothing to say about them. The
#: engine options are the hot-load defaults (bdn/engines/options.py ``HotLoadOptions()``).
REPLICA_ROW: dict[str, Any] = {
    "replica_id": "",
    "current_snapshot_identity": None,  # the snapshot served (None: nothing yet)
    "policy_version": None,  # the served snapshot's policy version
    "readiness": False,  # serving something
    "loading_state": LOADING_STATE,
    "engines": 0,  # engines registered with the replica's daemon
    "last_swap_pause_ms": None,
    "superseded": [],  # [{"identity", "by"}]: the last targets a later hot-load replaced
    "request_id": None,  # the hot-load request that set the target
    "prompt_cache_policy": "RESET_ALL",
    "inflight_policy": "wait",
    "inflight_wait_s": 30.0,
    "last_swap": None,  # the last engine's swap report (a map), or None
    "reported_at": 0.0,  # s since the epoch on the replica's clock when it made the row (0.0: unknown)
}

_NUM = (int, float)
#: The JSON types each key may have (``type(None)`` where None is documented).
ROW_TYPES: dict[str, tuple[type, ...]] = {
    "replica_id": (str,),
    "current_snapshot_identity": (str, type(None)),
    "policy_version": (int, type(None)),
    "readiness": (bool,),
    "loading_state": (dict,),
    "engines": (int,),
    "last_swap_pause_ms": (*_NUM, type(None)),
    "superseded": (list,),
    "request_id": (str, type(None)),
    "prompt_cache_policy": (str,),
    "inflight_policy": (str,),
    "inflight_wait_s": _NUM,
    "last_swap": (dict, type(None)),
    "reported_at": _NUM,
}
LOADING_TYPES: dict[str, tuple[type, ...]] = {
    "stage": (str,),
    "identity": (str, type(None)),
    "progress": _NUM,
    "reason": (str,),
}
#: The page's keys and their types.
PAGE_TYPES: dict[str, tuple[type, ...]] = {
    "identity": (str, type(None)),
    "replicas": (list,),
    "next_page_token": (str,),
    "replica_count": (int,),
    "stages": (dict,),
}


def _fits(value: Any, types: tuple[type, ...]) -> bool:
    # bool is an int in Python, not in JSON's eyes: only "readiness" takes one
    if isinstance(value, bool) and bool not in types:
        return False
    return isinstance(value, types)


def replica_row(replica_id: str, loading_state: Mapping[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
    """A complete row for ``replica_id``: the defaults of :data:`REPLICA_ROW`, ``fields`` over
    them, ``loading_state`` merged over :data:`LOADING_STATE`. Raises KeyError for a field the
    schema does not have (a daemon bug, not input)."""
    unknown = set(fields) - set(REPLICA_ROW)
    if unknown:
        raise KeyError(f"not a replica row key: {', '.join(sorted(unknown))}")
    row = copy.deepcopy(REPLICA_ROW)
    row.update(fields, replica_id=replica_id)
    row["loading_state"] = {**LOADING_STATE, **(loading_state or {})}
    return row


def complete_row(obj: Any) -> dict[str, Any]:
    """A row from the wire (an aggregator's, another daemon version's) with every documented key:
    a missing key, or one of the wrong type, takes its default (a stage that is not a replica
    stage becomes ``queued``); keys the schema does not know are kept. Raises ProtocolError when
    ``obj`` is not a map."""
    if not isinstance(obj, dict):
        raise ProtocolError(f"replica row: expected a JSON object, got {type(obj).__name__}")
    row = dict(obj)
    for key, default in REPLICA_ROW.items():
        if key != "loading_state" and (key not in row or not _fits(row[key], ROW_TYPES[key])):
            row[key] = copy.deepcopy(default)
    ls = obj.get("loading_state")
    state = dict(ls) if isinstance(ls, dict) else {}
    for key, default in LOADING_STATE.items():
        if key not in state or not _fits(state[key], LOADING_TYPES[key]):
            state[key] = default
    if state["stage"] not in REPLICA_STAGES:
        state["stage"] = "queued"
    row["loading_state"] = state
    return row


def schema_errors(row: Any) -> list[str]:
    """What in ``row`` breaks the schema, one line each (``[]``: it is a complete row)."""
    if not isinstance(row, dict):
        return [f"not an object: {type(row).__name__}"]
    errs = [f"{k}: missing" for k in REPLICA_ROW if k not in row]
    errs += [f"{k}: {type(row[k]).__name__}" for k in REPLICA_ROW if k in row and not _fits(row[k], ROW_TYPES[k])]
    ls = row.get("loading_state")
    if isinstance(ls, dict):
        errs += [f"loading_state.{k}: missing" for k in LOADING_STATE if k not in ls]
        errs += [
            f"loading_state.{k}: {type(ls[k]).__name__}"
            for k in LOADING_STATE
            if k in ls and not _fits(ls[k], LOADING_TYPES[k])
        ]
        if ls.get("stage") not in REPLICA_STAGES:
            errs.append(f"loading_state.stage: {ls.get('stage')!r} is not a replica stage")
    return errs


def page_errors(page: Any) -> list[str]:
    """What in a GET answer breaks the schema (its keys, ``stages``, every row), one line each."""
    if not isinstance(page, dict):
        return [f"not an object: {type(page).__name__}"]
    errs = [f"{k}: missing" for k in PAGE_TYPES if k not in page]
    errs += [f"{k}: {type(page[k]).__name__}" for k in PAGE_TYPES if k in page and not _fits(page[k], PAGE_TYPES[k])]
    stages = page.get("stages")
    if isinstance(stages, dict) and set(stages) != set(REPLICA_STAGES):
        errs.append(f"stages: keys {sorted(stages)}, not the replica stages")
    reps = page.get("replicas")
    for i, r in enumerate(reps if isinstance(reps, list) else []):
        errs += [f"replicas[{i}].{e}" for e in schema_errors(r)]
    return errs


def stage_counts(stages: Iterable[str]) -> dict[str, int]:
    """``{stage: replicas}`` over every stage of REPLICA_STAGES (0 for the absent ones)."""
    out = dict.fromkeys(REPLICA_STAGES, 0)
    for s in stages:
        out[s if s in out else "queued"] += 1
    return out


def complete_page(obj: Any) -> dict[str, Any]:
    """A GET answer from the wire with every documented key (rows by :func:`complete_row`;
    ``stages`` with every stage). Raises ProtocolError when it is not a map or ``replicas`` is
    not a list."""
    if not isinstance(obj, dict):
        raise ProtocolError(f"hot-load status: expected a JSON object, got {type(obj).__name__}")
    reps = obj.get("replicas")
    if not isinstance(reps, list):
        raise ProtocolError("hot-load status: 'replicas' is not a list")
    page = dict(obj)
    page["replicas"] = [complete_row(r) for r in reps]
    if not _fits(page.get("identity"), PAGE_TYPES["identity"]):
        page["identity"] = None
    page.setdefault("identity", None)
    if not isinstance(page.get("next_page_token"), str):
        page["next_page_token"] = ""
    if not _fits(page.get("replica_count"), (int,)):
        page["replica_count"] = len(reps)
    given = page.get("stages")
    counts = dict.fromkeys(REPLICA_STAGES, 0)
    for k, v in given.items() if isinstance(given, dict) else ():
        if k in counts and _fits(v, (int,)):
            counts[k] = v
    page["stages"] = counts
    return page
