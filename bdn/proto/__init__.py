"""bdn's formats and rules, pure: bytes and values in, values out, no I/O.

Modules (docs/DESIGN.md, "Map of the code"): ``identity`` (identities and relative paths),
``manifest`` (``bdn.manifest.json``, format ``bdn.snapshot/1``), ``chunks`` (chunk ranges and
XXH3-128 digests), ``keys`` (keys derived from the partition secret, chunk addresses, request
signatures), ``hrw`` (rendezvous owners), ``safetensors_fmt`` (strict header parser, writer),
``arc`` / ``arc_streams`` / ``planes`` / ``diff_file`` / ``delta_tasks`` (the delta codecs),
``foreign`` (tables of snapshots without a manifest), ``ready`` (the ``READY`` marker,
``bdn.ready/1``), ``reserved`` (names bdn writes in a snapshot directory), ``states`` (state
names), ``wire`` (the transfer wire's frames), ``errors`` (the error types all of bdn shares).

No module here imports os, mmap, threading or concurrent (``tests/test_proto_pure.py``); file-level
work is :mod:`bdn.fileops`.
"""
