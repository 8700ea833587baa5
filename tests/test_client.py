"""bdn.client and bdnctl against real READY directories and real HTTP servers.

Most tests talk to tests/support/fake_local_api.py (a real aiohttp server on 127.0.0.1 and a unix
socket serving real files), written while bdnd did not exist yet and kept because it can stage
states on demand (a failing snapshot, one that never finishes). ``test_against_real_bdnd`` runs
the client and bdnctl against a real bdnd process fed from a file:// bucket.
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
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from bdn.client import (
    DaemonClient,
    DaemonError,
    DaemonUnreachable,
    SnapshotFailed,
    open_snapshot,
)
from bdn.cli.bdnctl import main as bdnctl_main
from bdn.proto.errors import ChecksumError, IdentityError, ProtocolError
from support.fake_local_api import FakeLocalApi, write_ready

BDNCTL = Path(sys.executable).parent / "bdnctl"
CHUNK = 4096
SHARD1 = "model-00001-of-00002.safetensors"
SHARD2 = "model-00002-of-00002.safetensors"


def make_snapshot(root: Path, identity: str, policy_version: int, seed: int) -> tuple[Path, dict[str, np.ndarray]]:
    """A real two-shard HF checkpoint directory (written by the reference safetensors writer) + READY."""
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
    d = root / identity
    d.mkdir(parents=True)
    save_file(shard1, str(d / SHARD1), metadata={"format": "pt"})
    save_file(shard2, str(d / SHARD2), metadata={"format": "pt"})
    weight_map = {name: SHARD1 for name in shard1} | {name: SHARD2 for name in shard2}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 96}))
    write_ready(d, identity, policy_version, chunk_size=CHUNK)
    return d, shard1 | shard2


@pytest.fixture
def snap(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    return make_snapshot(tmp_path / "shm", "step000002", 2, seed=1)


@pytest.fixture
def api(tmp_path: Path, snap: tuple[Path, dict[str, np.ndarray]]) -> Iterator[FakeLocalApi]:
    server = FakeLocalApi(unix_path=str(tmp_path / "bdnd.sock"))
    server.add_ready(snap[0])
    pending, _ = make_snapshot(tmp_path / "shm", "step000003", 3, seed=2)
    server.add_pending(pending, steps=4)
    server.add_failing("step000004", "chunk 3 of model.safetensors: bucket answered 403 Forbidden")
    server.add_stuck("step000005")
    server.start()
    yield server
    server.stop()


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


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
        flip_byte(info_file, offset)
        assert view.tobytes() != arrays["model.layers.0.mlp.up_proj.weight"].tobytes()


def test_verify_passes_then_catches_a_flipped_byte(snap: tuple[Path, dict[str, np.ndarray]]) -> None:
    d, _ = snap
    with open_snapshot(d) as s:
        s.verify()
    flip_byte(d / SHARD1, CHUNK + 10)  # inside chunk 1
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

def test_health_status_snapshots_over_tcp_and_unix_socket(api: FakeLocalApi, tmp_path: Path) -> None:
    for url in (api.url, f"unix://{tmp_path / 'bdnd.sock'}"):
        with DaemonClient(url) as c:
            assert c.health()["status"] == "ok"
            assert c.status()["node_id"] == "fake-node"
            assert [s["identity"] for s in c.snapshots()] == ["step000002"]
            one = c.snapshot("step000002")
            assert one["state"] == "ready" and one["policy_version"] == 2
            # keep-alive: the same connection serves several requests
            assert c.snapshot("step000002")["identity"] == "step000002"


def test_read_file_with_range(api: FakeLocalApi, snap: tuple[Path, dict[str, np.ndarray]]) -> None:
    d, _ = snap
    data = (d / SHARD1).read_bytes()
    with DaemonClient(api.url) as c:
        assert c.read_file("step000002", SHARD1) == data
        assert c.read_file("step000002", SHARD1, offset=100, length=5000) == data[100:5100]
        assert c.read_file("step000002", SHARD1, offset=len(data) - 7) == data[-7:]
        assert c.read_file("step000002", SHARD1, 3, 0) == b""
        assert {f["path"] for f in c.list_files("step000002")} == set(open_snapshot(d).files())
        with pytest.raises(DaemonError) as exc:
            c.read_file("step000002", "nope.bin")
        assert exc.value.status == 404 and str(exc.value) == "no file 'nope.bin' in snapshot step000002"


def test_read_tensor(api: FakeLocalApi, snap: tuple[Path, dict[str, np.ndarray]]) -> None:
    _, arrays = snap
    with DaemonClient(api.url) as c:
        for name, src in arrays.items():
            got = c.read_tensor("step000002", name)
            assert got.dtype == src.dtype and got.shape == src.shape
            assert got.tobytes() == src.tobytes()
        with pytest.raises(DaemonError) as exc:
            c.read_tensor("step000002", "no.such.tensor")
        assert exc.value.status == 404 and "no.such.tensor" in str(exc.value)


def test_daemon_errors_carry_status_and_message(api: FakeLocalApi) -> None:
    with DaemonClient(api.url) as c:
        with pytest.raises(DaemonError) as exc:
            c.snapshot("step999999")
        assert exc.value.status == 404
        assert str(exc.value) == "snapshot step999999 is not known to this daemon"
        c.prefetch("step000003")  # known now, but not ready
        with pytest.raises(DaemonError) as exc:
            c.read_file("step000003", SHARD1)
        assert exc.value.status == 409 and "not ready" in str(exc.value)
        with pytest.raises(IdentityError):
            c.snapshot("../etc")  # refused before anything is sent


def test_prefetch_wait_and_open(api: FakeLocalApi) -> None:
    seen: list[int] = []
    with DaemonClient(api.url) as c:
        first = c.prefetch("step000003")
        assert first["state"] in ("queued", "downloading")
        ready = c.wait("step000003", timeout=30, poll=0.05, on_update=lambda s: seen.append(s["bytes_done"]))
        assert ready["state"] == "ready" and ready["bytes_done"] == ready["bytes_total"]
        assert seen == sorted(seen) and seen  # progress moved forward
        with c.open("step000003", timeout=30) as s:
            assert s.identity == "step000003" and s.policy_version == 3
            s.verify()


def test_wait_failed_and_timeout(api: FakeLocalApi) -> None:
    with DaemonClient(api.url) as c:
        c.prefetch("step000004")
        with pytest.raises(SnapshotFailed) as exc:
            c.wait("step000004", timeout=30, poll=0.05)
        assert exc.value.reason == "chunk 3 of model.safetensors: bucket answered 403 Forbidden"
        assert exc.value.snapshot is not None and exc.value.snapshot["state"] == "failed"
        c.prefetch("step000005")
        with pytest.raises(TimeoutError, match="step000005 not ready"):
            c.wait("step000005", timeout=0.3, poll=0.05)


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
    return subprocess.run([str(BDNCTL), *args], capture_output=True, text=True, env=env, timeout=60)


def test_bdnctl_snapshots_and_status(api: FakeLocalApi) -> None:
    r = run_bdnctl("snapshots", url=api.url)
    assert r.returncode == 0, r.stderr
    header, row = r.stdout.splitlines()[:2]
    assert header.split() == ["IDENTITY", "KIND", "POLICY_VERSION", "STATE", "PROGRESS", "PATH"]
    assert row.split()[:5] == ["step000002", "full", "2", "ready", "100%"]
    r = run_bdnctl("--url", api.url, "--json", "snapshots")
    assert r.returncode == 0 and json.loads(r.stdout)["snapshots"][0]["identity"] == "step000002"
    r = run_bdnctl("status", url=api.url)
    assert r.returncode == 0 and "fake-node" in r.stdout and "peer-1" in r.stdout
    assert json.loads(run_bdnctl("--json", "status", url=api.url).stdout)["swarm_id"] == "0123456789abcdef"


def test_bdnctl_prefetch_wait_exit_codes(api: FakeLocalApi, tmp_path: Path) -> None:
    r = run_bdnctl("prefetch", "step000003", "--wait", "--timeout", "60", url=api.url)
    assert r.returncode == 0, r.stderr
    assert re.fullmatch(rf"step000003 ready in [0-9.]+ s: {re.escape(str(tmp_path / 'shm' / 'step000003'))}",
                        r.stdout.strip())
    r = run_bdnctl("prefetch", "step000004", "--wait", url=api.url)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == (
        "bdnctl: error: step000004 failed: chunk 3 of model.safetensors: bucket answered 403 Forbidden"
    )
    r = run_bdnctl("prefetch", "step000005", "--wait", "--timeout", "0.3", url=api.url)
    assert r.returncode == 1 and "step000005 not ready" in r.stderr
    r = run_bdnctl("prefetch", "step000006", url=api.url)
    assert r.returncode == 0 and "step000006" in r.stdout
    r = run_bdnctl("--json", "prefetch", "step000005", "--wait", "--timeout", "0.2", url=api.url)
    assert r.returncode == 1 and json.loads(r.stdout)["exit_code"] == 1


def test_bdnctl_prefetch_shows_progress_bar_on_a_terminal(api: FakeLocalApi) -> None:
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
    proc = subprocess.run([str(BDNCTL), "--url", api.url, "prefetch", "step000003", "--wait"],
                          stdout=subprocess.PIPE, stderr=slave, env=env, text=True, timeout=60)
    os.close(slave)
    reader.join(10)
    os.close(master)
    bar = b"".join(chunks).decode("utf-8", "replace")
    assert proc.returncode == 0
    assert "step000003:" in bar and "%|" in bar and "downloading" in bar
    assert proc.stdout.startswith("step000003 ready in ")


def test_bdnctl_verify(api: FakeLocalApi, snap: tuple[Path, dict[str, np.ndarray]]) -> None:
    d, _ = snap
    r = run_bdnctl("verify", "step000002", url=api.url)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("step000002 ok: 4 files")
    assert run_bdnctl("verify", str(d)).returncode == 0  # a directory needs no daemon
    flip_byte(d / SHARD2, 9)
    r = run_bdnctl("verify", "step000002", url=api.url)
    assert r.returncode == 1
    assert r.stderr.startswith("bdnctl: error: ") and SHARD2 in r.stderr and "chunk 0 " in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_bdnctl_usage_and_unreachable_exit_codes(api: FakeLocalApi, capsys: pytest.CaptureFixture[str]) -> None:
    r = run_bdnctl(url=api.url)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    url = f"http://127.0.0.1:{free_port()}"
    r = run_bdnctl("status", url=url)
    assert r.returncode == 3
    assert re.fullmatch(rf"bdnctl: error: cannot reach bdnd at {re.escape(url)}: .+", r.stderr.strip())
    r = run_bdnctl("--json", "snapshots", url=url)
    assert r.returncode == 3 and json.loads(r.stdout)["exit_code"] == 3
    # The rest in-process (same main(), no interpreter start-up each time).
    assert bdnctl_main(["--url", api.url, "frobnicate"]) == 2
    assert bdnctl_main(["--url", api.url, "prefetch", "a/b"]) == 2
    assert bdnctl_main(["--url", "ftp://x", "status"]) == 2
    assert bdnctl_main(["--url", api.url, "prefetch", "step000003", "--timeout", "-1", "--wait"]) == 2
    assert bdnctl_main(["--url", "unix:///nonexistent/bdnd.sock", "status"]) == 3
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 5 and all(line.startswith("bdnctl: error: ") for line in err)
    with pytest.raises(SystemExit) as exc:  # argparse prints help and exits 0
        raise SystemExit(bdnctl_main(["--help"]))
    assert exc.value.code == 0


def test_bdnctl_main_in_process(api: FakeLocalApi, capsys: pytest.CaptureFixture[str]) -> None:
    assert bdnctl_main(["--url", api.url, "snapshots"]) == 0
    assert "step000002" in capsys.readouterr().out
    assert bdnctl_main(["--url", api.url, "verify", "step999999"]) == 1
    assert "404" in capsys.readouterr().err


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
            with c.open("step000002", timeout=30) as snap:
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
        for args, code in ((["status"], 0), (["snapshots"], 0), (["verify", "step000002"], 0),
                           (["verify", "step999999"], 1),
                           (["prefetch", "step000009", "--wait", "--timeout", "0.5"], 1)):
            r = run_bdnctl(*args, url=url)
            assert r.returncode == code, (args, r.stdout, r.stderr)
        assert "step000002" in run_bdnctl("snapshots", url=url).stdout
