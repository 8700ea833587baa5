"""How fast can this machine put 1 GiB into fresh tmpfs pages, whatever the program?

A receiving bdnd lands every chunk in a new file in /dev/shm. Before a byte of the network is
counted, the kernel must allocate and zero each 4 KiB page of that file and map it, and on this
VM (Firecracker with free page reporting) a page the guest freed earlier was handed back to the
host, so touching it again also costs a host fault. iperf3 never pays any of this: it receives
into one 128 KiB buffer that stays in cache. This microbenchmark measures that cost alone, in
one thread, no network, no Python on the byte path beyond one call per 16 MiB piece:

- ``memcpy hot``: copy into a buffer already written once (pages mapped, the floor of any copy);
- ``memcpy into reused tmpfs mapping``: the same into a tmpfs file's mapping whose pages exist;
- ``fresh tmpfs: fallocate + POPULATE_WRITE``: only reserving and mapping a fresh file (what
  bdn.transfer.target does before the first byte arrives), no copy;
- ``fresh tmpfs: fallocate + POPULATE_WRITE + memcpy``: that plus the copy (bdnd's mapping path);
- ``fresh tmpfs: mmap + memcpy (page faults)``: no populate, one fault per page;
- ``fresh tmpfs: pwrite``: ``pwrite`` of 1 MiB pieces from a hot buffer (a full-page write skips
  the zeroing; bdn.transfer's fd path);
- ``fresh tmpfs: fallocate + pwrite``: the same into a reserved file (bdnd's store reserves);
- ``just-freed tmpfs pages: ...``: the mapping path into pages a file freed a moment before, not
  yet reported to the host (the zeroing and mapping without the host's fault);
- ``fresh anonymous: memcpy``: a fresh private mapping (what a client's new numpy array costs);
- ``xxh3-128 hot``: hashing the bytes once (bdn verifies every chunk).

Each case runs on a fresh file (unlinked after), ``--runs`` times; rows give the median and
min-max of GB/s (GiB moved / wall seconds) and of CPU-seconds per GiB (this process's
user+system, ``getrusage``; the kernel's page work is charged to the faulting thread).

    .venv/bin/python -m bench.transfer.pagefill --runs 3      # bench/results/pagefill.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import xxhash

from bdn.transfer.target import MADV_POPULATE_WRITE, POPULATE_STEP

PIECE = 16 << 20


def cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def copy_into(dst: memoryview | mmap.mmap, src: np.ndarray) -> None:
    d = np.frombuffer(dst, dtype=np.uint8)
    for off in range(0, len(src), PIECE):
        np.copyto(d[off : off + PIECE], src[off : off + PIECE])


def fresh_file(work: Path, size: int) -> int:
    p = work / "target"
    if p.exists():
        p.unlink()
    fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.unlink(p)  # freed when closed: the next case starts fresh again
    return fd


def populate(m: mmap.mmap, size: int) -> None:
    for start in range(0, size, POPULATE_STEP):
        m.madvise(MADV_POPULATE_WRITE, start, min(POPULATE_STEP, size - start))


def cases(work: Path, size: int, src: np.ndarray) -> dict[str, Callable[[], Callable[[], None]]]:
    """name -> setup() returning the timed run() (setup is outside the clock)."""
    hot = np.empty(size, dtype=np.uint8)
    hot.fill(1)
    reused_fd = fresh_file(work, size)
    os.posix_fallocate(reused_fd, 0, size)
    reused = mmap.mmap(reused_fd, size, flags=mmap.MAP_SHARED)
    populate(reused, size)
    copy_into(reused, src)
    ring = bytearray(1 << 20)

    def memcpy_hot() -> Callable[[], None]:
        return lambda: np.copyto(hot, src)

    def memcpy_reused() -> Callable[[], None]:
        return lambda: copy_into(reused, src)

    def fresh_populate(copy: bool) -> Callable[[], Callable[[], None]]:
        def setup() -> Callable[[], None]:
            fd = fresh_file(work, size)

            def run() -> None:
                os.posix_fallocate(fd, 0, size)
                m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
                populate(m, size)
                if copy:
                    copy_into(m, src)
                m.close()
                os.close(fd)

            return run

        return setup

    def fresh_faults() -> Callable[[], None]:
        fd = fresh_file(work, size)

        def run() -> None:
            os.posix_fallocate(fd, 0, size)
            m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
            copy_into(m, src)
            m.close()
            os.close(fd)

        return run

    def fresh_pwrite() -> Callable[[], None]:
        fd = fresh_file(work, size)
        view = memoryview(src)

        def run() -> None:
            for off in range(0, size, len(ring)):
                os.pwrite(fd, view[off : off + len(ring)], off)
            os.close(fd)

        return run

    def fresh_falloc_pwrite() -> Callable[[], None]:
        fd = fresh_file(work, size)
        view = memoryview(src)

        def run() -> None:
            os.posix_fallocate(fd, 0, size)
            for off in range(0, size, len(ring)):
                os.pwrite(fd, view[off : off + len(ring)], off)
            os.close(fd)

        return run

    def refill_populate() -> Callable[[], None]:
        # pages freed a moment ago (still in the guest's free lists, not yet reported to the
        # host): what the zeroing and mapping cost without a host fault
        fd = fresh_file(work, size)
        os.posix_fallocate(fd, 0, size)
        os.close(fd)
        return fresh_populate(True)()

    def fresh_anon() -> Callable[[], None]:
        def run() -> None:
            a = np.empty(size, dtype=np.uint8)
            np.copyto(a, src)
            del a

        return run

    def hash_hot() -> Callable[[], None]:
        def run() -> None:
            h = xxhash.xxh3_128()
            for off in range(0, size, PIECE):
                h.update(memoryview(hot)[off : off + PIECE])

        return run

    return {
        "memcpy hot": memcpy_hot,
        "memcpy into reused tmpfs mapping": memcpy_reused,
        "fresh tmpfs: fallocate + POPULATE_WRITE": fresh_populate(False),
        "fresh tmpfs: fallocate + POPULATE_WRITE + memcpy": fresh_populate(True),
        "fresh tmpfs: mmap + memcpy (page faults)": fresh_faults,
        "fresh tmpfs: pwrite": fresh_pwrite,
        "fresh tmpfs: fallocate + pwrite": fresh_falloc_pwrite,
        "just-freed tmpfs pages: fallocate + POPULATE_WRITE + memcpy": refill_populate,
        "fresh anonymous: memcpy": fresh_anon,
        "xxh3-128 hot": hash_hot,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", default="/dev/shm/bdn-bench-pagefill", help="a directory on the tmpfs to measure")
    ap.add_argument("--out", default="bench/results/pagefill.json")
    ap.add_argument(
        "--settle-s",
        type=float,
        default=3.0,
        help="seconds between cases (free page reporting hands freed memory back to the host meanwhile)",
    )
    a = ap.parse_args()
    size = int(a.size_gib * 2**30) // PIECE * PIECE
    work = Path(a.dir)
    work.mkdir(parents=True, exist_ok=True)
    src = np.frombuffer(np.random.default_rng(1).bytes(16 << 20), dtype=np.uint8)
    src = np.tile(src, size // len(src))  # pre-faulted, random-looking
    load0 = os.getloadavg()
    table = cases(work, size, src)
    raw: dict[str, list[tuple[float, float]]] = {k: [] for k in table}
    for r in range(a.runs):
        for name, setup in table.items():  # interleaved: load hits every case alike
            time.sleep(a.settle_s)  # let freed pages of the case before go back to the host
            run = setup()
            c0, t0 = cpu_s(), time.perf_counter()
            run()
            t1, c1 = time.perf_counter(), cpu_s()
            raw[name].append((size / (t1 - t0) / 2**30, (c1 - c0) / (size / 2**30)))
            print(
                f"[run {r + 1}] {name}: {raw[name][-1][0]:.2f} GiB/s, {raw[name][-1][1]:.3f} CPU-s/GiB",
                file=sys.stderr,
                flush=True,
            )
    rows = []
    for name, vals in raw.items():
        g = [v[0] for v in vals]
        c = [v[1] for v in vals]
        rows.append(
            {
                "case": name,
                "runs": len(vals),
                "GiB_per_s": round(statistics.median(g), 3),
                "GiB_per_s_min": round(min(g), 3),
                "GiB_per_s_max": round(max(g), 3),
                "cpu_s_per_GiB": round(statistics.median(c), 3),
                "cpu_s_per_GiB_min": round(min(c), 3),
                "cpu_s_per_GiB_max": round(max(c), 3),
            }
        )
    out = {
        "size_bytes": size,
        "dir": str(work),
        "loadavg_before": load0,
        "loadavg_after": os.getloadavg(),
        "shmem_enabled": Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text().strip(),
        "kernel": os.uname().release,
        "rows": rows,
    }
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    for r in rows:
        print(
            f"{r['case']:52s} {r['GiB_per_s']:6.2f} GiB/s ({r['GiB_per_s_min']:.2f}-{r['GiB_per_s_max']:.2f})"
            f"  {r['cpu_s_per_GiB']:.3f} CPU-s/GiB ({r['cpu_s_per_GiB_min']:.3f}-{r['cpu_s_per_GiB_max']:.3f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
