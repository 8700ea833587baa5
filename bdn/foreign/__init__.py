"""Snapshots published without ``bdn.manifest.json`` (docs/TRUST.md).

:func:`read_foreign_table` lists ``<identity>/`` and reads each safetensors header through the
bucket interface, then derives the table with the pure :func:`bdn.proto.foreign.derive_table`.
:mod:`bdn.foreign.checksum` verifies an object assembled from peers against the bucket's own
checksum; :mod:`bdn.foreign.repair` re-reads from the bucket only what failed;
:mod:`bdn.foreign.ready` is the check every foreign snapshot passes before READY.
"""

from bdn.foreign.reader import object_checksum, read_checksums, read_chunk, read_foreign_table

__all__ = ["object_checksum", "read_checksums", "read_chunk", "read_foreign_table"]
