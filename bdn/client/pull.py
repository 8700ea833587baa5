"""HTTP pull from the local daemon into the caller's own buffer (the local pull at memory
speed), the way a serving process on the node wants it: one range request per tensor, or one big
file in several parallel ranges, each on its own connection, landing in memory the process
allocated once (a pinned staging buffer, a reused arena) instead of in a new object per call.

Why: a fresh destination costs the kernel a page fault and a zeroed page per 4 KiB before the
first byte lands (bench/transfer/pagefill measures it on this VM: a fresh anonymous 1 GiB costs
several times a copy into memory already written once). ``DaemonClient.read_file`` and
``read_tensor`` return new objects and pay it on every call; these functions take the buffer.

Each function checks the answer against what it asked for (status, Content-Range, length, the
tensor's dtype/shape headers) before and while filling: a daemon answer that does not fit is a
``ProtocolError``, an error status a ``DaemonError``; on any error the buffer holds unspecified
bytes.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import quote

import numpy as np

from bdn.client.errors import DaemonError
from bdn.client.transport import Transport, error_message
from bdn.proto.errors import BdnError, ProtocolError
from bdn.proto.identity import validate_identity, validate_relpath
from bdn.proto.safetensors_fmt import numpy_dtype

#: Parallel connections ``read_file_into`` opens at most (each a daemon send thread).
MAX_CONNECTIONS = 16


def _bytes_view(out: Any) -> memoryview:
    """``out`` as a 1-D byte view. A numpy array of a dtype without a buffer-protocol format
    (``ml_dtypes.bfloat16``, the dtype of bf16 tensors: ``memoryview`` raises "cannot include
    dtype 'E' in a buffer") is viewed as its bytes (``out.view(np.uint8)``) instead."""
    try:
        view = memoryview(out)
    except ValueError:
        if not isinstance(out, np.ndarray):
            raise
        if not out.flags.c_contiguous:
            raise ValueError("the destination buffer must be C-contiguous") from None
        view = memoryview(out.reshape(-1).view(np.uint8))  # type: ignore[arg-type]  # numpy's stubs give ndarray __buffer__ only from Python 3.12
    if view.readonly:
        view.release()
        raise ValueError("the destination buffer is read-only")
    if not view.c_contiguous:
        view.release()
        raise ValueError("the destination buffer must be C-contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _snap(identity: str) -> str:
    return f"/v1/snapshots/{quote(validate_identity(identity), safe='')}"


def _range_into(http: Transport, url: str, view: memoryview, offset: int, label: str) -> None:
    n = len(view)

    def alloc(got: int, _h: dict[str, str]) -> memoryview:
        if got != n:
            raise ProtocolError(f"{label}: daemon sent {got} bytes for a range of {n}")
        return view

    status, h, body = http.get_into(url, {"Range": f"bytes={offset}-{offset + n - 1}"}, alloc)
    if status != 206:
        if status == 200:
            raise ProtocolError(f"{label}: daemon ignored Range (HTTP 200)")
        raise DaemonError(status, error_message(status, body)[0])
    if not h.get("content-range", "").startswith(f"bytes {offset}-{offset + n - 1}/"):
        raise ProtocolError(f"{label}: daemon sent Content-Range {h.get('content-range', '')[:80]!r}")


def read_file_into(
    http: Transport,
    identity: str,
    path: str,
    out: Any,
    offset: int = 0,
    *,
    connections: int = 1,
) -> int:
    """Fill the writable C-contiguous buffer ``out`` (``n = out.nbytes`` bytes) with bytes
    ``[offset, offset + n)`` of file ``path`` of the ready snapshot ``identity``; returns ``n``.

    ``connections`` (1..``MAX_CONNECTIONS``) splits the range into that many contiguous pieces
    fetched at once, each over its own connection (the daemon sends each with ``sendfile`` on its
    own thread, so pieces go over several cores); about one per core the pull may use (on 2
    cores, 4 KiB tmpfs pages: 2 connections 0.50 x memcpy, 4 0.48 x, 8 0.47 x; BENCHMARKS.md).

    Raises:
        ValueError: a bad argument (negative offset, read-only buffer, connections out of range).
        DaemonError: 404 no such file, 409 not ready, 416 range outside the file.
        ProtocolError: an answer that is not the range asked for.
        DaemonUnreachable: the daemon cannot be reached or the connection broke.
    """
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    if not 1 <= connections <= MAX_CONNECTIONS:
        raise ValueError(f"connections must be 1..{MAX_CONNECTIONS}, got {connections}")
    url = _snap(identity) + "/files/" + quote(validate_relpath(path), safe="/")
    with _bytes_view(out) as view:
        n = len(view)
        if n == 0:
            return 0
        step = max(1 << 20, -(-n // connections))
        pieces = [(a, min(step, n - a)) for a in range(0, n, step)]
        label = f"{identity}/{path}"
        if len(pieces) == 1:
            _range_into(http, url, view, offset, label)
            return n
        with ThreadPoolExecutor(len(pieces), thread_name_prefix="bdn-pull") as pool:
            futs = [pool.submit(_range_into, http, url, view[a : a + ln], offset + a, label) for a, ln in pieces]
            for f in futs:
                f.result()  # the first error is raised (the others' connections end on their own)
        return n


def read_tensor_into(http: Transport, identity: str, name: str, out: Any) -> np.ndarray:
    """Fill the writable C-contiguous buffer ``out`` with tensor ``name`` of the ready snapshot
    ``identity`` and return it viewed as the tensor (its dtype and shape; bf16 as
    ``ml_dtypes.bfloat16``). ``out`` must hold exactly the tensor's bytes.

    Raises:
        ValueError: ``out`` read-only, or not the tensor's size (nothing is kept of the answer).
        DaemonError: 404 no such tensor, 409 not ready.
        ProtocolError: headers and body that disagree.
        DaemonUnreachable: as ``read_file_into``.
    """
    if not isinstance(name, str) or not name:
        raise ValueError("tensor name must be a non-empty string")
    url = _snap(identity) + "/tensors/" + quote(name, safe="")
    meta: dict[str, Any] = {}
    with _bytes_view(out) as view:

        def alloc(n: int, h: dict[str, str]) -> memoryview:
            dtype_str = h.get("x-bdn-dtype") or ""
            try:
                dtype = np.dtype(numpy_dtype(dtype_str))
            except BdnError as exc:
                raise ProtocolError(f"tensor {name!r}: X-BDN-Dtype: {exc}") from None
            shape = parse_shape(h.get("x-bdn-shape"), name)
            nbytes = math.prod(shape) * dtype.itemsize
            if n != nbytes:
                raise ProtocolError(f"tensor {name!r}: {n} bytes sent, {dtype_str} {list(shape)} needs {nbytes}")
            if n != len(view):
                raise ValueError(f"tensor {name!r} has {n} bytes; the buffer holds {len(view)}")
            meta.update(dtype=dtype, shape=shape)
            return view

        status, _h, body = http.get_into(url, {}, alloc)
        if status != 200:
            raise DaemonError(status, error_message(status, body)[0])
        nbytes = len(view)
    flat = np.frombuffer(out, dtype=np.uint8, count=nbytes) if nbytes else np.empty(0, dtype=np.uint8)
    return flat.view(meta["dtype"]).reshape(meta["shape"])


MAX_NDIM = 64


def parse_shape(header: str | None, name: str) -> tuple[int, ...]:
    """The ``X-BDN-Shape`` header (comma-separated non-negative integers; empty for a scalar).

    Returns the shape as a tuple (``()`` for a scalar). Raises ProtocolError (naming tensor
    ``name``) for a missing header, more than ``MAX_NDIM`` dimensions or a non-integer part.
    """
    if header is None:
        raise ProtocolError(f"tensor {name!r}: no X-BDN-Shape header")
    text = header.strip()
    if not text:
        return ()
    parts = text.split(",")
    if len(parts) > MAX_NDIM or not all(p.strip().isdigit() and p.strip().isascii() for p in parts):
        raise ProtocolError(f"tensor {name!r}: bad X-BDN-Shape {header[:80]!r}")
    return tuple(int(p) for p in parts)
