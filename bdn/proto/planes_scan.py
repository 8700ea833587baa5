"""The changed words of ``base XOR target`` in one pass: the ``bdn_planes_v1`` encoder's hot loop.

What the encoder needs of a block (:mod:`bdn.proto.planes`): the number ``k`` of changed words,
their gap bytes (``min(gap, 255)``), the escaped gaps (each gap >= 255, in order) and the
changed XOR words themselves. numpy finds them in five passes (XOR, compare, ``nonzero``, gaps,
gather), ``nonzero`` alone taking half of the encoder's time at 2 % changed. :func:`scan` finds
them in one: it reads the block as 8-byte groups, lists the groups that differ (branch-free),
then visits only the changed words of those groups, lowest first (a de Bruijn multiply finds the
lowest changed word of a group, so the loop runs once per changed word, not once per word).

Optional, compiled with numba: installed with ``pip install 'bdn[fast]'`` (the test extras carry
it). The kernel is compiled on first use and cached on disk (numba's ``cache=True``: next to this
file, or in numba's per-user cache directory where that is not writable), ``nogil`` so that the
encoder's threads run it on every core. Loading it costs once per process (numba's import and
the cached kernel: 0.5 s for the import on a quiet machine here, 4-10 s in all at load 30). Without numba (or if
it fails to import or compile), :func:`scan` returns None and the encoder uses numpy (the same
streams, byte for byte: the encoder's tests run both). No I/O, no threads.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

#: Groups listed at once before their changed words are visited: the listed groups' bytes are
#: still in L1/L2 when they are read again (8 KiB of each input).
_GROUPS = 1024
# Lowest set bit of a 64-bit word: (x & -x) * _DEBRUIJN >> 58 indexes _DB_TABLE (a portable
# count-trailing-zeros; numba exposes no intrinsic for it).
_DEBRUIJN = 0x03F79D71B4CB0A89
_DB_TABLE = np.zeros(64, dtype=np.int64)
for _i in range(64):
    _DB_TABLE[((1 << _i) * _DEBRUIJN & 0xFFFF_FFFF_FFFF_FFFF) >> 58] = _i
_LOG2_BITS = {1: 3, 2: 4, 4: 5, 8: 6}

_kernel: Any = None  # the compiled function once loaded; False when numba is absent or broken


def _compile() -> Any:
    try:
        import numba
    except Exception:  # noqa: BLE001 - absent, or built for another numpy: the numpy path then
        return False
    debruijn = np.uint64(_DEBRUIJN)

    @numba.njit(cache=True, nogil=True, boundscheck=False)
    def kernel(b, t, b64, t64, per, lb, mask, table, gi, gaps, esc, vals):  # pragma: no cover - compiled
        # b, t: the block's words; b64, t64: its first len(b64) * per words as 8-byte groups.
        k = 0
        e = 0
        last = -1
        n64 = len(b64)
        for p0 in range(0, n64, len(gi)):
            p1 = min(p0 + len(gi), n64)
            c = 0
            for j in range(p0, p1):  # list the differing groups, no branch per group
                gi[c] = j
                c += b64[j] != t64[j]
            for q in range(c):
                j = gi[q]
                x64 = b64[j] ^ t64[j]
                first = j * per
                while x64 != 0:  # once per changed word of the group
                    low = x64 & (~x64 + np.uint64(1))
                    lane = table[(low * debruijn) >> np.uint64(58)] >> lb
                    sh = np.uint64(lane << lb)
                    vals[k] = (x64 >> sh) & mask
                    x64 &= ~(mask << sh)
                    i = first + lane
                    g = i - last
                    last = i
                    if g >= 255:
                        gaps[k] = 255
                        esc[e] = g
                        e += 1
                    else:
                        gaps[k] = g
                    k += 1
        for i in range(n64 * per, len(b)):  # the words after the last whole group
            x = b[i] ^ t[i]
            if x != 0:
                g = i - last
                last = i
                if g >= 255:
                    gaps[k] = 255
                    esc[e] = g
                    e += 1
                else:
                    gaps[k] = g
                vals[k] = x
                k += 1
        return k, e

    return kernel


def available() -> bool:
    """Whether :func:`scan` runs the compiled kernel (numba importable on a little-endian machine).

    The first call imports numba; two threads calling it at once both get the same answer (the
    later assignment wins, both functions compile to the same cached code).
    """
    global _kernel
    if _kernel is None:
        _kernel = _compile() if sys.byteorder == "little" else False
    return _kernel is not False


def scan(
    b: np.ndarray, t: np.ndarray, scratch: np.ndarray, vals: np.ndarray
) -> tuple[int, np.ndarray, np.ndarray, np.ndarray] | None:
    """The changed words of ``b XOR t``, or None when the kernel is unavailable (use numpy then).

    ``b``, ``t``: one block as equal-length arrays of little-endian unsigned words (1, 2, 4 or 8
    bytes); ``scratch``: a uint8 buffer of at least :func:`scratch_bytes` ``(len(b))`` bytes,
    8-byte aligned; ``vals``: a word buffer of at least ``len(b)`` words, ``b``'s dtype. Returns
    ``(k, gap bytes (k uint8), escaped gaps (uint32), changed XOR words (k words))``: views of
    ``scratch`` and ``vals``, valid until they are reused. Words ``i_1 < ... < i_k`` are the
    indices where ``b != t``; gap ``g_j = i_j - i_(j-1)`` (``i_0 = -1``), written as
    ``min(g_j, 255)``, and every ``g_j >= 255`` again, in order, as an escaped gap: the
    ``bdn_planes_v1`` sparse payload's fields (:mod:`bdn.proto.planes`).
    """
    global _kernel
    if not available():
        return None
    w = b.itemsize
    m = len(b)
    per = 8 // w
    n64 = m // per
    if b.ctypes.data % 8 or t.ctypes.data % 8:  # the 8-byte views need aligned inputs
        n64 = 0
    gi = scratch[: 8 * _GROUPS].view(np.int64)
    esc_n = m // 255 + 1
    esc = scratch[8 * _GROUPS : 8 * _GROUPS + 4 * esc_n].view(np.uint32)
    gaps = scratch[8 * _GROUPS + 4 * esc_n : 8 * _GROUPS + 4 * esc_n + m]
    b64 = b[: n64 * per].view(np.uint64)
    t64 = t[: n64 * per].view(np.uint64)
    try:
        k, e = _kernel(
            b, t, b64, t64, per, _LOG2_BITS[w], np.uint64((1 << (8 * w)) - 1), _DB_TABLE, gi, gaps, esc, vals
        )
    except Exception:  # noqa: BLE001 - numba failed to compile for these types: numpy from now on
        _kernel = False
        return None
    return k, gaps[:k], esc[:e], vals[:k]


def scratch_bytes(m: int) -> int:
    """Bytes of ``scratch`` that :func:`scan` needs for a block of ``m`` words."""
    return 8 * _GROUPS + 4 * (m // 255 + 1) + m


def warm() -> bool:
    """Load the kernel for every word width now (numba's import and its cached compile, once per
    process) instead of in the first delta encoded; returns :func:`available`."""
    for w in _LOG2_BITS:
        words = np.zeros(64, dtype=f"<u{w}")
        scan(words, words, np.empty(scratch_bytes(64), dtype=np.uint64).view(np.uint8), words.copy())
    return available()
