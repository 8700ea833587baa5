"""A timeline of one hot-load end to end, from the daemon's own log and the engine's own calls.

Daemon side: ``bdnd`` runs with ``BDN_LOG_JSON=true`` (every line carries ``ts``, seconds since the
epoch, ms resolution, ``bdn/daemon/main.py``); the lines that mark a step are matched by the
patterns of ``DAEMON_MARKS`` (those with a group ``any``, background work for whichever snapshot,
are kept whatever snapshot they name). Engine side: :func:`instrument` wraps the engine link's long-poll,
``HFEngine.prepare`` / ``swap`` and the driver's ``ack`` so each records ``time.time()`` when it
starts and returns. Both clocks are this machine's wall clock.

    marks = instrument(svc)            # before the POST
    ... POST, wait for done ...
    rows = build(t0, log_path, marks)  # [(seconds after the POST, "what")], in time order
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path
from typing import Any

import bdn.engines.driver as driver

DAEMON_MARKS = (
    (re.compile(r"hot-load: target is now (\S+)"), "daemon: target adopted (POST accepted)"),
    (re.compile(r"snapshot (\S+): reserved \d+ bytes, 0 in recycled"), "daemon: files reserved, all in fresh pages"),
    (
        re.compile(r"snapshot (\S+): reserved \d+ bytes, [1-9]\d* in recycled"),
        "daemon: files reserved in recycled pages",
    ),
    (re.compile(r"snapshot (\S+): delta, "), "daemon: manifest read, staging ready -> downloading"),
    (re.compile(r"snapshot (\S+): stored layer complete"), "daemon: stored layer fetched"),
    (re.compile(r"snapshot (\S+): applying"), "daemon: applying"),
    (re.compile(r"snapshot (\S+): \d+ file\(s\) brought forward sparsely"), "daemon: sparse apply done"),
    (re.compile(r"snapshot (\S+): ready at"), "daemon: READY published"),
    (
        re.compile(r"catch-up: .* brought forward to (?P<any>\S+) in the background"),
        "daemon (background): freed spare caught up to {}",
    ),
    (re.compile(r"seed: a buffer of \S+ copied from (?P<any>\S+) and verified"), "daemon: buffer seeded from {}"),
    (
        re.compile(r"seed: .*copy abandoned .* does not start from (?P<any>\S+) came"),
        "daemon: seed of {} abandoned (a snapshot not starting from it came)",
    ),
    (re.compile(r"gc: removed snapshot (?P<any>\S+)"), "daemon: GC removed {}"),
    (re.compile(r"changed tensors of (\S+) against"), "daemon: changed tensors computed"),
    (re.compile(r"engine \S+ serves (\S+)"), "daemon: ack received, replica done"),
)


class Marks:
    """``(time.time(), what)`` events the engine side recorded."""

    def __init__(self) -> None:
        self.events: list[tuple[float, str]] = []
        self.acked = threading.Event()  # set when the driver's ack returned (success or error)

    def add(self, what: str) -> None:
        self.events.append((time.time(), what))


def instrument(svc: Any) -> Marks:
    """Wrap ``svc``'s engine link and engine, and the driver's ack, to record their start and end."""
    marks = Marks()
    link, engine = svc.link, svc.engine
    nxt, prep, swap, ack = link.next_snapshot, engine.prepare, engine.swap, driver.ack

    def next_snapshot(*a: Any, **k: Any) -> Any:
        offer = nxt(*a, **k)
        if offer is not None:
            marks.add(f"engine: offer received ({len(offer.get('changed_tensors') or [])} changed tensors named)")
        return offer

    def prepare(*a: Any, **k: Any) -> Any:
        marks.add("engine: snapshot opened, prepare starts")
        out = prep(*a, **k)
        marks.add("engine: prepared (staged)")
        return out

    def swap_(*a: Any, **k: Any) -> Any:
        marks.add("engine: swap starts (drain, pause)")
        out = swap(*a, **k)
        marks.add(f"engine: resumed (pause {out.get('pause_ms')} ms)")
        return out

    def ack_(*a: Any, **k: Any) -> Any:
        marks.add("engine: ack sent")
        out = ack(*a, **k)
        marks.add("engine: ack answered")
        marks.acked.set()
        return out

    link.next_snapshot, engine.prepare, engine.swap, driver.ack = next_snapshot, prepare, swap_, ack_
    return marks


def daemon_events(log_path: Path, identity: str, since: float) -> list[tuple[float, str]]:
    out = []
    for line in log_path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("ts", 0) < since - 0.01:
            continue
        msg = rec.get("msg", "")
        for pat, what in DAEMON_MARKS:
            m = pat.search(msg)
            if m and "any" in pat.groupindex:  # any snapshot's: the label names it
                out.append((float(rec["ts"]), what.format(m.group("any").rstrip(":,"))))
            elif m and m.group(1).rstrip(":,") == identity:
                out.append((float(rec["ts"]), what))
    return out


def build(
    t0: float, log_path: Path, identity: str, marks: Marks, extra: list[tuple[float, str]]
) -> list[tuple[float, str]]:
    """Every event after ``t0`` (the POST), as ``(seconds after t0, what)`` in time order."""
    ev = daemon_events(log_path, identity, t0) + [e for e in marks.events if e[0] >= t0 - 0.01] + extra
    return sorted((round(t - t0, 3), w) for t, w in ev)


def stage_events(record: dict[str, Any]) -> list[tuple[float, str]]:
    """The snapshot record's stage boundaries (``created_at`` + the cumulative ``stages`` seconds)."""
    at = float(record.get("created_at") or 0.0)
    out = [(at, "daemon: snapshot job created (queued: manifest read, staging)")]
    for stage, secs in (record.get("stages") or {}).items():
        at += float(secs)
        out.append((at, f"daemon: {stage} ends"))
    return out


RESERVED = re.compile(r"snapshot (\S+): reserved (\d+) bytes, (\d+) in recycled pages")


def reserved(log_path: Path, identity: str) -> tuple[int, int] | None:
    """``(bytes reserved, bytes of them in recycled pages)`` for ``identity``'s files, from the
    daemon's log line (``bdn.daemon.store.store``); None when it has none."""
    for line in log_path.read_text(errors="replace").splitlines():
        m = RESERVED.search(line)
        if m and m.group(1) == identity:
            return int(m.group(2)), int(m.group(3))
    return None
