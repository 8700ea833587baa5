"""The sparse apply's per-word work in one compiled pass: :mod:`bdn.proto.sparse`'s hot loop.

What a run of sparse ``bdn_planes_v1`` blocks of one tensor asks of a node once their zstd frames
are decoded (:mod:`bdn.proto.planes`, sparse payload: ``k`` gap bytes, ``e`` escaped gaps, ``w``
byte planes): each changed word's index (gaps, escapes), its XOR word (planes), the word XORed
in place, the tensor's Adler-32 sums updated from the changed bytes and the 4 KiB pages written.
numpy does it in ~15 passes over the changed words (indices, escapes, planes, gather, XOR,
scatter, one pass per byte of the sums, pages); :func:`run` does it in one loop, once per changed
word, and lists the written pages as runs ``[first, end)`` instead of one entry a page.

A *heavy* block (dense, or sparse with a sixteenth of its bytes or more changed:
:func:`bdn.proto.sparse._is_heavy`) goes through :func:`xor_block` instead: one sequential sweep
that decodes each changed word's index and XORs it in place, no sums (the caller takes the
block's Adler-32 before and after: two SIMD passes over a block in cache cost less than per-word
sums at that density). numpy needs ~8 passes for the same (gaps widened to int64, their cumsum,
planes to words, gather, XOR, scatter): 3x the kernel's CPU time at clustered 2 %
(``bench/nodework``).

The sums (RFC 1950, linear in each byte; :mod:`bdn.proto.sparse`'s docstring): for a block whose
first byte is tensor byte ``lo``, a changed word at block byte ``q`` whose byte ``j`` moves by
``d_j`` adds ``S = sum d_j`` to ``a`` and ``(n - lo - q) S - sum j d_j`` to ``b``. The loop keeps
per block ``sum S``, ``sum q S`` and ``sum j d_j`` in int64 (``q < 2**24``, ``|S| < 2**11``,
``k < 2**24`` words: far below ``2**63``) and reduces them mod 65521 once per block.

Both kernels check every field before it indexes anything (gap >= 1, escape count, escaped
gap >= 255, index < the block's words): a bad block stops the loop before its first bad word is
written and is reported (:func:`run`: by its position in the run; :func:`xor_block`: BAD); no
word at an index outside the block is ever touched, and the caller names the error (the numpy
decoder's message for that block). Words of the blocks before it, and of that block before the
bad field, are already XORed: as with numpy, nothing of the file is trustworthy after a
ProtocolError.

Optional, compiled with numba (``pip install 'bdn[fast]'``), as :mod:`bdn.proto.planes_scan`: the
kernels are compiled on first use (cached on disk by numba's ``cache=True``), ``nogil``; without
numba, or if they fail to compile, :func:`run` and :func:`xor_block` return None and :mod:`bdn.proto.sparse` applies
the same blocks with numpy (the same bytes, sums and ranges: its tests run both). No I/O, no
threads.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

#: Columns of the block table :func:`run` reads, one row a block.
RAW_AT, K, E, FIRST, ELEMS = range(5)
#: Status codes of the kernel: every block applied, or the row of the first bad block.
OK = 0
BAD = 1

#: Changed words decoded, then gathered, then written at a time (a few KiB of state, in L1).
_CHUNK = 256

_kernel: Any = None  # (run's, xor_block's) compiled functions once loaded; False when numba is absent or broken


def _compile() -> Any:
    try:
        import numba
    except Exception:  # noqa: BLE001 - absent, or built for another numpy: the numpy path then
        return False

    @numba.njit(cache=True, nogil=True, boundscheck=False)
    def kernel(words, raw, table, n, runs):  # pragma: no cover - compiled
        # words: the tensor's words (writable); raw: the run's decoded payloads, concatenated;
        # table: int64 rows (RAW_AT, K, E, FIRST, ELEMS); runs: int64 (>= sum k, 2) page runs out.
        w = words.itemsize
        mod = 65521
        da = np.int64(0)
        db = np.int64(0)
        nruns = 0
        cur0 = -1
        cur1 = -1
        pos = np.empty(_CHUNK, dtype=np.int64)
        olds = np.empty(_CHUNK, dtype=np.uint64)
        for r in range(table.shape[0]):
            at = table[r, 0]
            k = table[r, 1]
            e = table[r, 2]
            first = table[r, 3]
            elems = table[r, 4]
            pl = at + k + 4 * e
            s1 = np.int64(0)
            sq = np.int64(0)
            sj = np.int64(0)
            idx = np.int64(-1)
            ei = 0
            for c0 in range(0, k, _CHUNK):
                c1 = min(c0 + _CHUNK, k)
                # 1. the chunk's indices, every field checked before anything is read or written
                for i in range(c0, c1):
                    g = np.int64(raw[at + i])
                    if g == 0:
                        return BAD, r, 0, 0, nruns
                    if g == 255:
                        if ei >= e:
                            return BAD, r, 0, 0, nruns
                        q = at + k + 4 * ei
                        g = (
                            np.int64(raw[q])
                            | (np.int64(raw[q + 1]) << 8)
                            | (np.int64(raw[q + 2]) << 16)
                            | (np.int64(raw[q + 3]) << 24)
                        )
                        if g < 255:
                            return BAD, r, 0, 0, nruns
                        ei += 1
                    idx += g
                    if idx >= elems:
                        return BAD, r, 0, 0, nruns
                    pos[i - c0] = idx
                # 2. gather the old words: independent loads, many cache misses in flight at once
                #    (a load-XOR-store loop keeps only a few: 4x slower measured at 0.1 %)
                for i in range(c1 - c0):
                    olds[i] = words[first + pos[i]]
                # 3. XOR, scatter (the lines are in cache now), sums and pages
                for i in range(c0, c1):
                    idx = pos[i - c0]
                    old = olds[i - c0]
                    # (branches on w, the same for every word: lifted out of the loop; a loop
                    # over the w bytes measured 2x slower in xor_block)
                    x = np.uint64(raw[pl + i])
                    if w >= 2:
                        x |= np.uint64(raw[pl + k + i]) << np.uint64(8)
                    if w >= 4:
                        x |= (np.uint64(raw[pl + 2 * k + i]) << np.uint64(16)) | (
                            np.uint64(raw[pl + 3 * k + i]) << np.uint64(24)
                        )
                    if w == 8:
                        x |= (np.uint64(raw[pl + 4 * k + i]) << np.uint64(32)) | (
                            np.uint64(raw[pl + 5 * k + i]) << np.uint64(40)
                        )
                        x |= (np.uint64(raw[pl + 6 * k + i]) << np.uint64(48)) | (
                            np.uint64(raw[pl + 7 * k + i]) << np.uint64(56)
                        )
                    new = old ^ x
                    words[first + idx] = new
                    dd = np.int64(new & np.uint64(0xFF)) - np.int64(old & np.uint64(0xFF))
                    if w >= 2:
                        d1 = np.int64((new >> np.uint64(8)) & np.uint64(0xFF)) - np.int64(
                            (old >> np.uint64(8)) & np.uint64(0xFF)
                        )
                        dd += d1
                        sj += d1
                    if w >= 4:
                        for j in range(2, w):
                            sh = np.uint64(8 * j)
                            dj = np.int64((new >> sh) & np.uint64(0xFF)) - np.int64((old >> sh) & np.uint64(0xFF))
                            dd += dj
                            sj += j * dj
                    s1 += dd
                    sq += idx * w * dd
                    page = ((first + idx) * w) >> 12
                    if page == cur1:
                        cur1 += 1
                    elif page != cur1 - 1:
                        if cur1 >= 0:
                            runs[nruns, 0] = cur0
                            runs[nruns, 1] = cur1
                            nruns += 1
                        cur0 = page
                        cur1 = page + 1
            if ei != e:
                return BAD, r, 0, 0, nruns
            lo = first * w
            da = (da + s1) % mod
            db = (db + ((n - lo) % mod) * (s1 % mod) - sq % mod - sj % mod) % mod
        if cur1 >= 0:
            runs[nruns, 0] = cur0
            runs[nruns, 1] = cur1
            nruns += 1
        return OK, table.shape[0], da % mod, db % mod, nruns

    @numba.njit(cache=True, nogil=True, boundscheck=False)
    def heavy(words, raw, k, e):  # pragma: no cover - compiled
        # words: the block's words (writable); raw: its decoded payload (k + 4e + k*w bytes), or
        # for k == 0 a dense block's w planes of len(words) bytes each. One sequential sweep.
        # The branches on w and dense are the same for every word, so the compiler lifts them
        # out of the loop (a loop over the w planes, or a helper function, measured 2-3x slower).
        w = words.itemsize
        elems = words.shape[0]
        dense = k == 0
        if dense:
            k = elems
        pl = 0 if dense else k + 4 * e
        idx = np.int64(-1)
        ei = 0
        for i in range(k):
            if dense:
                idx = np.int64(i)
            else:
                g = np.int64(raw[i])
                if g == 0:
                    return BAD
                if g == 255:
                    if ei >= e:
                        return BAD
                    q = k + 4 * ei
                    g = (
                        np.int64(raw[q])
                        | (np.int64(raw[q + 1]) << 8)
                        | (np.int64(raw[q + 2]) << 16)
                        | (np.int64(raw[q + 3]) << 24)
                    )
                    if g < 255:
                        return BAD
                    ei += 1
                idx += g
                if idx >= elems:
                    return BAD
            x = np.uint64(raw[pl + i])
            if w >= 2:
                x |= np.uint64(raw[pl + k + i]) << np.uint64(8)
            if w >= 4:
                x |= (np.uint64(raw[pl + 2 * k + i]) << np.uint64(16)) | (
                    np.uint64(raw[pl + 3 * k + i]) << np.uint64(24)
                )
            if w == 8:
                x |= (np.uint64(raw[pl + 4 * k + i]) << np.uint64(32)) | (
                    np.uint64(raw[pl + 5 * k + i]) << np.uint64(40)
                )
                x |= (np.uint64(raw[pl + 6 * k + i]) << np.uint64(48)) | (
                    np.uint64(raw[pl + 7 * k + i]) << np.uint64(56)
                )
            words[idx] ^= x
        if ei != e:
            return BAD
        return OK

    return kernel, heavy


def available() -> bool:
    """Whether :func:`run` runs the compiled kernel (numba importable on a little-endian machine).

    The first call imports numba; two threads calling it at once both get the same answer.
    """
    global _kernel
    if _kernel is None:
        _kernel = _compile() if sys.byteorder == "little" else False
    return _kernel is not False


def run(
    words: np.ndarray, raw: np.ndarray, table: np.ndarray, n: int, runs: np.ndarray
) -> tuple[int, int, int, int, int] | None:
    """Apply a run of sparse blocks of one tensor in place; None when the kernel is unavailable.

    ``words``: the tensor's first ``n // w`` words, a writable little-endian unsigned array of
    ``w`` = 1, 2, 4 or 8 bytes (the stream's width); ``raw``: uint8, the blocks' decoded
    payloads concatenated; ``table``: int64 ``(blocks, 5)``, one row a block in tensor order:
    its payload's offset in ``raw`` (:data:`RAW_AT`), ``k`` changed words, ``e`` escaped gaps,
    its first word's index in the tensor (:data:`FIRST`) and its word count (:data:`ELEMS`);
    the caller guarantees ``raw`` holds ``k + 4e + k*w`` bytes at each offset and that
    ``FIRST + ELEMS <= len(words)`` (the stream's validated block table); ``n``: the tensor's
    byte length; ``runs``: int64 ``(>= sum k, 2)``, written.

    Returns ``(status, row, da, db, nruns)``: :data:`OK` with the blocks' contribution
    ``(da, db)`` to the tensor's Adler-32 sums (mod 65521) and the ``nruns`` page runs
    ``runs[:nruns]`` (``[first page, end page)`` of the tensor, ascending, at least one page
    apart), or :data:`BAD` and the ``row`` of the first block whose fields are invalid.
    """
    global _kernel
    if not available():
        return None
    try:
        st, row, da, db, nruns = _kernel[0](words, raw, table, n, runs)
    except Exception:  # noqa: BLE001 - numba failed to compile for these types: numpy from now on
        _kernel = False
        return None
    return int(st), int(row), int(da), int(db), int(nruns)


def xor_block(words: np.ndarray, raw: np.ndarray, k: int, e: int) -> int | None:
    """XOR one heavy block's words in place in one sequential sweep; None when the kernel is
    unavailable.

    ``words``: the block's words, a writable little-endian unsigned array of ``w`` = 1, 2, 4 or 8
    bytes; ``raw``: uint8, the block's decoded payload (:mod:`bdn.proto.planes`): for a sparse
    block (``k >= 1``) exactly ``k + 4e + k*w`` bytes (``k`` gap bytes, ``e`` escaped gaps,
    ``w`` byte planes of ``k`` bytes), for a dense one (``k = e = 0``) ``w`` planes of
    ``len(words)`` bytes. Every field is checked before the word it indexes is touched (gap >= 1,
    escape count, escaped gap >= 255, index < ``len(words)``).

    Returns :data:`OK`, or :data:`BAD` for an invalid field: the words before it are XORed
    already, none at or after it (nothing of the file is trustworthy then). No sums: the caller
    takes the block's Adler-32 before and after (sequential, SIMD; cheaper than per-word sums
    when a sixteenth or more of the bytes change).
    """
    global _kernel
    if not available():
        return None
    try:
        return int(_kernel[1](words, raw, k, e))
    except Exception:  # noqa: BLE001 - numba failed to compile for these types: numpy from now on
        _kernel = False
        return None


def warm() -> bool:
    """Load the kernels for every word width now (numba's import and its cached compile, once per
    process) instead of in the first delta applied; returns :func:`available`."""
    for w in (1, 2, 4, 8):
        words = np.zeros(4096 // w, dtype=f"<u{w}")
        raw = np.ones(1 + w, dtype=np.uint8)
        table = np.array([[0, 1, 0, 0, len(words)]], dtype=np.int64)
        run(words, raw, table, 4096, np.empty((1, 2), dtype=np.int64))
        # a decoded zstd frame is a read-only buffer: the type xor_block is called with
        xor_block(words, np.frombuffer(bytes(raw), dtype=np.uint8), 1, 0)
    return available()
