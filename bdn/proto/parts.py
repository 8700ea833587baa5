"""Part records of a sharded publish (``bdn.part/1``) and the rules that merge them into one step.

Source: DESIGN.md, "Sharded publish". Each rank of a trainer stores its files, then one part
record at ``<root>/.bdn-parts/<identity>/part-RRRRR-of-WWWWW.json`` (:func:`part_key`): JSON,
canonical (sorted keys, one-space indent, final newline)::

    {"format": "bdn.part/1", "identity": "step000002", "rank": 1, "world_size": 4,
     "kind": "delta", "base_identity": "step000001", "compression_format": "bdn_planes_v1",
     "chunk_size": 16777216,
     "files": [<manifest file entries of this rank's files, as in bdn.snapshot/1>],
     "tensors": {"model.layers.3.mlp.up_proj.weight": ["model.layers.3.safetensors", "BF16", [11008, 4096]]}}

``.bdn-parts`` can never be an identity (identities start with a letter or digit), so the records
never mix with snapshots. Records are read back from the bucket, so they are untrusted:
:meth:`PartRecord.from_json` checks them as ``Manifest.from_json`` checks manifests (the files
part *is* parsed by it), and :func:`merge_parts` checks the records of one step together. No I/O.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bdn.proto.errors import BdnError, ProtocolError
from bdn.proto.identity import validate_identity
from bdn.proto.manifest import FileEntry, Manifest
from bdn.proto.safetensors_fmt import DTYPE_BITS

FORMAT = "bdn.part/1"
#: Where part records live: ``<root>/PARTS_DIR/<identity>/``.
PARTS_DIR = ".bdn-parts"
MAX_PART_BYTES = 64 << 20
MAX_WORLD_SIZE = 1 << 20


class PartError(BdnError):
    """A part record is malformed, or the parts of a step do not fit together (one line)."""


def part_key(identity: str, rank: int, world_size: int) -> str:
    """The bucket key of rank ``rank``'s part record of step ``identity``."""
    return f"{PARTS_DIR}/{identity}/part-{rank:05d}-of-{world_size:05d}.json"


@dataclass(frozen=True)
class PartRecord:
    """One rank's part of a step: its files (as manifest entries) and its tensors.

    ``tensors`` maps each tensor name to ``(file path, safetensors dtype, shape)``. ``kind`` is
    ``full`` or ``delta``; a delta has ``base_identity`` and ``compression_format``.
    """

    identity: str
    rank: int
    world_size: int
    kind: str
    chunk_size: int
    files: tuple[FileEntry, ...]
    tensors: dict[str, tuple[str, str, tuple[int, ...]]]
    base_identity: str | None = None
    compression_format: str | None = None

    def _manifest(self) -> Manifest:
        return Manifest(
            identity=self.identity,
            kind=self.kind,
            policy_version=0,
            chunk_size=self.chunk_size,
            files=self.files,
            created_at="1970-01-01T00:00:00Z",
            base_identity=self.base_identity,
            compression_format=self.compression_format,
            checksum_format="alder32" if self.kind == "delta" else None,
        )

    def to_json(self) -> bytes:
        """Canonical JSON bytes (sorted keys, one-space indent, final newline)."""
        m = self._manifest().to_dict()
        obj = {
            "format": FORMAT,
            "identity": self.identity,
            "rank": self.rank,
            "world_size": self.world_size,
            "kind": self.kind,
            "chunk_size": self.chunk_size,
            "files": m["files"],
            "tensors": {n: [f, d, list(s)] for n, (f, d, s) in sorted(self.tensors.items())},
        }
        if self.kind == "delta":
            obj["base_identity"] = self.base_identity
            obj["compression_format"] = self.compression_format
        return (json.dumps(obj, sort_keys=True, indent=1) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes, *, where: str) -> PartRecord:
        """Parse and check a record read from the bucket; PartError naming ``where`` if it breaks a rule."""
        if len(data) > MAX_PART_BYTES:
            raise PartError(f"{where}: part record of {len(data)} bytes, more than {MAX_PART_BYTES}")
        try:
            obj = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise PartError(f"{where}: part record is not JSON: {e}") from None
        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            raise PartError(f"{where}: not a {FORMAT} part record")
        try:
            rank, world = obj["rank"], obj["world_size"]
            if not (type(world) is int and 1 <= world <= MAX_WORLD_SIZE and type(rank) is int and 0 <= rank < world):
                raise PartError(f"{where}: rank {rank!r} of world size {world!r} is out of range")
            m = Manifest.from_dict(
                {
                    "format": "bdn.snapshot/1",
                    "identity": obj["identity"],
                    "kind": obj["kind"],
                    "policy_version": 0,
                    "created_at": "1970-01-01T00:00:00Z",
                    "chunk_size": obj["chunk_size"],
                    "files": obj["files"],
                    **(
                        {
                            "base_identity": obj.get("base_identity"),
                            "compression_format": obj.get("compression_format"),
                            "checksum_format": "alder32",
                        }
                        if obj["kind"] == "delta"
                        else {}
                    ),
                }
            )
            tensors = _tensors(obj["tensors"], {f.path for f in m.files}, where)
        except KeyError as e:
            raise PartError(f"{where}: part record has no {e.args[0]!r}") from None
        except ProtocolError as e:
            raise PartError(f"{where}: {e}") from None
        return cls(
            m.identity,
            rank,
            world,
            m.kind,
            m.chunk_size,
            tuple(m.files),
            tensors,
            m.base_identity,
            m.compression_format,
        )


def _tensors(raw: Any, paths: set[str], where: str) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    if not isinstance(raw, dict):
        raise PartError(f"{where}: 'tensors' is not an object")
    out: dict[str, tuple[str, str, tuple[int, ...]]] = {}
    for name, v in raw.items():
        ok = (
            isinstance(v, list)
            and len(v) == 3
            and v[0] in paths
            and v[1] in DTYPE_BITS
            and isinstance(v[2], list)
            and all(type(d) is int and d >= 0 for d in v[2])
        )
        if not ok:
            raise PartError(f"{where}: tensor {name[:120]!r} is not [file of this part, dtype, shape]")
        out[name] = (v[0], v[1], tuple(v[2]))
    return out


@dataclass(frozen=True)
class Step:
    """The merged parts of one step: every file (sorted by path) and every tensor's file, dtype, shape."""

    kind: str
    chunk_size: int
    base_identity: str | None
    compression_format: str | None
    files: tuple[FileEntry, ...]
    tensors: dict[str, tuple[str, str, tuple[int, ...]]]


def merge_parts(identity: str, world_size: int, parts: Sequence[PartRecord | None]) -> Step:
    """Check the ``world_size`` parts of step ``identity`` together and merge them.

    ``parts[r]`` is rank ``r``'s record, or None when it is not in the bucket. Raises PartError
    (one line) for a missing part, a record of another step or rank, ranks that disagree on kind,
    base, compression format or chunk size, a tensor or a file in two parts, or a file whose
    tensors the part does not list.
    """
    validate_identity(identity)
    if len(parts) != world_size:
        raise PartError(f"{len(parts)} parts for a world size of {world_size}")
    missing = [r for r, p in enumerate(parts) if p is None]
    if missing:
        shown = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
        raise PartError(
            f"step {identity!r}: the part of rank{'s' if len(missing) > 1 else ''} {shown} of {world_size} is not in "
            "the bucket (that rank has not finished publish_part, or died); nothing was published"
        )
    recs = [p for p in parts if p is not None]
    first = recs[0]
    for r, p in enumerate(recs):
        if p.identity != identity or p.rank != r or p.world_size != world_size:
            raise PartError(
                f"step {identity!r}: the record stored for rank {r} of {world_size} says step {p.identity!r}, "
                f"rank {p.rank} of {p.world_size}"
            )
        for field in ("kind", "base_identity", "compression_format", "chunk_size"):
            if getattr(p, field) != getattr(first, field):
                raise PartError(
                    f"step {identity!r}: ranks disagree on {field}: {getattr(first, field)!r} on rank 0, "
                    f"{getattr(p, field)!r} on rank {r}"
                )
    owner: dict[str, int] = {}
    tensors: dict[str, tuple[str, str, tuple[int, ...]]] = {}
    file_owner: dict[str, int] = {}
    files: list[FileEntry] = []
    for r, p in enumerate(recs):
        for name, t in p.tensors.items():
            if name in owner:
                raise PartError(
                    f"step {identity!r}: tensor {name[:120]!r} is published by rank {owner[name]} and rank {r}; "
                    "every tensor must be owned by one rank"
                )
            owner[name] = r
            tensors[name] = t
        listed = {t[0] for t in p.tensors.values()}
        for f in p.files:
            if f.path in file_owner:
                raise PartError(
                    f"step {identity!r}: file {f.path!r} is written by rank {file_owner[f.path]} and rank {r}; "
                    "all tensors of a file (file_of) must be owned by one rank"
                )
            if f.path not in listed:
                raise PartError(f"step {identity!r}: rank {r}'s file {f.path!r} holds none of its tensors")
            file_owner[f.path] = r
            files.append(f)
    files.sort(key=lambda f: f.path)
    return Step(first.kind, first.chunk_size, first.base_identity, first.compression_format, tuple(files), tensors)
