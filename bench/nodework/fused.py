"""Would a compiled fused loop bring the sparse kernel to its floor? (issue 28, the 0.1 % row)

    PYTHONPATH=<dir with numba> .venv/bin/python -m bench.nodework.fused [--mib 256] [--frac 0.001] [--runs 5]

The sparse apply's cost at 0.1 % scattered is per changed word (BENCHMARKS.md, "How much work does
a node do per step?"). This measures, on one synthetic bf16 tensor already in memory (pages
present), the per-word part alone, three ways, in CPU seconds (best of ``--runs``):

* ``numpy runs``: what ``bdn.proto.sparse`` does for runs of 32 light blocks after the zstd decode
  (gap bytes to indices with escapes, byte planes to words, ``_per_word``: gather, XOR, scatter,
  Adler-32 sums, pages);
* ``fused``: the same in one compiled loop per block (numba, ``nogil``): each gap decoded, the
  word read, XORed, written back, its bytes' Adler-32 contribution and its page recorded;
* ``floor``: the in-place XOR of exactly the changed words at precomputed positions (numpy
  gather, XOR, scatter), what any in-place method must do.

numba is not a bdn dependency; without it this prints so and exits 0. Writes
bench/results/nodework.fused.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from bdn.proto import sparse
from bdn.proto.planes import _words_from_planes

RESULTS = Path(__file__).resolve().parents[1] / "results"
BLOCK_WORDS = 1 << 20


def best(fn, runs: int) -> float:
    out = []
    for _ in range(runs):
        t0 = time.process_time()
        fn()
        out.append(time.process_time() - t0)
    return min(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--frac", type=float, default=0.001)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", default=str(RESULTS / "nodework.fused.json"))
    a = ap.parse_args()
    try:
        from numba import njit
    except ImportError:
        print("numba is not installed: nothing to measure")
        return 0

    @njit(nogil=True, boundscheck=False, cache=False)
    def fused(buf, raw, k, e, lo, n, elems, pages, np0):  # noqa: ANN001 - numba types
        s1 = 0
        s2 = 0
        idx = -1
        ei = 0
        pl0 = k + 4 * e
        npg = np0
        last = pages[np0 - 1] if np0 > 0 else -1
        for i in range(k):
            g = np.int64(raw[i])
            if g == 0:
                return 1, 0, 0, npg
            if g == 255:
                q = k + 4 * ei
                g = (
                    np.int64(raw[q])
                    | (np.int64(raw[q + 1]) << 8)
                    | (np.int64(raw[q + 2]) << 16)
                    | (np.int64(raw[q + 3]) << 24)
                )
                ei += 1
            idx += g
            if idx >= elems or ei > e:
                return 2, 0, 0, npg
            p = lo + idx * 2
            for j in range(2):
                old = np.int64(buf[p + j])
                new = old ^ np.int64(raw[pl0 + j * k + i])
                buf[p + j] = new
                d = new - old
                s1 += d
                s2 += (n - p - j) * d
            pg = p >> 12
            if pg != last:
                pages[npg] = pg
                npg += 1
                last = pg
        return 0, s1 % 65521, s2 % 65521, npg

    rng = np.random.default_rng(0)
    nbytes = a.mib << 20
    elems = nbytes // 2
    base = rng.integers(0, 256, nbytes, dtype=np.uint8)
    blocks = []
    for b0 in range(0, elems, BLOCK_WORDS):
        k = max(1, int(BLOCK_WORDS * a.frac))
        idx = np.sort(rng.choice(BLOCK_WORDS, k, replace=False)).astype(np.int64)
        gaps = np.diff(np.concatenate(([-1], idx)))
        esc = gaps >= 255
        x = rng.integers(1, 1 << 16, k).astype("<u2")
        raw = np.concatenate(
            [
                np.where(esc, 255, gaps).astype(np.uint8),
                gaps[esc].astype("<u4").view(np.uint8),
                (x & 0xFF).astype(np.uint8),
                (x >> 8).astype(np.uint8),
            ]
        )
        blocks.append((b0 * 2, k, int(esc.sum()), raw, idx, x))
    words = sum(b[1] for b in blocks)
    pages = np.empty(elems, dtype=np.int64)
    buf = base.copy()
    fused(buf, blocks[0][3], blocks[0][1], blocks[0][2], blocks[0][0], nbytes, BLOCK_WORDS, pages, 0)  # compile
    buf[:] = base

    def run_fused() -> None:
        npg = 0
        for lo, k, e, raw, _, _ in blocks:
            st, _, _, npg = fused(buf, raw, k, e, lo, nbytes, BLOCK_WORDS, pages, npg)
            assert st == 0

    def run_numpy() -> None:
        w16 = buf.view("<u2")
        for r in range(0, len(blocks), sparse.RUN_BLOCKS):
            ids, vals = [], []
            for lo, k, e, raw, _, _ in blocks[r : r + sparse.RUN_BLOCKS]:
                g8 = raw[:k]
                assert g8.all()
                gaps = g8.astype(np.int64)
                if e:
                    gaps[np.flatnonzero(g8 == 255)] = raw[k : k + 4 * e].view("<u4")
                nz = np.cumsum(gaps)
                nz += lo // 2 - 1
                ids.append(nz)
                vals.append(_words_from_planes(raw[k + 4 * e :], 2, np.empty(k, dtype="<u2")))
            sparse._per_word(w16, np.concatenate(ids), np.concatenate(vals), 2, nbytes, 0)

    allidx = np.concatenate([idx + lo // 2 for lo, _, _, _, idx, _ in blocks])
    allx = np.concatenate([x for *_, x in blocks])

    def run_floor() -> None:
        w16 = buf.view("<u2")
        w16[allidx] ^= allx

    out = {
        "benchmark": "nodework.fused",
        "mib": a.mib,
        "frac": a.frac,
        "changed_words": int(words),
        "load_average": os.getloadavg()[0],
    }
    for name, fn in (("numpy_runs_cpu_s", run_numpy), ("fused_cpu_s", run_fused), ("floor_cpu_s", run_floor)):
        out[name] = round(best(fn, a.runs), 5)
    check = base.copy()
    check.view("<u2")[allidx] ^= allx
    buf[:] = base
    run_fused()
    assert (buf == check).all(), "the fused loop's bytes differ"
    buf[:] = base
    run_numpy()
    assert (buf == check).all(), "the numpy runs' bytes differ"
    out["fused_vs_numpy"] = round(out["numpy_runs_cpu_s"] / out["fused_cpu_s"], 2)
    out["fused_vs_floor"] = round(out["fused_cpu_s"] / out["floor_cpu_s"], 2)
    print(json.dumps(out))
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
