"""Buffers brought forward by sparse applies (DESIGN.md, "Sparse apply"): which collected snapshot
a spare file still holds (its *tag*), which tags a delta can start from, and the blocking apply of
the deltas a buffer missed, in order, writing only changed words.

A ready snapshot's safetensors file that GC recycles (``bdn.daemon.store.spares``: no process maps or
holds it) is tagged with the snapshot's identity, READY's chunk digests for it and, for a delta,
each tensor's Adler-32 (its diff's metadata). A later delta ``T`` on base ``N`` accepts a buffer
tagged ``X`` when ``X`` is ``N`` or an ancestor of ``N`` through ready ``bdn_planes_v1`` deltas
whose diff files are still on this node, at most ``sparse_max_chain`` deltas back: the buffer then
becomes ``T``'s staging file and the deltas ``X -> ... -> T`` are applied to it in place
(:func:`bring_forward`), if together they write fewer bytes than the file (else a full apply).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from bdn import fileops
from bdn.daemon.store.spares import Spares
from bdn.proto import sparse
from bdn.proto.diff_file import diff_tensors
from bdn.proto.errors import BdnError, ProtocolError
from bdn.proto.manifest import Manifest
from bdn.proto.ready import ReadyMarker

log = logging.getLogger("bdn.buffers")

SPARSE_FORMAT = "bdn_planes_v1"


def tags_of(marker: ReadyMarker, stored_dir: Path) -> dict[str, dict[str, Any]]:
    """The tags of a ready snapshot's safetensors files (``bdn.daemon.store.spares``, tags), by path:
    READY's digests and, when the snapshot's diff file is in ``stored_dir``, each tensor's Adler-32."""
    tags: dict[str, dict[str, Any]] = {}
    for f in marker.files:
        if not f.path.endswith(".safetensors"):
            continue
        adlers = None
        diff = stored_dir / f.path
        if diff.is_file():
            try:
                adlers = {n: t.target_adler32 for n, t in diff_tensors(fileops.read_header(diff)).items()}
            except (OSError, BdnError):
                adlers = None
        tags[f.path] = {
            "identity": marker.identity,
            "path": f.path,
            "size": f.size,
            "chunks": list(f.chunks),
            "adlers": adlers,
        }
    return tags


def take(
    spares: Spares, m: Manifest, staging: Path, accept: Callable[[dict[str, Any]], bool]
) -> dict[str, dict[str, Any]]:
    """Move into ``staging`` every tagged spare that ``accept`` takes as a rebuilt diff file of
    ``m`` (same path and size, ``Spares.take_tagged``), kept as it is; ``{path: tag}`` of those
    (their bytes are the tag's snapshot's, to be brought forward by :func:`bring_forward`)."""
    held: dict[str, dict[str, Any]] = {}
    for f in m.files:
        if f.is_diff and f.result_size:
            (staging / f.path).parent.mkdir(parents=True, exist_ok=True)
            tag = spares.take_tagged(f.path, f.result_size, staging / f.path, accept)
            if tag is not None:
                held[f.path] = tag
    return held


class Held(Protocol):
    """What the chain walk needs of a snapshot this node knows (``bdn.daemon.snapshots.snapshot.SnapshotJob``)."""

    state: str
    manifest: Manifest | None


def chains(
    m: Manifest, get: Callable[[str], Held | None], stored_dir: Callable[[str], Path], max_steps: int
) -> dict[str, list[tuple[str, Path]]]:
    """For delta ``m``: identity a buffer may hold -> the deltas to apply to it, in order, as
    ``(identity, its stored directory)``, ending with ``m`` itself. Empty for a delta not in
    ``bdn_planes_v1``. Each ancestor step must be a ready ``bdn_planes_v1`` delta known here."""
    if not m.is_delta or (m.compression_format or "").lower() != SPARSE_FORMAT or m.base_identity is None:
        return {}
    out: dict[str, list[tuple[str, Path]]] = {}
    steps: list[tuple[str, Path]] = [(m.identity, stored_dir(m.identity))]
    holder: str | None = m.base_identity
    seen = {m.identity}
    while holder is not None and holder not in seen and len(steps) <= max_steps:
        seen.add(holder)
        out[holder] = list(reversed(steps))
        j = get(holder)
        hm = j.manifest if j is not None else None
        if (
            j is None
            or j.state != "ready"
            or hm is None
            or not hm.is_delta
            or (hm.compression_format or "").lower() != SPARSE_FORMAT
        ):
            break
        steps.append((holder, stored_dir(holder)))
        holder = hm.base_identity
    return out


@dataclass
class Forwarded:
    """A buffer brought forward: ``ranges`` the target's changed ranges against its base (the last
    delta's, ``bdn.proto.sparse.SparseResult.ranges``), ``touched`` the chunk indices any step
    wrote (their xxh3 is checked after READY), ``written`` bytes written over all steps, ``adlers``
    every tensor's Adler-32 after the last step (checked against that diff's metadata)."""

    path: str
    ranges: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    touched: list[int] = field(default_factory=list)
    written: int = 0
    steps: int = 0
    adlers: dict[str, int] = field(default_factory=dict)


def bring_forward(
    path: str,
    file: Path,
    tag: dict[str, Any],
    steps: Sequence[tuple[str, Path]],
    result_size: int,
    result_chunks: Sequence[str],
    chunk_size: int,
    workers: int,
    mapped: Any = None,
) -> Forwarded:
    """Apply ``steps`` (``(identity, stored directory)`` of each delta, in order) in place to
    ``file``, which holds ``tag``'s snapshot of ``path``; blocking. ``mapped``: the file's populated
    mapping (``bdn.daemon.apply.hotmaps``) when it has one.

    Raises:
        ProtocolError: the deltas together would write more than the file (a full apply is
            cheaper), a diff does not fit, a tensor's Adler-32 is not the diff's (ChecksumError),
            or a chunk no step touched has another digest in the target than in the buffer. The
            message names the buffer's snapshot; the file then holds partial data.
        OSError: a file cannot be read or written.
    """
    held = tag.get("identity")
    chunks = tag.get("chunks")
    if tag.get("size") != result_size or not isinstance(chunks, list) or len(chunks) != len(result_chunks):
        raise ProtocolError(f"{path}: the buffer of {held} is not the target's size or chunking")
    diffs = [d / path for _, d in steps]
    need = 0
    for d in diffs:  # from the block records alone: whichever writes fewer bytes wins
        diff = fileops._map(d)
        _, streams = fileops.arc.read_diff_header(diff, len(diff))
        need += sparse.changed_bytes(diff, streams, fileops.read_header(file))
        del diff
    if need > result_size:
        raise ProtocolError(
            f"{path}: {len(steps)} sparse delta(s) from {held} write {need} bytes, more than the "
            f"{result_size}-byte file: full apply"
        )
    adlers = tag.get("adlers")
    known = {str(k): int(v) for k, v in adlers.items()} if isinstance(adlers, dict) else None
    out = Forwarded(path)
    touched: set[int] = set()
    for (ident, _), d in zip(steps, diffs):
        try:
            res = fileops.apply_sparse_file(file, d, known, workers=workers, name=path, mapped=mapped)
        except ProtocolError as e:
            raise ProtocolError(f"buffer holding {held}, delta {ident}: {e}") from None
        known = res.adlers
        touched.update(sparse.touched_chunks(res.ranges, result_size, chunk_size))
        out.ranges, out.written, out.steps = res.ranges, out.written + res.written, out.steps + 1
    out.touched = sorted(touched)
    out.adlers = dict(known or {})
    sparse.check_untouched(out.touched, [str(c) for c in chunks], list(result_chunks), path)
    return out
