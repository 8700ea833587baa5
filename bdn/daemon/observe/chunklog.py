"""The optional per-chunk event log (config key ``chunk_log``): one JSON line per chunk this
node obtained, so a benchmark's tail can be explained from data (bench/swarm turns it into a
timeline), as kraken's torrentlog does per torrent.

A line: ``{"snapshot", "layer", "chunk" (position in the layer), "file", "index", "source"
("local" | "bucket-owner" | "bucket-fallback" | "peer:<node id>"), "transport" ("wire" |
"wire-cut" (a cut-through answer: the sender's bucket read still landed, bdn.transfer.growing) |
"-"), "start", "end" (unix seconds: the first attempt began / the chunk was verified), "bytes",
"retries" (attempts that failed or got a wrong digest), "busy" (busy answers)}``.

Events come from the sources (``attempt``) and the fetcher (``done``); pending records are
bounded by the chunks in flight. Writes are line-buffered appends; an unwritable log is
reported once and then ignored (the log is a diagnostic, never a reason to fail a download).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

from bdn.daemon.snapshots.snapshot import SnapshotJob
from bdn.proto.manifest import ChunkRef

log = logging.getLogger("bdn.chunklog")


@dataclass
class _Pending:
    start: float
    retries: int = 0
    busy: int = 0
    source: str = ""
    transport: str = "-"


class ChunkLog:
    """Appends to ``path`` (opened at once; raises OSError when it cannot be). ``clock`` gives
    unix seconds."""

    def __init__(self, path: str, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self.clock = clock
        self._f: IO[str] | None = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - kept open
        self._pending: dict[tuple[str, int, int, str], _Pending] = {}

    @staticmethod
    def _key(job: SnapshotJob, ref: ChunkRef) -> tuple[str, int, int, str]:
        return (job.identity, ref.file_index, ref.index, ref.digest)

    def attempt(self, job: SnapshotJob, ref: ChunkRef, source: str, outcome: str, transport: str = "-") -> None:
        """Event: one try at ``ref`` ended with ``outcome`` (``ok``, ``busy``, ``not_here``,
        ``corrupt``, ``failed``) from ``source``."""
        key = self._key(job, ref)
        p = self._pending.get(key)
        if p is None:
            p = self._pending[key] = _Pending(self.clock())
        if outcome == "ok":
            p.source, p.transport = source, transport
        elif outcome == "busy":
            p.busy += 1
        elif outcome in ("corrupt", "failed"):
            p.retries += 1

    def started(self, job: SnapshotJob, ref: ChunkRef) -> None:
        """Event: the acquisition of ``ref`` began (its ``start``)."""
        self._pending.setdefault(self._key(job, ref), _Pending(self.clock()))

    def done(self, job: SnapshotJob, layer: str, ref: ChunkRef, position: int) -> None:
        """Event: ``ref`` is verified: write its line."""
        p = self._pending.pop(self._key(job, ref), None) or _Pending(self.clock())
        self._write(
            {
                "snapshot": job.identity,
                "layer": layer,
                "chunk": position,
                "file": ref.path,
                "index": ref.index,
                "source": p.source or "?",
                "transport": p.transport,
                "start": round(p.start, 6),
                "end": round(self.clock(), 6),
                "bytes": ref.length,
                "retries": p.retries,
                "busy": p.busy,
            }
        )

    def drop(self, job: SnapshotJob) -> None:
        """Forget the pending records of ``job`` (it failed or was collected)."""
        for k in [k for k in self._pending if k[0] == job.identity]:
            del self._pending[k]

    def _write(self, rec: dict[str, Any]) -> None:
        if self._f is None:
            return
        try:
            self._f.write(json.dumps(rec, separators=(",", ":")) + "\n")
        except OSError as e:
            log.error("chunk_log %s: %s; no more chunk lines are written", self.path, e)
            self.close()

    def close(self) -> None:
        """Close the log file (errors closing it are ignored)."""
        if self._f is not None:
            try:
                self._f.close()
            except OSError:
                pass
            self._f = None


def open_chunk_log(path: str) -> ChunkLog | None:
    """The log at ``path``, or None when ``path`` is empty."""
    return ChunkLog(path) if path else None
