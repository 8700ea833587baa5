"""The delta codecs the benchmark compares, each as encode(pair, threads) and decode(pair, threads).

Every codec turns (base file, target file) into stored bytes and rebuilds the target's tensor
bytes from base + stored bytes; each decode is checked bit-exact against the target. GB/s are
reconstructed (target) bytes per second of wall time.

* ``arc_v2 (bdn)``: ``bdn.fileops.write_diff_file`` / ``bdn.proto.arc.apply_diff`` into a fallocated /dev/shm
  file through mmaps, exactly as bdnd applies a delta.
* ``arc_v2 (fireworks)``: PyPI ``fireworks-delta-compression`` ``delta_compress_files_to_file`` /
  ``delta_decompress_inplace`` on a /dev/shm copy of the base (the copy is not timed).
* ``sparse+zstd``: per tensor, the int32 flat indices of changed elements and the target's new
  values, each zstd-compressed (level 3): the layout of TRL's sparse weight-delta sync. Decode:
  copy the base tensor, scatter the values.
* ``zipnn(xor)``: PyPI ``zipnn`` (byte grouping + Huffman/zstd, bf16 mode) on each tensor's XOR
  delta; decode XORs the decompressed delta into the base.
* ``bdn_planes_v1 (bdn)``: bdn's own format (specified in ``bdn/proto/arc.py``), through the same
  ``write_diff_file`` / ``apply_diff`` path as ``arc_v2 (bdn)``. (Results written before
  2026-12-01 also have rows ``bdn planes``: the benchmark's prototype of this format, since removed;
  the shipped codec replaced it.)
"""

from __future__ import annotations

import mmap
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zstandard

from bdn import fileops
from bdn.fileops import read_header
from bdn.proto import arc
from bdn.proto.safetensors_fmt import Header
from bench.delta.inputs import Pair

SHM = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")


@dataclass
class Result:
    bytes: int
    encode_s: float
    decode_s: float


def _tensors(path: Path) -> tuple[Header, np.memmap]:
    return read_header(path), np.memmap(path, dtype=np.uint8, mode="r")


def _pmap(fn: Callable, items: list, threads: int) -> list:
    if threads <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(fn, items))


def _out_file(size: int) -> tuple[Path, np.memmap]:
    p = SHM / f"bdn-bench-out-{os.getpid()}"
    with open(p, "wb") as fh:
        fh.truncate(size)
        os.posix_fallocate(fh.fileno(), 0, max(size, 1))
    return p, np.memmap(p, dtype=np.uint8, mode="r+")


def _check(out: np.ndarray, pair: Pair, h: Header) -> None:
    tgt = np.memmap(pair.target, dtype=np.uint8, mode="r")
    for i in h.tensors.values():
        if not np.array_equal(out[i.start : i.end], tgt[i.start : i.end]):
            raise AssertionError(f"{pair.input}: tensor {i.name} is not bit-exact")


# --- arc_v2, bdn ------------------------------------------------------------------------------


def arc_bdn(pair: Pair, work: Path, threads: int, fmt: str = "arc_v2") -> Result:
    diff = work / f"{fmt}_bdn.diff"
    t0 = time.perf_counter()
    fileops.write_diff_file(pair.base, pair.target, diff, fmt, workers=threads)
    enc = time.perf_counter() - t0
    bh = read_header(pair.base)
    out, _ = _out_file(pair.raw_bytes)
    try:
        with open(pair.base, "rb") as bf, open(diff, "rb") as df, open(out, "r+b") as of:
            with mmap.mmap(df.fileno(), 0, access=mmap.ACCESS_READ) as dm:
                dh = arc.read_diff_header(dm, len(dm))
                with mmap.mmap(bf.fileno(), 0, access=mmap.ACCESS_READ) as bm, mmap.mmap(of.fileno(), 0) as om:
                    t0 = time.perf_counter()
                    arc.apply_diff(bm, bh, dm, dh, om, fmt, map=fileops.thread_map(threads))
                    dec = time.perf_counter() - t0
        _check(np.memmap(out, dtype=np.uint8, mode="r"), pair, bh)
    finally:
        out.unlink(missing_ok=True)
    return Result(diff.stat().st_size, enc, dec)


# --- arc_v2, fireworks-delta-compression -------------------------------------------------------


def arc_fireworks(pair: Pair, work: Path, threads: int) -> Result:
    import fireworks_delta_compression as fdc

    diff = work / "arc_fw.diff"
    with ThreadPoolExecutor(threads) as ex:
        t0 = time.perf_counter()
        fdc.delta_compress_files_to_file(
            src=str(pair.base), dst=str(pair.target), diff_file=str(diff), compression_format="arc_v2", executor=ex
        )
        enc = time.perf_counter() - t0
    out = SHM / f"bdn-bench-fw-{os.getpid()}"
    shutil.copyfile(pair.base, out)
    try:
        t0 = time.perf_counter()
        fdc.delta_decompress_inplace(base_path=str(out), diff_path=str(diff), compression_format="arc_v2")
        dec = time.perf_counter() - t0
        _check(np.memmap(out, dtype=np.uint8, mode="r"), pair, read_header(pair.base))
    finally:
        out.unlink(missing_ok=True)
    return Result(diff.stat().st_size, enc, dec)


# --- sparse indices + values, zstd (TRL's layout) ---------------------------------------------


def _elem(info) -> np.dtype:
    return (
        np.dtype(
            {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[info.nbytes // max(int(np.prod(info.shape)), 1)]
        )
        if info.nbytes
        else np.dtype(np.uint8)
    )


def sparse_zstd(pair: Pair, work: Path, threads: int) -> Result:
    bh, base = _tensors(pair.base)
    _, tgt = _tensors(pair.target)
    infos = list(bh.tensors.values())

    def enc_one(i):
        dt = _elem(i)
        b, t = base[i.start : i.end].view(dt), tgt[i.start : i.end].view(dt)
        idx = np.flatnonzero(b != t)
        idx = idx.astype(np.int32 if b.size < 2**31 else np.int64)
        c = zstandard.ZstdCompressor(level=3)
        return c.compress(idx.tobytes()), c.compress(t[idx].tobytes())

    t0 = time.perf_counter()
    blobs = _pmap(enc_one, infos, threads)
    enc = time.perf_counter() - t0
    size = sum(len(a) + len(b) + 8 for a, b in blobs)
    p, out = _out_file(pair.raw_bytes)
    try:
        out[: bh.data_start] = base[: bh.data_start]

        def dec_one(arg):
            i, (ci, cv) = arg
            dt = _elem(i)
            d = zstandard.ZstdDecompressor()
            o = out[i.start : i.end]
            o[:] = base[i.start : i.end]
            idx = np.frombuffer(d.decompress(ci), dtype=np.int32 if i.nbytes // dt.itemsize < 2**31 else np.int64)
            o.view(dt)[idx] = np.frombuffer(d.decompress(cv), dtype=dt)

        t0 = time.perf_counter()
        _pmap(dec_one, list(zip(infos, blobs)), threads)
        dec = time.perf_counter() - t0
        _check(out, pair, bh)
    finally:
        p.unlink(missing_ok=True)
    return Result(size, enc, dec)


# --- ZipNN on the XOR delta -------------------------------------------------------------------


def zipnn_xor(pair: Pair, work: Path, threads: int) -> Result:
    import zipnn

    bh, base = _tensors(pair.base)
    _, tgt = _tensors(pair.target)
    infos = list(bh.tensors.values())
    zb = zipnn.ZipNN(input_format="byte", bytearray_dtype="bfloat16", threads=threads)

    def enc_one(i):
        x = np.bitwise_xor(base[i.start : i.end], tgt[i.start : i.end])
        if i.dtype == "BF16":
            return zb.compress(x.tobytes())
        return zstandard.ZstdCompressor(level=3).compress(x)  # zipnn's byte modes are for floats

    t0 = time.perf_counter()
    blobs = [enc_one(i) for i in infos]  # zipnn threads internally
    enc = time.perf_counter() - t0
    size = sum(len(b) for b in blobs)
    p, out = _out_file(pair.raw_bytes)
    try:
        out[: bh.data_start] = base[: bh.data_start]
        t0 = time.perf_counter()
        for i, blob in zip(infos, blobs):
            x = zb.decompress(blob) if i.dtype == "BF16" else zstandard.ZstdDecompressor().decompress(blob)
            np.bitwise_xor(base[i.start : i.end], np.frombuffer(x, dtype=np.uint8), out=out[i.start : i.end])
        dec = time.perf_counter() - t0
        _check(out, pair, bh)
    finally:
        p.unlink(missing_ok=True)
    return Result(size, enc, dec)


# --- bdn_planes_v1, bdn ------------------------------------------------------------------------


def planes_bdn(pair: Pair, work: Path, threads: int) -> Result:
    return arc_bdn(pair, work, threads, "bdn_planes_v1")  # a named function: codecs run in a child process


CODECS: dict[str, Callable[[Pair, Path, int], Result]] = {
    "arc_v2 (bdn)": arc_bdn,
    "arc_v2 (fireworks)": arc_fireworks,
    "sparse+zstd (TRL layout)": sparse_zstd,
    "zipnn(xor)": zipnn_xor,
    "bdn_planes_v1 (bdn)": planes_bdn,
}
