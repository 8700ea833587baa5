"""bdn.client and bdnctl against real READY directories and a real bdnd.

The Snapshot tests open READY directories written here. Every DaemonClient and bdnctl test talks to
one real bdnd process (module fixture ``bdnd``) on 127.0.0.1 and a unix socket, fed from a file://
bucket that this module publishes into with bdn.publish. The unhappy paths are real too: a delta
manifest naming compression_format "arc_v3" fails the snapshot (409), and a never-published
identity waits for its manifest, so the client's own timeout fires. The bucket is rate-limited
(BDN_BUCKET_MBIT) so that a larger snapshot takes long enough for progress to be observed.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import socket
import struct
import subprocess
import sys
import termios
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file
from tqdm import tqdm

from bdn.cli.bdnctl import main as bdnctl_main
from bdn.client import (
    DaemonClient,
    DaemonError,
    DaemonUnreachable,
    NotPublished,
    SnapshotFailed,
    open_snapshot,
)
from bdn.fileops import chunk_digests as file_digests
from bdn.proto.errors import ChecksumError, IdentityError, ProtocolError
from bdn.publish import publish_delta, publish_full
from support.checkpoints import flip_byte, make_state, write_hf_dir
from support.swarm import Daemon

BDNCTL = Path(sys.executable).parent / "bdnctl"
CHUNK = 4096
SHARD1 = "model-00001-of-00002.safetensors"
SHARD2 = "model-00002-of-00002.safetensors"


def write_ready(directory: Path, identity: str, policy_version: int, *, chunk_size: int = CHUNK) -> None:
    """Write ``directory/READY`` (format bdn.ready/1, README.md) describing every file in ``directory``."""
    files = [
        {"path": p.relative_to(directory).as_posix(), "size": p.stat().st_size, "chunks": file_digests(p, chunk_size)}
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != "READY"
    ]
    (directory / "READY").write_text(
        json.dumps(
            {
                "format": "bdn.ready/1",
                "identity": identity,
                "kind": "full",
                "policy_version": policy_version,
                "base_identity": None,
                "chunk_size": chunk_size,
                "files": files,
            }
        )
    )


def write_checkpoint(d: Path, seed: int) -> dict[str, np.ndarray]:
    """A real two-shard HF checkpoint directory (written by the reference safetensors writer)."""
    rng = np.random.default_rng(seed)
    shard1 = {
        "model.embed_tokens.weight": rng.standard_normal((64, 96), dtype=np.float32).astype(ml_dtypes.bfloat16),
        "model.layers.0.mlp.up_proj.weight": rng.standard_normal((40, 50), dtype=np.float32),
    }
    shard2 = {
        "model.layers.1.input_layernorm.weight": rng.standard_normal(128, dtype=np.float32).astype(ml_dtypes.bfloat16),
        "lm_head.weight": rng.standard_normal((33, 17), dtype=np.float32),
        "model.scale": np.array(1.5, dtype=np.float32),
    }
    d.mkdir(parents=True)
    save_file(shard1, str(d / SHARD1), metadata={"format": "pt"})
    save_file(shard2, str(d / SHARD2), metadata={"format": "pt"})
    weight_map = {name: SHARD1 for name in shard1} | {name: SHARD2 for name in shard2}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 96}))
    return shard1 | shard2


def make_snapshot(root: Path, identity: str, policy_version: int, seed: int) -> tuple[Path, dict[str, np.ndarray]]:
    """A real two-shard HF checkpoint directory + READY."""
    d = root / identity
    arrays = write_checkpoint(d, seed)
    write_ready(d, identity, policy_version, chunk_size=CHUNK)
    return d, arrays


@pytest.fixture
def snap(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    return make_snapshot(tmp_path / "shm", "step000002", 2, seed=1)


# Bucket reads are limited to this many Mbit/s so that SLOW_SCALE's snapshot stays in
# "downloading" across several polls; the small snapshots still arrive in a few ms.
BUCKET_MBIT = 64
SLOW_SCALE = 8  # support.checkpoints.make_state scale: about 9.5 MB of tensors
FAILING = "step000004"  # a delta whose manifest names compression_format "arc_v3"
UNPUBLISHED = "step000005"  # never written to the bucket: prefetch(wait_publish=True) waits for it


@dataclass
class Bdnd:
    """One real bdnd and the bucket it reads; ``ready`` is step000002, loaded before the tests."""

    daemon: Daemon
    bucket: str
    root: Path
    socket: Path
    arrays: dict[str, np.ndarray]
    ready: Path = Path()
    swarm_id: str = ""
    published: set[str] = field(default_factory=set)

    @property
    def url(self) -> str:
        return self.daemon.url

    def snapshot_dir(self, identity: str) -> Path:
        return self.daemon.shm_dir / self.swarm_id / identity

    def publish(self, identity: str, policy_version: int, *, slow: bool = False) -> None:
        """Publish a fresh snapshot (each test its own identity: the daemon is shared)."""
        assert identity not in self.published, identity
        self.published.add(identity)
        src = write_hf_dir(
            self.root / "trainer" / identity,
            make_state(policy_version, scale=SLOW_SCALE if slow else 1),
            policy_version,
        )
        publish_full(self.bucket, identity, policy_version, dir=src, chunk_size=64 << 10)


@pytest.fixture(scope="module")
def bdnd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bdnd]:
    root = tmp_path_factory.mktemp("bdnd")
    bucket = f"file://{root}/bucket"
    arrays = write_checkpoint(root / "trainer" / "step000002", seed=1)
    publish_full(bucket, "step000002", 2, dir=root / "trainer" / "step000002", chunk_size=64 << 10)
    # A real delta whose manifest then claims a compression format bdn does not have.
    base = write_hf_dir(root / "trainer" / "step000003-base", make_state(3), 3)
    publish_full(bucket, "step000001", 1, dir=base, chunk_size=64 << 10)
    nxt = write_hf_dir(root / "trainer" / FAILING, make_state(4), 4)
    publish_delta(bucket, FAILING, 4, "step000001", dir=nxt, base_dir=base, chunk_size=64 << 10)
    manifest = root / "bucket" / FAILING / "bdn.manifest.json"
    m = json.loads(manifest.read_text())
    assert m["compression_format"] == "arc_v2"
    m["compression_format"] = "arc_v3"
    manifest.write_text(json.dumps(m))
    sock = root / "bdnd.sock"
    daemon = Daemon(
        root / "nodes",
        "client-node",
        bucket,
        extra_env={
            "BDN_LOAD_STARTUP": "false",
            "BDN_LOCAL_SOCKET": str(sock),
            "BDN_MANIFEST_WAIT_S": "3600",
            "BDN_BUCKET_MBIT": str(BUCKET_MBIT),
            # Shared by every test, each publishing its own snapshot: GC (keep 2 newest after a 60 s
            # grace) would drop step000002, which later tests read, once the module runs past 60 s.
            "BDN_KEEP_READY": "1000",
        },
    )
    b = Bdnd(daemon, bucket, root, sock, arrays, published={"step000001", "step000002", FAILING})
    try:
        daemon.start([])
        daemon.wait_healthy()
        status, body = daemon.prefetch("step000002")
        assert status == 202, body
        b.ready = Path(daemon.wait_ready("step000002", timeout=120)["path"])
        b.swarm_id = daemon.get("/v1/health")["swarm_id"]
        assert b.ready == b.snapshot_dir("step000002")
        yield b
    finally:
        daemon.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- Snapshot (zero-copy directory access) -------------------------------------------------------


def test_open_snapshot_tensors_bit_exact_and_zero_copy(snap: tuple[Path, dict[str, np.ndarray]]) -> None:
    d, arrays = snap
    with open_snapshot(d) as s:
        assert (s.identity, s.policy_version, s.kind) == ("step000002", 2, "full")
        assert sorted(s.files()) == sorted(["config.json", "model.safetensors.index.json", SHARD1, SHARD2])
        assert sorted(s.tensor_names()) == sorted(arrays)
        for name, src in arrays.items():
            got = s.tensor(name)
            assert got.dtype == src.dtype, name
            assert got.shape == src.shape, name
            assert got.tobytes() == src.tobytes(), name
            assert not got.flags.writeable and not got.flags.owndata
        assert s.tensor("model.embed_tokens.weight").dtype == np.dtype(ml_dtypes.bfloat16)
        assert s.tensor_file("lm_head.weight") == SHARD2
        all_t = s.tensors()
        assert set(all_t) == set(arrays)
        with pytest.raises(KeyError, match="no tensor 'nope'"):
            s.tensor("nope")


def test_tensor_views_share_the_mapped_file(snap: tuple[Path, dict[str, np.ndarray]]) -> None:
    d, arrays = snap
    with open_snapshot(d) as s:
        view = s.tensor("model.layers.0.mlp.up_proj.weight")
        info_file = d / SHARD1
        # Find the tensor's bytes in the file and change one: the existing view must see it.
        data = info_file.read_bytes()
        offset = data.index(arrays["model.layers.0.mlp.up_proj.weight"].tobytes())
        flip_byte(info_file, offset, 0x01)
        assert view.tobytes() != arrays["model.layers.0.mlp.up_proj.weight"].tobytes()


def test_verify_passes_then_catches_a_flipped_byte(snap: tuple[Path, dict[str, np.ndarray]]) -> None:
    d, _ = snap
    with open_snapshot(d) as s:
        s.verify()
    flip_byte(d / SHARD1, CHUNK + 10, 0x01)  # inside chunk 1
    with open_snapshot(d) as s, pytest.raises(ChecksumError) as exc:
        s.verify()
    msg = str(exc.value)
    assert SHARD1 in msg and "chunk 1 " in msg and "\n" not in msg


def test_directory_without_ready_is_refused(tmp_path: Path, snap: tuple[Path, dict[str, np.ndarray]]) -> None:
    d, _ = snap
    (d / "READY").unlink()
    with pytest.raises(ProtocolError, match="no READY marker"):
        open_snapshot(d)
    with pytest.raises(ProtocolError, match="not a directory"):
        open_snapshot(tmp_path / "missing")


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda r: r.update(format="bdn.ready/9"), "format is 'bdn.ready/9'"),
        (lambda r: r.update(identity="../etc"), "identity"),
        (lambda r: r.update(policy_version=True), "policy_version"),
        (lambda r: r["files"][0].update(path="../x"), r"files\[0\]"),
        (lambda r: r["files"][0]["chunks"].append("0" * 32), "chunk digests"),
    ],
)
def test_invalid_ready_is_refused_in_one_line(snap, mutate, match) -> None:  # type: ignore[no-untyped-def]
    d, _ = snap
    ready = json.loads((d / "READY").read_text())
    mutate(ready)
    (d / "READY").write_text(json.dumps(ready))
    with pytest.raises(ProtocolError, match=match) as exc:
        open_snapshot(d)
    assert "\n" not in str(exc.value)


def test_resized_file_and_inconsistent_index_are_refused(snap: tuple[Path, dict[str, np.ndarray]]) -> None:
    d, _ = snap
    with open(d / "config.json", "ab") as f:
        f.write(b" ")
    with pytest.raises(ProtocolError, match="config.json has"):
        open_snapshot(d)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["lm_head.weight"] = SHARD1
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    write_ready(d, "step000002", 2, chunk_size=CHUNK)
    with pytest.raises(ProtocolError, match="'lm_head.weight' is mapped to .* but is in"):
        open_snapshot(d)
    del index["weight_map"]["lm_head.weight"]
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    write_ready(d, "step000002", 2, chunk_size=CHUNK)
    with pytest.raises(ProtocolError, match="'lm_head.weight' .* missing from weight_map"):
        open_snapshot(d)


def test_tensor_in_two_shards_is_refused_naming_both(snap: tuple[Path, dict[str, np.ndarray]]) -> None:
    d, arrays = snap
    (d / "model.safetensors.index.json").unlink()
    save_file({"lm_head.weight": arrays["lm_head.weight"]}, str(d / "extra.safetensors"))
    write_ready(d, "step000002", 2)
    with pytest.raises(ProtocolError) as exc:
        open_snapshot(d)
    assert str(exc.value) == f"{d}: tensor 'lm_head.weight' is in both extra.safetensors and {SHARD2}"


def test_close_releases_mappings(snap: tuple[Path, dict[str, np.ndarray]]) -> None:
    d, arrays = snap
    s = open_snapshot(d)
    kept = s.tensor("lm_head.weight")
    s.tensor("model.scale")
    s.close()
    assert s.closed
    with pytest.raises(ValueError, match="closed"):
        s.tensor("lm_head.weight")
    del kept  # the mapping it pinned goes with it


# -- DaemonClient ---------------------------------------------------------------------------------


def test_health_status_snapshots_over_tcp_and_unix_socket(bdnd: Bdnd) -> None:
    for url in (bdnd.url, f"unix://{bdnd.socket}"):
        with DaemonClient(url) as c:
            assert c.health()["status"] == "ok"
            assert c.status()["node_id"] == "client-node"
            assert "step000002" in [s["identity"] for s in c.snapshots()]
            one = c.snapshot("step000002")
            assert one["state"] == "ready" and one["policy_version"] == 2
            assert one["path"] == str(bdnd.ready)
            # keep-alive: the same connection serves several requests
            assert c.snapshot("step000002")["identity"] == "step000002"


def test_read_file_with_range(bdnd: Bdnd) -> None:
    d = bdnd.ready
    data = (d / SHARD1).read_bytes()
    with DaemonClient(bdnd.url) as c:
        assert c.read_file("step000002", SHARD1) == data
        assert c.read_file("step000002", SHARD1, offset=100, length=5000) == data[100:5100]
        assert c.read_file("step000002", SHARD1, offset=len(data) - 7) == data[-7:]
        assert c.read_file("step000002", SHARD1, 3, 0) == b""
        assert {f["path"] for f in c.list_files("step000002")} == set(open_snapshot(d).files())
        with pytest.raises(DaemonError) as exc:
            c.read_file("step000002", "nope.bin")
        assert exc.value.status == 404 and str(exc.value) == "snapshot 'step000002' has no file 'nope.bin'"


def test_read_tensor(bdnd: Bdnd) -> None:
    with DaemonClient(bdnd.url) as c:
        for name, src in bdnd.arrays.items():
            got = c.read_tensor("step000002", name)
            assert got.dtype == src.dtype and got.shape == src.shape
            assert got.tobytes() == src.tobytes()
        with pytest.raises(DaemonError) as exc:
            c.read_tensor("step000002", "no.such.tensor")
        assert exc.value.status == 404 and "no.such.tensor" in str(exc.value)


def test_daemon_refuses_a_tensor_named_in_two_shards(bdnd: Bdnd) -> None:
    """One tensor-index rule (bdn.proto.safetensors_fmt.tensor_index) for the client and the daemon:
    a checkpoint naming a tensor in two shards is refused naming both, never served from one."""
    ident = "step000061"
    src = bdnd.root / "trainer" / ident
    src.mkdir(parents=True)
    dup = {"w": np.arange(6, dtype=np.float32)}
    save_file(dup, str(src / SHARD1), metadata={"format": "pt"})
    save_file(dup, str(src / SHARD2), metadata={"format": "pt"})
    bdnd.published.add(ident)
    publish_full(bdnd.bucket, ident, 61, dir=src, chunk_size=64 << 10)
    with DaemonClient(bdnd.url) as c:
        c.prefetch(ident)
        c.wait(ident, "ready", timeout=120)
        with pytest.raises(DaemonError) as exc:
            c.read_tensor(ident, "w")
        assert exc.value.status == 409
        assert SHARD1 in str(exc.value) and SHARD2 in str(exc.value)
        assert c.read_file(ident, SHARD2) == (src / SHARD2).read_bytes()  # the files themselves are served


def test_read_tensor_of_zero_elements_leaves_the_client_usable(bdnd: Bdnd) -> None:
    """Issue 12 item 6: a 0-byte body must not leave the kept-alive connection half-read."""
    src = bdnd.root / "trainer" / "step000043"
    src.mkdir(parents=True)
    save_file(
        {"empty": np.zeros((0, 4), np.float32), "w": np.arange(6, dtype=np.float32)},
        str(src / "model.safetensors"),
        metadata={"format": "pt"},
    )
    bdnd.published.add("step000043")
    publish_full(bdnd.bucket, "step000043", 43, dir=src, chunk_size=64 << 10)
    assert bdnd.daemon.prefetch("step000043")[0] == 202
    bdnd.daemon.wait_ready("step000043", timeout=120)
    for url in (bdnd.url, f"unix://{bdnd.socket}"):
        with DaemonClient(url) as c:
            for _ in range(3):
                empty = c.read_tensor("step000043", "empty")
                assert empty.shape == (0, 4) and empty.dtype == np.float32
                assert c.health()["status"] == "ok"
                assert c.read_tensor("step000043", "w").tolist() == [0, 1, 2, 3, 4, 5]


def test_open_prefetches_an_unknown_identity_and_waits(bdnd: Bdnd) -> None:
    """Issue 12 item 17: open(identity, timeout=...) fetches what the daemon does not know yet."""
    bdnd.publish("step000053", 53)
    with DaemonClient(bdnd.url) as c:
        with pytest.raises(DaemonError) as exc:
            c.snapshot("step000053")
        assert exc.value.status == 404  # not known: nobody asked for it yet
        with c.open("step000053", timeout=120) as s:
            assert s.identity == "step000053" and s.policy_version == 53
        with pytest.raises(DaemonError) as exc:  # without wait, an unknown identity stays unknown
            c.open("step000063", wait=False)
        assert exc.value.status == 404
        with pytest.raises(NotPublished, match=r"step000063 is not published yet \(waited"):
            c.open("step000063", timeout=0.3)  # never published: its manifest never comes (a TimeoutError)
        assert c.snapshot("step000063")["state"] in ("queued", "failed")  # the daemon gives up too
        with pytest.raises(SnapshotFailed, match="arc_v3"):
            c.open(FAILING, timeout=120)
        # a load that failed because the snapshot was not published yet is asked for again
        # (new-user report: open() raised the stale "nothing is published" after publication)
        c.prefetch("step000071")
        with pytest.raises(SnapshotFailed, match="nothing is published"):
            c.wait("step000071", timeout=120)
        bdnd.publish("step000071", 71)
        with c.open("step000071", timeout=120) as s:
            assert s.identity == "step000071" and s.policy_version == 71


def test_daemon_errors_carry_status_and_message(bdnd: Bdnd) -> None:
    with DaemonClient(bdnd.url) as c:
        with pytest.raises(DaemonError) as exc:
            c.snapshot("step999999")
        assert exc.value.status == 404
        assert str(exc.value).startswith("snapshot 'step999999' is not known to this daemon")
        c.prefetch(UNPUBLISHED, wait_publish=True)  # known now, but not ready (its manifest never comes)
        with pytest.raises(DaemonError) as exc:
            c.read_file(UNPUBLISHED, SHARD1)
        assert exc.value.status == 409 and "not ready" in str(exc.value)
        with pytest.raises(IdentityError):
            c.snapshot("../etc")  # refused before anything is sent


def test_prefetch_wait_and_open(bdnd: Bdnd) -> None:
    bdnd.publish("step000003", 3, slow=True)
    seen: list[int] = []
    with DaemonClient(bdnd.url) as c:
        first = c.prefetch("step000003")
        assert first["state"] in ("queued", "downloading")
        ready = c.wait("step000003", timeout=120, poll=0.05, on_update=lambda s: seen.append(s["bytes_done"]))
        assert ready["state"] == "ready" and ready["bytes_done"] == ready["bytes_total"]
        assert seen == sorted(seen) and seen  # progress moved forward
        with c.open("step000003", timeout=120) as s:
            assert s.identity == "step000003" and s.policy_version == 3
            s.verify()


def test_wait_failed_and_timeout(bdnd: Bdnd) -> None:
    with DaemonClient(bdnd.url) as c:
        c.prefetch(FAILING)
        with pytest.raises(SnapshotFailed) as exc:
            c.wait(FAILING, timeout=120, poll=0.05)
        assert "arc_v3" in exc.value.reason and "\n" not in exc.value.reason
        assert exc.value.snapshot is not None and exc.value.snapshot["state"] == "failed"
        assert exc.value.snapshot["reason"] == exc.value.reason
        c.prefetch(UNPUBLISHED, wait_publish=True)
        with pytest.raises(TimeoutError, match=f"{UNPUBLISHED} not ready"):
            c.wait(UNPUBLISHED, timeout=0.3, poll=0.05)


def test_unreachable_daemon() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(DaemonUnreachable, match=f"cannot reach bdnd at {re.escape(url)}: "):
        DaemonClient(url, timeout=5).health()
    with pytest.raises(DaemonUnreachable):
        DaemonClient("unix:///nonexistent/bdnd.sock").health()
    with pytest.raises(ValueError):
        DaemonClient("https://127.0.0.1:1")


# -- bdnctl ---------------------------------------------------------------------------------------


def run_bdnctl(*args: str, url: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "BDN_URL"}
    if url:
        env["BDN_URL"] = url
    return subprocess.run([str(BDNCTL), *args], capture_output=True, text=True, env=env, timeout=240)


def test_bdnctl_snapshots_and_status(bdnd: Bdnd) -> None:
    r = run_bdnctl("snapshots", url=bdnd.url)
    assert r.returncode == 0, r.stderr
    header, *rows = r.stdout.splitlines()
    assert header.split() == ["IDENTITY", "KIND", "POLICY_VERSION", "STATE", "PROGRESS", "PATH"]
    row = next(line for line in rows if line.startswith("step000002 "))
    assert row.split() == ["step000002", "full", "2", "ready", "100%", str(bdnd.ready)]
    r = run_bdnctl("--url", bdnd.url, "--json", "snapshots")
    assert r.returncode == 0
    assert "step000002" in [s["identity"] for s in json.loads(r.stdout)["snapshots"]]
    r = run_bdnctl("status", url=bdnd.url)
    assert r.returncode == 0 and "client-node" in r.stdout and bdnd.bucket in r.stdout
    assert json.loads(run_bdnctl("--json", "status", url=bdnd.url).stdout)["swarm_id"] == bdnd.swarm_id


def test_bdnctl_prefetch_wait_exit_codes(bdnd: Bdnd) -> None:
    bdnd.publish("step000013", 13)
    r = run_bdnctl("prefetch", "step000013", "--wait", "--timeout", "60", url=bdnd.url)
    assert r.returncode == 0, r.stderr
    assert re.fullmatch(
        rf"step000013 ready in [0-9.]+ s: {re.escape(str(bdnd.snapshot_dir('step000013')))}", r.stdout.strip()
    )
    r = run_bdnctl("prefetch", FAILING, "--wait", url=bdnd.url)
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"bdnctl: error: {FAILING} failed: ") and "arc_v3" in last
    r = run_bdnctl("prefetch", UNPUBLISHED, "--wait", "--wait-publish", "--timeout", "0.3", url=bdnd.url)
    assert r.returncode == 1 and f"{UNPUBLISHED} is not published yet (waited " in r.stderr, r.stderr
    r = run_bdnctl("prefetch", "step000006", url=bdnd.url)  # never published: refused at once (exited 0 before)
    assert r.returncode == 1 and "step000006 failed: nothing is published under step000006/" in r.stderr, r
    r = run_bdnctl("--json", "prefetch", UNPUBLISHED, "--wait", "--wait-publish", "--timeout", "0.2", url=bdnd.url)
    assert r.returncode == 1 and json.loads(r.stdout)["exit_code"] == 1


def test_bdnctl_prefetch_shows_progress_bar_on_a_terminal(bdnd: Bdnd) -> None:
    bdnd.publish("step000023", 23, slow=True)  # about a second through the rate-limited bucket
    master, slave = pty.openpty()
    # A fresh pty is 0 columns wide, and tqdm draws nothing into 0 columns.
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO: the terminal's last writer is gone
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    env = {k: v for k, v in os.environ.items() if k != "BDN_URL"}
    proc = subprocess.run(
        [str(BDNCTL), "--url", bdnd.url, "prefetch", "step000023", "--wait"],
        stdout=subprocess.PIPE,
        stderr=slave,
        env=env,
        text=True,
        timeout=240,
    )
    os.close(slave)
    reader.join(10)
    os.close(master)
    bar = b"".join(chunks).decode("utf-8", "replace")
    assert proc.returncode == 0
    assert "step000023:" in bar and "%|" in bar and "downloading" in bar
    assert proc.stdout.startswith("step000023 ready in ")
    # Issue 12 item 15: the bar's "MB" is 10^6 bytes (it divided by 1024 under an "MB" label).
    total = bdnd.daemon.get("/v1/snapshots/step000023")["bytes_total"]
    assert f"/{tqdm.format_sizeof(total, divisor=1000)} " in bar, (total, bar[-300:])


def test_bdnctl_version_and_si_units(bdnd: Bdnd) -> None:
    import bdn

    r = run_bdnctl("--version")
    assert r.returncode == 0 and r.stdout == f"bdn {bdn.__version__}\n"
    r = run_bdnctl("verify", "step000002", url=bdnd.url)
    assert r.returncode == 0, r.stderr
    total = open_snapshot(bdnd.ready).ready.total_bytes
    assert f"{total / 1e3:.1f} kB match READY" in r.stdout or f"{total / 1e6:.1f} MB match READY" in r.stdout


def test_bdnctl_verify(bdnd: Bdnd) -> None:
    bdnd.publish("step000033", 33)  # its own snapshot: this test damages it
    assert bdnd.daemon.prefetch("step000033")[0] == 202
    d = Path(bdnd.daemon.wait_ready("step000033", timeout=120)["path"])
    r = run_bdnctl("verify", "step000033", url=bdnd.url)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("step000033 ok: 5 files")
    assert run_bdnctl("verify", str(d)).returncode == 0  # a directory needs no daemon
    flip_byte(d / SHARD2, 9, 0x01)
    r = run_bdnctl("verify", "step000033", url=bdnd.url)
    assert r.returncode == 1
    assert r.stderr.startswith("bdnctl: error: ") and SHARD2 in r.stderr and "chunk 0 " in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_bdnctl_usage_and_unreachable_exit_codes(bdnd: Bdnd, capsys: pytest.CaptureFixture[str]) -> None:
    r = run_bdnctl(url=bdnd.url)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    url = f"http://127.0.0.1:{free_port()}"
    r = run_bdnctl("status", url=url)
    assert r.returncode == 3
    assert re.fullmatch(rf"bdnctl: error: cannot reach bdnd at {re.escape(url)}: .+", r.stderr.strip())
    r = run_bdnctl("--json", "snapshots", url=url)
    assert r.returncode == 3 and json.loads(r.stdout)["exit_code"] == 3
    # The rest in-process (same main(), no interpreter start-up each time).
    assert bdnctl_main(["--url", bdnd.url, "frobnicate"]) == 2
    assert bdnctl_main(["--url", bdnd.url, "prefetch", "a/b"]) == 2
    assert bdnctl_main(["--url", "ftp://x", "status"]) == 2
    assert bdnctl_main(["--url", bdnd.url, "prefetch", "step000003", "--timeout", "-1", "--wait"]) == 2
    assert bdnctl_main(["--url", "unix:///nonexistent/bdnd.sock", "status"]) == 3
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 5 and all(line.startswith("bdnctl: error: ") for line in err)
    with pytest.raises(SystemExit) as exc:  # argparse prints help and exits 0
        raise SystemExit(bdnctl_main(["--help"]))
    assert exc.value.code == 0


def test_bdnctl_main_in_process(bdnd: Bdnd, capsys: pytest.CaptureFixture[str]) -> None:
    assert bdnctl_main(["--url", bdnd.url, "snapshots"]) == 0
    assert "step000002" in capsys.readouterr().out
    assert bdnctl_main(["--url", bdnd.url, "verify", "step999999"]) == 1
    assert "404" in capsys.readouterr().err
    # gc in text: the kept snapshots by name; "nothing to collect" rather than a bare dash
    assert bdnctl_main(["--url", bdnd.url, "gc"]) == 0
    removed, kept = capsys.readouterr().out.splitlines()
    assert removed == "removed 0 (nothing to collect)" or removed.startswith("removed "), removed
    assert ": -" not in removed and kept.startswith("kept ") and "step000002" in kept, kept


# -- against the real daemon ----------------------------------------------------------------------


def test_against_real_bdnd(tmp_path: Path) -> None:
    from bdn.publish import publish_full, publish_startup
    from support.checkpoints import make_state, write_hf_dir
    from support.swarm import Swarm

    bucket = f"file://{tmp_path}/bucket"
    states = [make_state(0), make_state(1)]
    dirs = [write_hf_dir(tmp_path / f"trainer/ck{i + 1}", s, i + 1) for i, s in enumerate(states)]
    publish_full(bucket, "step000001", 1, dir=dirs[0], chunk_size=64 << 10)
    publish_startup(bucket, "step000001")
    publish_full(bucket, "step000002", 2, dir=dirs[1], chunk_size=64 << 10)
    with Swarm(tmp_path / "nodes", 1, bucket) as swarm:
        url = swarm.daemons[0].url
        r = run_bdnctl("prefetch", "step000002", "--wait", "--timeout", "120", url=url)
        assert r.returncode == 0, r.stderr
        m = re.fullmatch(r"step000002 ready in [0-9.]+ s: (\S+)", r.stdout.strip())
        assert m, r.stdout
        with DaemonClient(url) as c:
            c.wait("step000001", timeout=120)
            assert c.health()["status"] == "ok"
            assert {"step000001", "step000002"} <= {s["identity"] for s in c.snapshots()}
            with c.open("step000002", timeout=120) as snap:
                assert str(snap.path) == m.group(1) and snap.policy_version == 2
                for name, want in states[1].items():
                    assert snap.tensor(name).tobytes() == want.tobytes(), name
                    got = c.read_tensor("step000002", name)
                    assert got.dtype == want.dtype and got.shape == want.shape
                    assert got.tobytes() == want.tobytes(), name
                snap.verify()
            shard = dirs[1] / SHARD1
            data = shard.read_bytes()
            assert c.read_file("step000002", SHARD1, 1000, 70000) == data[1000:71000]
            with pytest.raises(DaemonError) as exc:
                c.snapshot("step999999")
            assert exc.value.status == 404 and "step999999" in str(exc.value)
        for args, code in (
            (["status"], 0),
            (["snapshots"], 0),
            (["verify", "step000002"], 0),
            (["verify", "step999999"], 1),
            (["prefetch", "step000009", "--wait", "--timeout", "0.5"], 1),
        ):
            r = run_bdnctl(*args, url=url)
            assert r.returncode == code, (args, r.stdout, r.stderr)
        assert "step000002" in run_bdnctl("snapshots", url=url).stdout
