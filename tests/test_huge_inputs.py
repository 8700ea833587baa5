"""Issue 31, class 4: huge inputs are parsed and indexed off the event loop. One real bdnd takes
a snapshot of 30,000 files, one of them a safetensors file with a header of about 16 MB (past the
4 MiB from which the header is checked in a child process), and goes through everything that reads them: the download to READY (the header
checked by both parsers), the file listing, the first tensor pull (the tensor index), and a
restart (the store's record of the manifest parsed again). The daemon's own lateness probe
(``bdn.daemon.observe.looplag``: the part of each lateness the loop thread's own CPU time accounts for,
so a loaded machine does not count) stays under 100 ms throughout; it is read from ``/metrics``
every half second by a thread of the test. Waits are on states with generous deadlines.

The sizes are the smallest that keep the test meaningful: everything the daemon builds from the
manifest (the file table, READY, the listing, the store's record) grows linearly with the files,
and the last loop stall found here (READY and the spares' tags read on the loop: 1.1 s at 100,000
files on CI) would be about 330 ms at 30,000, over three times the bound; the header, parsed on
the loop before its child-process check (a 98 MB one kept the loop seconds late), would take
hundreds of ms at 16 MB, and the tensor index of 200,000 tensors likewise. The manifest's limit
itself (100,000 files) is refused or accepted by ``bdn.proto.manifest``'s own tests."""

from __future__ import annotations

import json
import struct
import threading
import urllib.request
from pathlib import Path

import pytest

from bdn.proto.chunks import digest
from bdn.proto.manifest import MANIFEST_NAME
from support.api import wait_for
from support.swarm import Daemon

pytestmark = pytest.mark.timeout(1500)  # a hang's deadline: 30,000 files take minutes on a loaded machine

N_FILES = 30_000
N_TENSORS = 200_000  # a header of about 16 MB
IDENTITY = "step000001"
LAG = "bdn_event_loop_lag_cpu_max_seconds"


def big_header_file(n: int) -> bytes:
    parts = [f'"layer.{i:08d}.weight":{{"dtype":"U8","shape":[1],"data_offsets":[{i},{i + 1}]}}' for i in range(n)]
    h = ("{" + ",".join(parts) + "}").encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + bytes(i % 251 for i in range(n))


def publish(bucket: Path) -> int:
    """A full snapshot of ``N_FILES`` files written into a file:// bucket: one big-header
    safetensors file, a config, the rest empty (no chunks: the test is about the tables, not the
    bytes). Returns the manifest's size."""
    snap = bucket / IDENTITY
    snap.mkdir(parents=True)
    st = big_header_file(N_TENSORS)
    files = {"model.safetensors": st, "config.json": b"{}"}
    entries = []
    for name, data in files.items():
        (snap / name).write_bytes(data)
        chunk = 16 << 20
        entries.append(
            {
                "path": name,
                "size": len(data),
                "chunks": [digest(data[i : i + chunk]) for i in range(0, len(data), chunk)],
            }
        )
    for i in range(N_FILES - len(files)):
        name = f"extra/{i // 1000:03d}/{i:06d}.txt"
        (snap / name).parent.mkdir(parents=True, exist_ok=True)
        (snap / name).touch()
        entries.append({"path": name, "size": 0, "chunks": []})
    m = {
        "format": "bdn.snapshot/1",
        "identity": IDENTITY,
        "kind": "full",
        "policy_version": 1,
        "created_at": "2026-12-06T00:00:00Z",
        "chunk_size": 16 << 20,
        "files": entries,
    }
    data = (json.dumps(m, indent=1, sort_keys=True) + "\n").encode()
    (snap / MANIFEST_NAME).write_bytes(data)
    return len(data)


class LagWatch:
    """Reads the daemon's lag metric every half second on a thread; ``worst`` is the largest."""

    def __init__(self, d: Daemon) -> None:
        self.d = d
        self.worst = 0.0
        self.samples = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            try:
                with urllib.request.urlopen(self.d.url + "/metrics", timeout=60) as r:
                    for line in r.read().decode().splitlines():
                        if line.startswith(LAG + " "):
                            self.worst = max(self.worst, float(line.split()[1]))
                            self.samples += 1
            except OSError:
                pass  # between a stop and a start

    def settle(self) -> None:
        """Wait until the metric was read 3 more times: the lag of the steps just taken is in it."""
        after = self.samples + 3
        wait_for(lambda: self.samples, 300, "3 more reads of the loop-lag metric", until=lambda n: n >= after)

    def stop(self) -> float:
        self._stop.set()
        self._t.join(70)
        return self.worst


def test_a_huge_snapshot_never_blocks_the_loop(tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    publish(bucket)
    d = Daemon(
        tmp_path / "nodes",
        "n0",
        f"file://{bucket}",
        extra_env={"BDN_LOAD_STARTUP": "false", "BDN_STARTUP_SETTLE_S": "0", "BDN_LOG_LEVEL": "info"},
    )
    watch: LagWatch | None = None
    try:
        d.start([])
        d.wait_healthy()
        watch = LagWatch(d)
        assert d.prefetch(IDENTITY)[0] in (200, 202)
        rec = d.wait_ready(IDENTITY, timeout=1200)
        assert rec["state"] == "ready"
        status, files = d.request("GET", f"/v1/snapshots/{IDENTITY}/files", timeout=300)
        assert status == 200 and len(files["files"] if isinstance(files, dict) else files) == N_FILES
        status, _ = d.request("GET", f"/v1/snapshots/{IDENTITY}/tensors/layer.00000007.weight", timeout=300)
        assert status == 200
        watch.settle()  # the probes after the last step
        worst_running = watch.stop()
        d.stop()
        d.start([])
        d.wait_healthy(600)
        watch = LagWatch(d)
        assert d.get(f"/v1/snapshots/{IDENTITY}")["state"] == "ready"
        status, _ = d.request("GET", f"/v1/snapshots/{IDENTITY}/tensors/layer.00000008.weight", timeout=300)
        assert status == 200
        watch.settle()
        worst_restarted = watch.stop()
        watch = None
        assert worst_running < 0.1 and worst_restarted < 0.1, (worst_running, worst_restarted)
    finally:
        if watch is not None:
            watch.stop()
        d.stop()
