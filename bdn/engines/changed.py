"""Which tensors differ between the snapshot an engine serves and the one it is offered.

An engine that swaps only those tensors (a *partial swap*) copies a few percent of the model on a
typical RL step instead of all of it. The list comes from one of two places:

1. the daemon's offer (``offer["changed_tensors"]``, computed from the delta's streams and the
   chunk digests), used only when ``offer["changed_tensors_base"]`` names the snapshot this
   engine serves (a list relative to another base would miss tensors), and every name is a
   tensor of the target;
2. otherwise :func:`compare`: both snapshots are READY directories; a tensor whose byte range
   lies in chunks whose xxh3-128 digests are equal in both READY markers (same file, same chunk
   size) is unchanged without reading it; the rest are compared byte for byte through the
   read-only mmaps (numpy, no copies). A tensor new in the target, or with another dtype or
   shape, counts as changed; a tensor the target dropped makes a partial swap impossible
   (``ChangedTensors.removed``).

The offer may also carry ``changed_ranges``: ``{tensor name: [[start, end], ...]}``, the bytes of
each changed tensor outside which it holds the base's bytes, as half-open ranges ``[start, end)``
of ABSOLUTE offsets in the tensor's safetensors file (as bdnd's ``ranges_from_diffs`` writes
them: docs/ENGINES.md), sorted and not overlapping. It is relative to the same base as
``changed_tensors`` and used only with it; a changed tensor without an entry changed as a whole.
:func:`from_offer` validates it (:func:`parse_ranges`) and hands it on in
``ChangedTensors.ranges``, as offsets relative to the tensor's first byte.

Sources: README.md ("How a chunk moves": READY's chunk digests); the safetensors format
(https://github.com/huggingface/safetensors, "Format") through ``bdn.client.Snapshot``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bdn.client import Snapshot
from bdn.fileops import read_header
from bdn.proto.errors import BdnError, ProtocolError
from bdn.proto.safetensors_fmt import TensorInfo

__all__ = ["ChangedTensors", "changed_tensors", "compare", "from_offer", "parse_ranges", "tensor_infos"]

MAX_OFFER_NAMES = 1_000_000
MAX_OFFER_RANGES = 4_000_000


@dataclass(frozen=True)
class ChangedTensors:
    """The tensors to copy to go from ``base`` to ``target``.

    Attributes:
        names: changed or new tensor names of the target, in the target's order.
        source: ``"offer"`` (the daemon's list) or ``"compared"`` (found by :func:`compare`).
        removed: tensors of the base that the target lacks (non-empty: reload fully).
        compared_bytes: bytes read to compare (0 when every chunk digest matched, or from the offer).
        ranges: from the offer's ``changed_ranges`` (see the module doc), or None: ``{name:
            [(start, end), ...]}`` in bytes relative to the tensor's first byte, for some of ``names``.
    """

    names: list[str]
    source: str
    removed: list[str] = field(default_factory=list)
    compared_bytes: int = 0
    ranges: dict[str, list[tuple[int, int]]] | None = None


def tensor_infos(snap: Snapshot) -> dict[str, TensorInfo]:
    """Every tensor's header entry (absolute byte range in its file), read from the headers.

    Returns ``{tensor name: TensorInfo}`` over the safetensors files that hold ``snap``'s
    tensors. Raises ProtocolError (naming the file) for a header that cannot be read or parsed.
    """
    out: dict[str, TensorInfo] = {}
    for rel in {snap.tensor_file(n) for n in snap.tensor_names()}:
        try:
            out.update(read_header(snap.path.joinpath(*rel.split("/"))).tensors)
        except (BdnError, OSError) as exc:
            raise ProtocolError(f"{snap.path}: {rel}: {exc}") from None
    return out


def _chunk_digests(snap: Snapshot) -> tuple[int, dict[str, list[str]]]:
    ready = snap.ready
    return ready.chunk_size, {f.path: list(f.chunks) for f in ready.files}


def _same_by_digest(info: Any, chunk_size: int, old_chunks: list[str] | None, new_chunks: list[str]) -> bool:
    """True when every chunk covering ``info``'s byte range has the same digest in both files."""
    if old_chunks is None or info.nbytes == 0:
        return info.nbytes == 0
    first, last = info.start // chunk_size, (info.end - 1) // chunk_size
    if last >= len(old_chunks) or last >= len(new_chunks):
        return False
    return old_chunks[first : last + 1] == new_chunks[first : last + 1]


def compare(base: Snapshot, target: Snapshot) -> ChangedTensors:
    """Find the changed tensors of ``target`` against ``base`` (both open READY snapshots).

    Raises ProtocolError (from ``Snapshot``) for an unreadable tensor.
    """
    old_cs, old_digests = _chunk_digests(base)
    new_cs, new_digests = _chunk_digests(target)
    old_names = set(base.tensor_names())
    old_infos, new_infos = tensor_infos(base), tensor_infos(target)
    names: list[str] = []
    read = 0
    for name in target.tensor_names():
        if name not in old_names:
            names.append(name)
            continue
        rel_new, rel_old = target.tensor_file(name), base.tensor_file(name)
        info_new, info_old = new_infos[name], old_infos[name]
        if info_new.dtype != info_old.dtype or info_new.shape != info_old.shape:
            names.append(name)
            continue
        if (
            rel_new == rel_old
            and old_cs == new_cs
            and info_new.start == info_old.start
            and _same_by_digest(info_new, new_cs, old_digests.get(rel_old), new_digests[rel_new])
        ):
            continue
        a = base.tensor(name).reshape(-1).view(np.uint8)
        b = target.tensor(name).reshape(-1).view(np.uint8)
        read += a.nbytes + b.nbytes
        if not np.array_equal(a, b):
            names.append(name)
    removed = sorted(old_names - set(target.tensor_names()))
    return ChangedTensors(names, "compared", removed, read)


def from_offer(offer: dict[str, Any], serving: str | None, target: Snapshot) -> ChangedTensors | None:
    """The daemon's list from ``offer``, or None when it is absent or not relative to ``serving``.

    Raises ProtocolError (one line) for a malformed list or a name the target does not hold: the
    daemon's list is input like any other, and a wrong one would leave stale tensors in place.
    """
    names = offer.get("changed_tensors")
    if names is None or serving is None or offer.get("changed_tensors_base") != serving:
        return None
    if not isinstance(names, list) or len(names) > MAX_OFFER_NAMES or not all(isinstance(n, str) for n in names):
        raise ProtocolError("offer field changed_tensors must be a list of tensor names")
    known = set(target.tensor_names())
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ProtocolError(f"offer names {len(unknown)} tensor(s) not in {target.identity}, e.g. {unknown[0][:80]!r}")
    wanted = set(names)
    ranges = None
    if offer.get("changed_ranges") is not None:
        infos = tensor_infos(target)
        ranges = parse_ranges(offer["changed_ranges"], wanted, {n: (infos[n].start, infos[n].end) for n in wanted})
    return ChangedTensors([n for n in target.tensor_names() if n in wanted], "offer", ranges=ranges)


def parse_ranges(raw: Any, names: set[str], bounds: dict[str, tuple[int, int]]) -> dict[str, list[tuple[int, int]]]:
    """The offer's ``changed_ranges`` as ``{name: [(start, end), ...]}`` relative to each tensor's
    first byte (see the module doc).

    ``names``: the offer's changed tensors; ``bounds``: each one's absolute ``(start, end)`` in its
    file. Raises ProtocolError (one line) for anything else: not a mapping of names to lists of
    ``[start, end]`` integer pairs, a name not among the changed tensors, a range empty, outside
    the tensor, unsorted or overlapping, or more than ``MAX_OFFER_RANGES`` ranges in all. A wrong
    range would leave stale bytes in place, so none is guessed at.
    """
    if not isinstance(raw, dict):
        raise ProtocolError("offer field changed_ranges must map tensor names to lists of [start, end]")
    out: dict[str, list[tuple[int, int]]] = {}
    count = 0
    for name, spans in raw.items():
        if name not in names:
            raise ProtocolError(f"changed_ranges names {str(name)[:80]!r}, which is not in changed_tensors")
        if not isinstance(spans, list):
            raise ProtocolError(f"changed_ranges of {name[:80]!r} must be a list of [start, end]")
        count += len(spans)
        if count > MAX_OFFER_RANGES:
            raise ProtocolError(f"changed_ranges holds more than {MAX_OFFER_RANGES} ranges")
        lo, hi = bounds[name]
        prev = lo
        got: list[tuple[int, int]] = []
        for span in spans:
            if (
                not isinstance(span, list)
                or len(span) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in span)
            ):
                raise ProtocolError(f"changed_ranges of {name[:80]!r}: {str(span)[:40]} is not [start, end]")
            start, end = span
            if not prev <= start < end <= hi:
                raise ProtocolError(
                    f"changed_ranges of {name[:80]!r}: [{start}, {end}) is empty, unsorted, "
                    f"overlapping or outside its bytes [{lo}, {hi})"
                )
            got.append((start - lo, end - lo))
            prev = end
        out[name] = got
    return out


def changed_tensors(offer: dict[str, Any], serving: Snapshot | None, target: Snapshot) -> ChangedTensors | None:
    """The offer's list when usable, else :func:`compare`; None when nothing is served yet."""
    if serving is None:
        return None
    got = from_offer(offer, serving.identity, target)
    return got if got is not None else compare(serving, target)
