"""bdn.transfer.target: reserved, populated target mappings on tmpfs."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess

import pytest

from bdn.transfer.target import map_target, reserve
from support.transfer import shm_tmpdir


def test_reserved_populated_mapping_writes_through_to_the_file():
    d = shm_tmpdir()
    try:
        fd = os.open(d / "t", os.O_RDWR | os.O_CREAT, 0o600)
        reserve(fd, 3 << 20)
        assert os.fstat(fd).st_size == 3 << 20
        m = map_target(fd, 3 << 20)
        m[(1 << 20) : (1 << 20) + 5] = b"hello"
        m.flush()
        assert os.pread(fd, 5, 1 << 20) == b"hello"
        m.close()
        os.close(fd)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_reserve_on_a_full_tmpfs_fails_there_not_later(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, check=False
    ).returncode:
        pytest.skip("cannot mount a small tmpfs here (not root)")
    try:
        fd = os.open(mnt / "t", os.O_RDWR | os.O_CREAT, 0o600)
        with pytest.raises(OSError) as e:
            reserve(fd, 4 << 20)
        assert e.value.errno == errno.ENOSPC
        os.close(fd)
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_a_stopping_process_fills_no_more_page_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 12, item 2 (shutdown at any moment): filling a big target's page tables is cut short
    once the daemon stops (``STOPPING``, set by ``App.shutdown``); the stop waited for the disk
    worker's whole fill before (3.5-9.6 s for a 4 GB target, bench/manifest_lag; 0.12 s now)."""
    import mmap as _mmap

    from bdn.transfer import target

    calls: list[int] = []

    def fake(addr: int, length: int, advice: int) -> int:
        calls.append(length)
        if len(calls) == 2:
            target.STOPPING.set()  # the stop comes while the fill runs
        return 0

    monkeypatch.setattr(target, "_MADVISE", fake)
    monkeypatch.setattr(target, "STOPPING", type(target.STOPPING)())  # this test's own flag
    m = _mmap.mmap(-1, 8 * target.POPULATE_STEP)
    try:
        target._populate(m, 8 * target.POPULATE_STEP)
    finally:
        m.close()
    assert calls == [target.POPULATE_STEP] * 2  # not the 8 steps of the whole mapping
