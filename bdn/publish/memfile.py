"""One safetensors file of a sharded publish, built in memory: the bytes to upload and its entry.

A full snapshot's file is its header followed by the tensors' own buffers (no copy); a delta's is
a diff file (:mod:`bdn.proto.arc`, :mod:`bdn.proto.planes`) of the target tensors against the
base tensors, whose rebuilt file (the manifest's ``result``) is the target file. Both files are
laid out as :func:`bdn.fileops.save` writes them with ``__metadata__ {"format": "pt"}``, so the
same tensors give the same bytes whichever rank builds them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from bdn.proto import arc
from bdn.proto.chunks import concat_digests
from bdn.proto.errors import ChecksumError, TensorMismatch
from bdn.proto.manifest import FileEntry, FileResult
from bdn.proto.safetensors_fmt import _q, encode_raw, raw_tensors

#: ``__metadata__`` of every file a sharded publish writes (as ``safetensors.torch.save_file``).
METADATA = {"format": "pt"}


@dataclass(frozen=True)
class Built:
    """A file ready to upload: ``buffers`` concatenated are its bytes; ``entry`` its manifest entry."""

    entry: FileEntry
    buffers: list[Any]

    @property
    def nbytes(self) -> int:
        """The stored object's size in bytes."""
        return self.entry.size


def _layout(tensors: Mapping[str, np.ndarray]) -> tuple[bytes, list[memoryview]]:
    return encode_raw(raw_tensors(tensors), METADATA)


def full_file(path: str, tensors: Mapping[str, np.ndarray], chunk_size: int, map: arc.Map[Any, Any]) -> Built:
    """The file ``path`` of a full snapshot holding ``tensors``: header + the arrays' own bytes."""
    prefix, parts = _layout(tensors)
    buffers: list[Any] = [prefix, *parts]
    size = len(prefix) + sum(p.nbytes for p in parts)
    return Built(FileEntry(path, size, tuple(concat_digests(buffers, chunk_size, map))), buffers)


def check_pair(path: str, base: Mapping[str, np.ndarray], target: Mapping[str, np.ndarray]) -> None:
    """TensorMismatch (naming ``path`` and the tensor) unless both hold the same names, dtypes, shapes."""
    for name in sorted(set(base) | set(target)):
        if name not in base:
            raise TensorMismatch(f"{path}: tensor {_q(name)} is in the target but not in base_tensors")
        if name not in target:
            raise TensorMismatch(f"{path}: tensor {_q(name)} is in base_tensors but not in the target")
        b, t = base[name], target[name]
        if b.dtype != t.dtype:
            raise TensorMismatch(f"{path}: tensor {_q(name)}: dtype {b.dtype} in the base, {t.dtype} in the target")
        if b.shape != t.shape:
            raise TensorMismatch(
                f"{path}: tensor {_q(name)}: shape {list(b.shape)} in the base, {list(t.shape)} in the target"
            )


def delta_file(
    path: str,
    target: Mapping[str, np.ndarray],
    base: Mapping[str, np.ndarray],
    base_entry: FileEntry,
    base_chunk_size: int,
    base_identity: str,
    compression_format: str,
    chunk_size: int,
    map: arc.Map[Any, Any],
) -> Built:
    """The diff file ``path`` turning ``base`` into ``target`` (``{name: array}`` each).

    ``base_entry`` is the base manifest's entry of ``path`` (cut in ``base_chunk_size`` chunks):
    the file ``base`` lays out must be the one the nodes hold (its size and chunk digests), else
    ChecksumError naming ``path`` and ``base_identity``. Raises TensorMismatch (check_pair).
    """
    check_pair(path, base, target)
    bprefix, bparts = _layout(base)
    bsize = len(bprefix) + sum(p.nbytes for p in bparts)
    if bsize != base_entry.result_size or tuple(concat_digests([bprefix, *bparts], base_chunk_size, map)) != tuple(
        base_entry.result_chunks
    ):
        raise ChecksumError(
            f"{path}: base_tensors are not what base snapshot {base_identity!r} published in this file "
            f"({bsize} bytes laid out, {base_entry.result_size} published, or other bytes)"
        )
    tprefix, tparts = _layout(target)
    result = FileResult(bsize, tuple(concat_digests([tprefix, *tparts], chunk_size, map)))
    dprefix, dparts = encode_raw(*arc.encode_diff_arrays(base, target, compression_format, map=map))
    buffers: list[Any] = [dprefix, *dparts]
    size = len(dprefix) + sum(p.nbytes for p in dparts)
    return Built(FileEntry(path, size, tuple(concat_digests(buffers, chunk_size, map)), result), buffers)
