"""The local files a publish reads: the target as a directory (given, or a temporary one holding a
state dict and its extra files) and, for a delta, the base's files (given as a directory or a
state dict and checked against the base's manifest, or rebuilt from the bucket)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

from bdn import fileops
from bdn.bucket import Bucket
from bdn.proto.errors import PathError
from bdn.proto.identity import validate_relpath
from bdn.proto.manifest import MANIFEST_NAME, Manifest
from bdn.proto.reserved import reserved_path
from bdn.publish.errors import PublishError
from bdn.publish.fetch import check_local_file, materialize

#: The file a state dict is written to (a single-file Hugging Face checkpoint).
STATE_DICT_FILE = "model.safetensors"


#: ``__metadata__`` of a state dict's file, as ``safetensors.torch.save_file`` writes it.
STATE_DICT_METADATA = {"format": "pt"}


PathLike = str | os.PathLike[str]


@contextlib.contextmanager
def source_dir(
    dir: PathLike | None,
    state_dict: Mapping[str, np.ndarray] | None,
    extra_files: Mapping[str, bytes] | None,
    tmp_dir: PathLike | None,
) -> Iterator[Path]:
    """The directory to publish: ``dir`` itself, or a temporary one holding the state dict.

    The temporary directory (under ``tmp_dir``) holds ``model.safetensors`` and ``extra_files``
    (relative path -> bytes) and is removed on exit. Raises PublishError unless exactly one of
    ``dir``/``state_dict`` is given, for ``extra_files`` with ``dir``, an empty state dict or a
    non-bytes extra file; PathError for an extra file's bad, reserved or bdn-written path.
    """
    if (dir is None) == (state_dict is None):
        raise PublishError("give exactly one of dir or state_dict")
    if dir is not None:
        if extra_files:
            raise PublishError("extra_files go with state_dict; put them in dir instead")
        yield Path(dir)
        return
    assert state_dict is not None
    with tempfile.TemporaryDirectory(dir=tmp_dir, prefix="bdn-publish-") as t:
        root = Path(t)
        write_state_dict(root / STATE_DICT_FILE, state_dict)
        for name, data in (extra_files or {}).items():
            validate_relpath(name)
            if name in (STATE_DICT_FILE, MANIFEST_NAME):
                raise PathError(f"extra file {name!r} would replace a file bdn writes itself")
            if reserved_path(name):
                raise PathError(f"extra file {reserved_path(name)}")
            if not isinstance(data, (bytes, bytearray, memoryview)):
                raise PublishError(f"extra file {name!r} must be bytes, got {type(data).__name__}")
            p = root / name
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
        yield root


def write_state_dict(path: Path, state_dict: Mapping[str, np.ndarray]) -> None:
    """Write ``state_dict`` (name -> array) as a safetensors file at ``path``; PublishError when empty."""
    if not state_dict:
        raise PublishError("state dict is empty")
    fileops.save(path, state_dict, dict(STATE_DICT_METADATA))


def base_files(
    b: Bucket,
    base_manifest: Manifest,
    paths: list[str],
    base_dir: PathLike | None,
    base_state_dict: Mapping[str, np.ndarray] | None,
    work: Path,
    workers: int,
) -> Path:
    """A directory holding the base's reconstructed ``paths``, checked against its manifest.

    With neither ``base_dir`` nor ``base_state_dict`` the files are rebuilt from the bucket under
    ``work/base`` (:func:`bdn.publish.fetch.materialize`, its errors). Otherwise every path must be
    a file there whose chunks match the base's manifest: PathError when ``base_dir`` is not a
    directory, PublishError for a missing file, ChecksumError for one that differs.
    """
    base = base_manifest.identity
    if base_dir is None and base_state_dict is None:
        root = work / "base"
        materialize(b, base_manifest, paths, root, workers=workers)
        return root
    if base_state_dict is not None:
        root = work / "base"
        root.mkdir()
        write_state_dict(root / STATE_DICT_FILE, base_state_dict)
        what = "base_state_dict"
    else:
        assert base_dir is not None  # the caller gives base_dir or base_state_dict
        root = Path(base_dir)
        what = "base_dir"
        if not root.is_dir():
            raise PathError(f"base_dir {str(root)!r} is not a directory")
    for p in paths:
        local = root / p
        if not local.is_file():
            raise PublishError(f"{what} has no {p!r}, which the target and base snapshot {base!r} have")
        check_local_file(
            local,
            base_manifest.file(p),
            base_manifest.chunk_size,
            f"{what} file {p!r} is not what base snapshot {base!r} published",
        )
    return root
