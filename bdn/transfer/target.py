"""Target files for the transfer client: reserved on tmpfs and mapped with their page tables
populated up front.

Why populate: receiving into a fresh mapping of a tmpfs file takes one minor page fault per 4 KiB
page the kernel's copy first touches (262,144 faults per GiB), which measured as a large share of
the receiver's CPU. ``MADV_POPULATE_WRITE`` (Linux 5.14+) maps every page writable in one call,
without the trap per page; on older kernels ``MAP_POPULATE`` does the same for a shared mapping.

Huge pages: bench/transfer measured that 2 MiB tmpfs pages (a tmpfs mounted ``huge=within_size``,
or ``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` set to ``within_size``/``advise``) cut
the sender's ``sendfile`` CPU by a third (one page-cache lookup per 2 MiB instead of per 4 KiB)
and the receiver's page-table work; the mapping asks for them (``MADV_HUGEPAGE``), which only
matters where shmem_enabled is ``advise``.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from typing import Any

MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # <linux/mman.h>; not in 3.11's mmap


def reserve(fd: int, size: int) -> None:
    """Allocate ``size`` bytes of the open file ``fd`` now (``posix_fallocate``), so a full tmpfs
    fails here with ``OSError(ENOSPC)`` instead of a SIGBUS when a received byte lands."""
    if size:
        os.posix_fallocate(fd, 0, size)


POPULATE_STEP = 16 << 20  # bytes populated per madvise call (a multiple of any page size)
#: Set when the process stops: a page-table fill in progress ends at its next step (it only
#: saves page faults later; a stopping daemon would wait seconds for a GiB-sized target).
STOPPING = threading.Event()


def map_target(fd: int, size: int, *, populate: bool = True) -> mmap.mmap:
    """A shared writable mapping of the first ``size`` bytes of the open file ``fd`` (reserve
    them first), with its page tables filled when ``populate``.

    Raises:
        OSError: the mapping could not be made.
    """
    m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    if size and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE)  # used where shmem_enabled is "advise"; ignored elsewhere
        except OSError:
            pass
    if populate and size:
        try:
            _populate(m, size)
        except OSError:  # kernel before 5.14: map again with MAP_POPULATE
            m.close()
            m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return m


def _libc_madvise() -> Any:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _libc_madvise()


def _populate(m: mmap.mmap, size: int) -> None:
    """``MADV_POPULATE_WRITE`` over the mapping, in ``POPULATE_STEP`` pieces. Through libc's
    ``madvise`` by ctypes, which releases the GIL for the call: the kernel zeroes every fresh
    page here (1 GiB: ~0.1-0.3 s of CPU), and ``mmap.madvise`` held the GIL throughout, so the
    event loop and every transfer thread stood still meanwhile (11 % of the GIL's time in a
    daemon of an 8-node swarm, py-spy --gil). Raises OSError (EINVAL: a kernel
    before 5.14)."""
    if _MADVISE is None:
        for start in range(0, size, POPULATE_STEP):
            if STOPPING.is_set():
                return
            m.madvise(MADV_POPULATE_WRITE, start, min(POPULATE_STEP, size - start))
        return
    view = (ctypes.c_char * size).from_buffer(m)
    try:
        base = ctypes.addressof(view)
    finally:
        del view  # the mapping must not stay exported (close() refuses while it is)
    for start in range(0, size, POPULATE_STEP):
        if STOPPING.is_set():
            return
        if _MADVISE(base + start, min(POPULATE_STEP, size - start), MADV_POPULATE_WRITE) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
