"""Issue 31, class 5: full storage. Each test mounts its own small tmpfs (root only; skipped
otherwise) and unmounts it after:

- every byte a snapshot takes is counted up front (its files page-rounded, READY, the restart
  record, progress) and the small files' bytes are held from the start: a snapshot that does not
  fit is refused at once with the numbers ("no space in shm ..."), nothing fetched; one that fits
  reaches READY even when someone else fills the tmpfs during the download;
- inodes are counted too: "no inodes in shm ... needs N inodes ..., M are free";
- a tmpfs too full for the store's directories: bdnd exits 2 with one line, no traceback;
- "cannot save progress" is written once per ``log_repeat_s``, not per save.

Real bdnd processes, real files, a file:// bucket."""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from bdn.proto.chunks import digest
from bdn.proto.keys import derive_keys
from bdn.proto.manifest import MANIFEST_NAME
from support.api import wait_for
from support.swarm import SECRET, Daemon

PAGE = 4096
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs (root only)")


@contextmanager
def tmpfs(where: Path, size: int, inodes: int) -> Iterator[Path]:
    where.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},nr_inodes={inodes}", "tmpfs", str(where)],
        capture_output=True,
        text=True,
        check=False,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {r.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def remount(where: Path, size: int) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(where)], check=True)


def free(where: Path) -> tuple[int, int]:
    st = os.statvfs(where)
    return st.f_bavail * st.f_frsize, st.f_favail


def fill(path: Path) -> int:
    """Write ``path`` until the file system is out of bytes; the bytes written."""
    n = 0
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                n += f.write(b"\1" * PAGE)
        except OSError as e:
            assert e.errno == errno.ENOSPC
    return n


def publish_raw(bucket: Path, identity: str, files: dict[str, bytes], chunk_size: int) -> None:
    snap = bucket / identity
    snap.mkdir(parents=True)
    entries = []
    for name, data in sorted(files.items()):
        (snap / name).parent.mkdir(parents=True, exist_ok=True)
        (snap / name).write_bytes(data)
        chunks = [digest(data[i : i + chunk_size]) for i in range(0, len(data), chunk_size)]
        entries.append({"path": name, "size": len(data), "chunks": chunks})
    m = {
        "format": "bdn.snapshot/1",
        "identity": identity,
        "kind": "full",
        "policy_version": 1,
        "created_at": "2026-12-06T00:00:00Z",
        "chunk_size": chunk_size,
        "files": entries,
    }
    (snap / MANIFEST_NAME).write_text(json.dumps(m, indent=1, sort_keys=True) + "\n")


def daemon(tmp_path: Path, bucket: Path, shm: Path, **env: str) -> Daemon:
    d = Daemon(
        tmp_path / "nodes",
        "n0",
        f"file://{bucket}",
        extra_env={"BDN_LOAD_STARTUP": "false", "BDN_STARTUP_SETTLE_S": "0", "BDN_SHM_DIR": str(shm), **env},
    )
    d.shm_dir = shm
    return d


def test_bytes_of_ready_record_and_progress_are_reserved(tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    data = os.urandom(2 << 20)  # 512 chunks of 4 KiB: READY and the record are ~21 KB each
    publish_raw(bucket, "step000001", {"model.bin": data}, 4096)
    with tmpfs(tmp_path / "mnt", 64 << 20, 1000) as mnt:
        d = daemon(tmp_path, bucket, mnt / "shm", BDN_BUCKET_MBIT="4", BDN_PROGRESS_INTERVAL_S="0.1")
        try:
            d.start([])
            d.wait_healthy()
            # room for the file and a few pages: the small files do not fit, so it is refused
            # before anything is fetched (it used to download all of it and fail writing READY)
            used = (64 << 20) - free(mnt)[0]
            remount(mnt, used + len(data) + 4 * PAGE)
            assert d.prefetch("step000001")[0] in (200, 202, 409, 422, 507)
            rec = d.wait_settled("step000001")
            assert rec["state"] == "failed", rec
            assert rec["reason"].startswith("no space in shm: snapshot 'step000001' needs "), rec
            assert f"({len(data)} of files, " in rec["reason"] and "of READY, record and progress)" in rec["reason"], (
                rec
            )
            assert d.status()["counters"]["bucket_bytes_owner"] == 0

            # room for all of it plus 3 pages; once the download runs someone else fills the
            # rest: progress, READY and the record are written in the bytes held for them
            remount(mnt, used + len(data) + 30 * PAGE)
            assert d.prefetch("step000001")[0] in (200, 202)
            wait_for(lambda: d.get("/v1/snapshots/step000001")["state"] != "queued", 120, "the download")
            assert fill(mnt / "someone-else") > 0
            rec = d.wait_settled("step000001", timeout=300)
            assert rec["state"] == "ready", (rec, d.log()[-3000:])
            assert (d.store / "step000001" / "model.bin").read_bytes() == data
            assert "cannot save progress" not in d.log()
            assert d.get("/v1/health")["status"] == "ok"
        finally:
            d.stop()


def test_no_inodes_is_reported_as_such(tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    files = {f"d{i % 3}/f{i:03d}.txt": f"file {i}\n".encode() for i in range(60)}
    publish_raw(bucket, "step000001", files, 4096)
    with tmpfs(tmp_path / "mnt", 16 << 20, 50) as mnt:
        d = daemon(tmp_path, bucket, mnt / "shm")
        try:
            d.start([])
            d.wait_healthy()
            assert d.prefetch("step000001")[0] in (200, 202, 409, 422, 507)
            rec = d.wait_settled("step000001")
            assert rec["state"] == "failed", rec
            left = free(mnt)[1]  # 60 files, the staging directory and its 3, READY, record, 2 progress, reserve
            m = re.fullmatch(
                r"no inodes in shm: snapshot 'step000001' needs 69 inodes \(files and directories\), "
                r"(\d+) are free on (.+)",
                rec["reason"],
            )
            assert m is not None and m.group(2) == str(d.store), rec
            # (the count of the moment: the daemon's own small files, such as the engine table
            # rewritten through a temporary file, may hold an inode then and not now)
            assert abs(int(m.group(1)) - left) <= 2, (rec, left)
            assert d.get("/v1/health")["status"] == "ok"
        finally:
            d.stop()


def test_a_full_tmpfs_at_start_exits_2_with_one_line(tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    with tmpfs(tmp_path / "mnt", 64 << 10, 16) as mnt:
        shm = mnt / "shm"
        shm.mkdir()
        (shm / "bdnd.lock").write_text("")  # a daemon ran here before
        n = 0
        try:
            while True:
                (mnt / f"x{n}").touch()
                n += 1
        except OSError as e:
            assert e.errno == errno.ENOSPC
        d = daemon(tmp_path, bucket, shm)
        r = subprocess.run(
            [sys.executable, "-m", "bdn.daemon.main"],
            env=d.env,
            capture_output=True,
            text=True,
            check=False,
            timeout=300,
        )
        assert r.returncode == 2, (r.returncode, r.stderr)
        store = shm / derive_keys(SECRET).swarm_id
        want = (
            f"bdnd: error: shm_dir {str(shm)!r} is full, bdnd cannot create its store {store}: "
            f"{free(shm)[0]} of {64 << 10} bytes, 0 of 16 inodes free on {shm} (free some, or give it a larger tmpfs)"
        )
        assert r.stderr.strip().splitlines() == [want], r.stderr


def test_cannot_save_progress_is_rate_limited(tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    publish_raw(bucket, "step000001", {"model.bin": os.urandom(1 << 20)}, 4096)
    d = daemon(tmp_path, bucket, tmp_path / "shm", BDN_BUCKET_MBIT="1", BDN_PROGRESS_INTERVAL_S="0.02")
    try:
        d.start([])
        d.wait_healthy()
        progress = d.store / ".progress"
        assert d.prefetch("step000001")[0] in (200, 202)
        wait_for(lambda: d.get("/v1/snapshots/step000001")["state"] == "downloading", 120, "the download")
        for p in progress.iterdir():
            p.unlink()
        progress.rmdir()
        progress.write_text("not a directory")  # every save fails from now on
        wait_for(lambda: "cannot save progress" in d.log(), 60, "a failed save logged")
        saves = wait_for(lambda: d.get("/v1/snapshots/step000001")["bytes_done"] > (512 << 10), 120, "more saves")
        assert saves
        assert d.log().count("cannot save progress") <= 2, d.log().count("cannot save progress")
    finally:
        d.stop()
