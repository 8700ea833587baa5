"""The diff files of a delta: one per target ``*.safetensors`` file, against the base's file of
the same path (``bdn.fileops.write_diff_file``; formats in :mod:`bdn.proto.arc`), each with the
size and chunk digests of the target file the nodes will rebuild (its manifest ``result``)."""

from __future__ import annotations

import os
from pathlib import Path

from bdn import fileops
from bdn.proto.errors import TensorMismatch
from bdn.proto.manifest import FileResult
from bdn.publish.tree import LocalFile
from bdn.publish.uploads import Upload, digests, run_all


def make_diffs(
    base_root: Path,
    tensors: list[LocalFile],
    out_root: Path,
    compression_format: str,
    chunk_size: int,
    workers: int,
) -> list[Upload]:
    """Write one diff file per target safetensors file; return them as uploads with results.

    Each diff of ``f.path`` goes to ``out_root/f.path``, against ``base_root/f.path``; the upload's
    result holds the target's size and its chunk digests (``chunk_size`` bytes). At most
    ``workers`` files (and no more than the cores) are diffed at once. Raises the errors of
    :func:`bdn.fileops.write_diff_file` (TensorMismatch prefixed with the file's path) and
    PublishError for an unreadable target.
    """

    # Diffing holds a shard's base and target mapped plus its compressed output: bound the files
    # in flight by cores, not by upload workers, and give each file's tensors the cores left.
    cores = os.cpu_count() or 1
    n = max(1, min(workers, cores, len(tensors)))
    per_file = max(1, cores // n)

    def one(f: LocalFile) -> Upload:
        out = out_root / f.path
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            fileops.write_diff_file(base_root / f.path, f.local, out, compression_format, workers=per_file)
        except TensorMismatch as e:
            raise TensorMismatch(f"{f.path}: {e}") from None
        result = FileResult(f.local.stat().st_size, tuple(digests(f.local, chunk_size, f.path)))
        return Upload(f.path, out, result)

    return run_all(one, tensors, n)
