"""Open a READY snapshot directory and read its tensors zero-copy.

A snapshot directory (``<shm_dir>/<swarm_id>/<identity>/``, see README.md, "How a chunk moves") is a
complete Hugging Face checkpoint directory plus a ``READY`` marker (bdn/client/ready.py). Tensors
are found through the safetensors header of every ``*.safetensors`` file the marker lists
(https://github.com/huggingface/safetensors, "Format"), cross-checked against
``*.safetensors.index.json`` when present, and returned as read-only numpy views into a read-only
``mmap`` of the file: no bytes are copied, and the pages are the daemon's shared memory.

Lifetime: mappings are made on first use and kept until ``Snapshot.close()``. Arrays returned by
``tensor()``/``tensors()`` must not be used after ``close()``; to stay memory-safe, a mapping that
still has live arrays is not torn down under them but unmapped when the last of them is freed.
"""

from __future__ import annotations

import json
import mmap
import os
import stat
import threading
from pathlib import Path
from types import TracebackType

import numpy as np

from bdn.client.ready import ReadyFile, ReadyMarker, read_ready, verify_files
from bdn.fileops import read_header
from bdn.proto.errors import BdnError, ProtocolError
from bdn.proto.safetensors_fmt import Header, TensorInfo, tensor_index, tensor_view

SAFETENSORS_SUFFIX = ".safetensors"
INDEX_SUFFIX = ".safetensors.index.json"
MAX_INDEX_BYTES = 256 << 20


class Snapshot:
    """A READY snapshot directory, opened for zero-copy tensor reads.

    Attributes:
        path: the snapshot directory.
        identity: the snapshot's identity (from READY).
        policy_version: the trainer's policy version (from READY).
        kind: ``"full"`` or ``"delta"`` (how the daemon got it; the files are always complete).
        base_identity: the base of a delta, else ``None``.
        ready: the whole parsed READY marker.

    Use ``open_snapshot(path)`` (or ``DaemonClient.open``) to make one; it is a context manager.
    """

    def __init__(self, path: Path, ready: ReadyMarker) -> None:
        self.path = path
        self.ready = ready
        self.identity = ready.identity
        self.policy_version = ready.policy_version
        self.kind = ready.kind
        self.base_identity = ready.base_identity
        self._files: dict[str, ReadyFile] = {f.path: f for f in ready.files}
        self._maps: dict[str, mmap.mmap] = {}
        self._lock = threading.Lock()  # engines load tensors from several threads
        self._closed = False
        # name -> (file path, TensorInfo); insertion order = file order, then header order.
        self._index: dict[str, tuple[str, TensorInfo]] = {}
        self._check_files()
        self._build_index()

    # -- opening -------------------------------------------------------------------------------

    def _full(self, rel: str) -> Path:
        return self.path.joinpath(*rel.split("/"))

    def _check_files(self) -> None:
        """Every file READY lists must be a regular file of the listed size inside the directory."""
        root = os.path.realpath(self.path)
        for f in self.ready.files:
            full = self._full(f.path)
            # A symlink could point the engine at bytes READY never described.
            real = os.path.realpath(full)
            if not real.startswith(root + os.sep):
                raise ProtocolError(f"{self.path}: {f.path} resolves outside the snapshot directory")
            try:
                st = os.stat(real)
            except FileNotFoundError:
                raise ProtocolError(f"{self.path}: {f.path} is listed in READY but missing") from None
            if not stat.S_ISREG(st.st_mode):
                raise ProtocolError(f"{self.path}: {f.path} is not a regular file")
            if st.st_size != f.size:
                raise ProtocolError(f"{self.path}: {f.path} has {st.st_size} bytes, READY says {f.size}")

    def _build_index(self) -> None:
        headers: dict[str, Header] = {}
        for rel in self._files:
            if not rel.endswith(SAFETENSORS_SUFFIX):
                continue
            try:
                headers[rel] = read_header(self._full(rel))
            except BdnError as exc:
                raise ProtocolError(f"{self.path}: {rel}: {exc}") from None
            except OSError as exc:
                raise ProtocolError(f"{self.path}: cannot read {rel}: {exc.strerror or exc}") from None
        try:
            self._index = tensor_index(headers)
        except BdnError as exc:
            raise ProtocolError(f"{self.path}: {exc}") from None
        for rel in self._files:
            if rel.endswith(INDEX_SUFFIX):
                self._check_index(rel)

    def _check_index(self, rel: str) -> None:
        """``weight_map`` of an HF index must agree with the shards' own headers, both ways."""
        where = f"{self.path}: {rel}"
        prefix = rel.rsplit("/", 1)[0] + "/" if "/" in rel else ""
        try:
            with open(self._full(rel), "rb") as f:
                obj = json.loads(f.read(MAX_INDEX_BYTES + 1))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ProtocolError(f"{where}: not valid JSON ({exc})") from None
        weight_map = obj.get("weight_map") if isinstance(obj, dict) else None
        if not isinstance(weight_map, dict):
            raise ProtocolError(f"{where}: no 'weight_map' object")
        shards: set[str] = set()
        for name, shard in weight_map.items():
            if not isinstance(shard, str):
                raise ProtocolError(f"{where}: weight_map[{name!r}] is not a file name")
            shard_rel = prefix + shard
            if shard_rel not in self._files:
                raise ProtocolError(f"{where}: tensor {name!r} is mapped to {shard!r}, which READY does not list")
            shards.add(shard_rel)
            found = self._index.get(name)
            if found is None:
                raise ProtocolError(f"{where}: tensor {name!r} is mapped to {shard!r} but no shard holds it")
            if found[0] != shard_rel:
                raise ProtocolError(f"{where}: tensor {name!r} is mapped to {shard!r} but is in {found[0]}")
        for name, (file, _info) in self._index.items():
            if file in shards and name not in weight_map:
                raise ProtocolError(f"{where}: tensor {name!r} of {file} is missing from weight_map")

    # -- reading -------------------------------------------------------------------------------

    def files(self) -> list[str]:
        """Relative paths of the snapshot's files, as READY lists them (READY itself excluded)."""
        return list(self._files)

    def tensor_names(self) -> list[str]:
        """Names of every tensor in every ``*.safetensors`` file, in file then header order."""
        return list(self._index)

    def tensor_file(self, name: str) -> str:
        """Relative path of the shard that holds tensor ``name`` (KeyError if there is none)."""
        if name not in self._index:
            raise KeyError(f"no tensor {name!r} in snapshot {self.identity}")
        return self._index[name][0]

    def _map(self, rel: str) -> mmap.mmap:
        with self._lock:
            if self._closed:
                raise ValueError(f"snapshot {self.identity} is closed")
            m = self._maps.get(rel)
            if m is None:
                with open(self._full(rel), "rb") as f:
                    m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                self._maps[rel] = m
            return m

    def tensor(self, name: str) -> np.ndarray:
        """Tensor ``name`` as a read-only numpy view into the mapped file (no copy).

        dtype follows the header (``BF16`` as ``ml_dtypes.bfloat16``, raw ``uint16`` without
        ml_dtypes), shape as stored. Raises KeyError for an unknown name, ValueError after
        ``close()``, SafetensorsError (a ProtocolError) for packed sub-byte dtypes (F4, F6_*),
        which have no numpy view.
        """
        rel = self.tensor_file(name)
        return tensor_view(self._map(rel), self._index[name][1])

    def tensors(self) -> dict[str, np.ndarray]:
        """Every tensor, as ``tensor()`` returns it, keyed by name."""
        return {name: self.tensor(name) for name in self._index}

    def verify(self) -> None:
        """Re-hash every file's chunks and compare with READY's xxh3-128 digests.

        Reads every byte of the snapshot once (through mmap). Raises ChecksumError naming the file
        and the first bad chunk (or a size that changed since the daemon wrote READY).
        """
        verify_files(self.path, self.ready)

    # -- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        """Release the file mappings. Arrays from this snapshot must not be used afterwards."""
        with self._lock:
            self._closed = True
            maps, self._maps = self._maps, {}
        for m in maps.values():
            try:
                m.close()
            except BufferError:
                # Arrays still point into it: dropping our reference lets the last of them unmap
                # it, instead of pulling the pages from under live arrays (a segfault).
                pass

    @property
    def closed(self) -> bool:
        """True once ``close()`` ran (its mappings are released; tensors must not be used)."""
        return self._closed

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Snapshot(identity={self.identity!r}, kind={self.kind!r}, "
            f"policy_version={self.policy_version}, path={str(self.path)!r})"
        )


def open_snapshot(path: str | os.PathLike[str]) -> Snapshot:
    """Open the snapshot directory at ``path`` for zero-copy reads.

    Checks that READY is present and valid, that every file it lists exists with its size, that
    the safetensors headers parse, and that ``*.safetensors.index.json`` agrees with them. It does
    not re-hash the bytes: call ``Snapshot.verify()`` for that.

    Raises:
        ProtocolError: one line naming what is wrong (no READY marker, a bad marker, a missing or
            resized file, a bad header, an inconsistent index).
    """
    p = Path(path)
    return Snapshot(p, read_ready(p))


__all__ = ["Snapshot", "open_snapshot"]
