"""bdn.transfer.target: reserved, populated target mappings on tmpfs."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess

import pytest
from support.transfer import shm_tmpdir

from bdn.transfer.target import map_target, reserve


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
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, check=False).returncode:
        pytest.skip("cannot mount a small tmpfs here (not root)")
    try:
        fd = os.open(mnt / "t", os.O_RDWR | os.O_CREAT, 0o600)
        with pytest.raises(OSError) as e:
            reserve(fd, 4 << 20)
        assert e.value.errno == errno.ENOSPC
        os.close(fd)
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
