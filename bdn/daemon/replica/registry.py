"""Engine registrations and the hot-load target kept across a restart of bdnd:
``<shm_dir>/<swarm_id>/.engines``.

A restarted daemon that had forgotten its engines counted a node with a ready target and no
engine as ``done`` at once, moved ``current`` and let GC collect the snapshot its engines still
served, seconds before they polled again; and an engine that came back was offered the target
with no changes relative to what it served. So the table (each engine's id, name and the
identity it acknowledged last, and the one it was offered and has not answered) is written whenever it changes, and read back at start: the
engines are registered again under the same ids (their next poll just works), as seen at start,
each with a lease on what it serves (and was offered) when that is ready here, so its ack of an
offer the previous run made is taken. One that does not come back goes
stale after ``engine_stale_s`` and is dropped after ``engine_ttl_s``, as any silent engine.
The hot-load target is kept too (``Target.wire()``): a restart does not forget a hot-load it
accepted and had not finished (a lone daemon has no peer to gossip it back).

Format: JSON ``{"format": "bdn.engines/1", "engines": [{"engine_id", "name", "acked", "offered"}],
"target": {...} | null}``,
written to a temporary name and renamed into place. The file is read as untrusted: an unreadable
or malformed file, or entry, is skipped with one warning; at most ``limit`` entries are taken.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bdn.daemon.replica.engines import Engine
from bdn.proto.errors import BdnError
from bdn.proto.identity import validate_identity

log = logging.getLogger("bdn.hotload")

__all__ = ["FILE_NAME", "FORMAT", "Registered", "encode", "load", "save"]

FILE_NAME = ".engines"
FORMAT = "bdn.engines/1"
#: The largest file read back (256 engines of a few hundred bytes each fit many times over).
MAX_BYTES = 1 << 20


@dataclass(frozen=True)
class Registered:
    """One engine as the file holds it."""

    engine_id: str
    name: str
    acked: str | None
    offered: str | None = None


def encode(engines: Iterable[Engine], target: dict[str, Any] | None) -> bytes:
    """The file's bytes for the engine table and the target (``Target.wire()``, or None)."""
    body = {
        "format": FORMAT,
        "engines": [
            {"engine_id": e.engine_id, "name": e.name, "acked": e.acked, "offered": e.offered} for e in engines
        ],
        "target": target,
    }
    return json.dumps(body).encode()


def save(path: Path, data: bytes) -> None:
    """Write ``data`` (:func:`encode`) to ``path``, atomically. Raises OSError."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _entry(raw: object) -> Registered | None:
    if not isinstance(raw, dict):
        return None
    eid, name = raw.get("engine_id"), raw.get("name")
    if not isinstance(eid, str) or not 0 < len(eid) <= 64 or not eid.isalnum():
        return None
    if not isinstance(name, str) or len(name) > 128:
        return None
    idents: list[str | None] = []
    for key in ("acked", "offered"):
        v = raw.get(key)
        try:
            idents.append(None if v is None else validate_identity(v))
        except BdnError:
            return None
    return Registered(eid, name, idents[0], idents[1])


def load(path: Path, limit: int) -> tuple[list[Registered], Any]:
    """``(engines, target)``: the engines ``path`` holds (at most ``limit``, ids unique) and its
    target as stored (untrusted: for ``Target.from_wire``), ``([], None)`` when there is no file.
    Anything unreadable or malformed is skipped with one warning, never raised."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_BYTES + 1)
    except FileNotFoundError:
        return [], None
    except OSError as e:
        log.warning("engine registrations not restored: %s: %s", path, e)
        return [], None
    try:
        doc = json.loads(data) if len(data) <= MAX_BYTES else None
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("engines"), list):
        log.warning("engine registrations not restored: %s is not a %s file", path, FORMAT)
        return [], None
    out: dict[str, Registered] = {}
    for raw in doc["engines"]:
        r = _entry(raw)
        if r is None or r.engine_id in out:
            log.warning("engine registrations: a malformed entry of %s skipped", path)
            continue
        out[r.engine_id] = r
        if len(out) == limit:
            break
    return list(out.values()), doc.get("target")
