"""The command lines as a new user meets them, against real processes (issue 12's follow-ups):
``bdnctl prefetch`` without ``--wait`` exits non-zero when the request fails at once, the
subcommands say what happened, and ``bdnd`` started on a port that another process holds exits 2
with one line naming the key (``peer_listen 127.0.0.1:N is in use (...)``), so systemd does not
restart it forever."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bdn.publish import publish_full
from support.checkpoints import make_state, write_hf_dir
from support.swarm import Daemon, free_port, running

PUBLISHED = "step000001"
NOTHING = "step000009"  # never published: nothing under step000009/ in the bucket


def bdnctl(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bdn.cli.bdnctl", "--url", url, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ.copy(),
    )


@pytest.fixture(scope="module")
def bucket(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("cli")
    url = f"file://{root}/bucket"
    publish_full(url, PUBLISHED, 1, dir=write_hf_dir(root / "ckpt", make_state(0), 1), chunk_size=64 << 10)
    return url


@pytest.fixture(scope="module")
def daemon(bucket: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("cli-daemon"), "cli-node", bucket, extra_env={"BDN_LOAD_STARTUP": "false"})
    with running(d):
        yield d


def one_error_line(r: subprocess.CompletedProcess[str]) -> str:
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bdnctl: error: "), r
    return lines[0]


def test_prefetch_without_wait_exits_1_when_the_request_fails_at_once(daemon: Daemon) -> None:
    r = bdnctl(daemon.url, "prefetch", NOTHING)  # exited 0 "queued (prefetch started)" before
    assert r.returncode == 1, r
    line = one_error_line(r)
    assert f"{NOTHING} failed: nothing is published under {NOTHING}/" in line, line
    r = bdnctl(daemon.url, "--json", "prefetch", NOTHING)
    assert r.returncode == 1 and '"exit_code": 1' in r.stdout, r
    # the local API answers once it looked at the bucket: the record already says failed
    status, rec = daemon.prefetch(NOTHING)
    assert status == 202 and rec["state"] == "failed" and "nothing is published" in rec["reason"], rec
    # a malformed identity is a usage error, refused before anything is sent
    r = bdnctl(daemon.url, "prefetch", "../etc")
    assert r.returncode == 2 and "one path segment" in one_error_line(r), r


def test_bdnctl_pointed_at_the_peer_port_says_which_port_it_wants(daemon: Daemon) -> None:
    r = bdnctl(daemon.peer_url, "status")  # new-user report: "bdnd answered 401: HTTP 401" only
    assert r.returncode == 1, r
    line = one_error_line(r)
    assert "answered 401" in line and "peer port" in line and "local API" in line, line


def test_prefetch_cancel_and_path_say_what_happened(daemon: Daemon) -> None:
    r = bdnctl(daemon.url, "prefetch", PUBLISHED, "--wait", "--timeout", "120")
    assert r.returncode == 0, r
    path = daemon.get(f"/v1/snapshots/{PUBLISHED}")["path"]
    r = bdnctl(daemon.url, "prefetch", PUBLISHED)  # "ready (prefetch started)" before
    assert r.returncode == 0 and r.stdout.strip() == f"{PUBLISHED}: ready: {path}", r
    # asked to wait for publication: accepted, and the line says what it waits for
    r = bdnctl(daemon.url, "prefetch", "step000008", "--wait-publish")
    assert r.returncode == 0 and "waiting for" in r.stdout, r
    r = bdnctl(daemon.url, "cancel", "step000008")
    assert r.returncode == 0 and r.stdout.strip() == "step000008: cancelled by the operator", r
    # a record that had failed on its own is dropped, and the line does not claim a cancel
    assert bdnctl(daemon.url, "prefetch", NOTHING).returncode == 1
    r = bdnctl(daemon.url, "cancel", NOTHING)
    assert r.returncode == 0 and r.stdout.startswith(f"{NOTHING}: had failed already, record dropped"), r
    for args in (("cancel", NOTHING), ("path", NOTHING), ("verify", NOTHING), ("engines", "--remove", "nope")):
        r = bdnctl(daemon.url, *args)
        assert r.returncode == 1, (args, r)
        one_error_line(r)


def _bdnd_exit(d: Daemon, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bdn.daemon.main"], env={**d.env, **env}, capture_output=True, text=True, timeout=240
    )


@pytest.mark.parametrize("key", ["peer_listen", "local_listen", "transfer_listen"])
def test_bdnd_on_a_port_in_use_exits_2_with_one_line(key: str, bucket: str, tmp_path: Path) -> None:
    d = Daemon(tmp_path, "taken", bucket, extra_env={"BDN_LOAD_STARTUP": "false"})
    with socket.socket() as holder:  # a real socket holds the port, listening
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        address = f"127.0.0.1:{holder.getsockname()[1]}"
        r = _bdnd_exit(d, {f"BDN_{key.upper()}": address})
    assert r.returncode == 2, r  # exit 1 and "cannot listen: [Errno 98] error while ..." before
    assert r.stderr.strip().splitlines() == [
        f"bdnd: error: {key} {address} is in use (Address already in use: another process listens there; "
        "stop it or choose another address)"
    ], r
    assert "Traceback" not in r.stdout + r.stderr


def test_bdnd_on_an_address_of_no_interface_exits_2(bucket: str, tmp_path: Path) -> None:
    d = Daemon(tmp_path, "nowhere", bucket, extra_env={"BDN_LOAD_STARTUP": "false"})
    r = _bdnd_exit(d, {"BDN_PEER_LISTEN": f"192.0.2.1:{free_port()}"})  # TEST-NET-1: on no interface here
    assert r.returncode == 2 and r.stderr.startswith("bdnd: error: peer_listen 192.0.2.1:"), r
    assert "no interface of this host has that address" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r


def test_bdnd_on_a_unix_socket_in_use_exits_2_and_leaves_it(bucket: str, tmp_path: Path) -> None:
    d = Daemon(tmp_path, "sock", bucket, extra_env={"BDN_LOAD_STARTUP": "false"})
    path = str(tmp_path / "bdn.sock")
    with socket.socket(socket.AF_UNIX) as holder:  # another process's socket, accepting
        holder.bind(path)
        holder.listen()
        r = _bdnd_exit(d, {"BDN_LOCAL_SOCKET": path})
        assert r.returncode == 2, r  # before: unlinked the holder's socket and took the path
        assert r.stderr.strip().splitlines() == [
            f"bdnd: error: local_socket {path} is in use (another process "
            "accepts connections on it; stop it or choose another path)"
        ], r
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(path)  # still the holder's
    # the holder is gone, its socket file stays (a crash): stale, so bdnd removes it and binds
    assert Path(path).exists()
    d.env["BDN_LOCAL_SOCKET"] = path
    with running(d):
        with socket.socket(socket.AF_UNIX) as client:
            client.settimeout(60)
            client.connect(path)
            client.sendall(b"GET /v1/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert client.recv(4096).startswith(b"HTTP/1.1 200"), "bdnd does not answer on its socket"


def test_bdn_publish_usage_errors_are_one_line(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "bdn.cli.publish",
        "full",
        "--dir",
        str(tmp_path),
        "--bucket",
        f"file://{tmp_path}/b",
        "--identity",
        "step000001",
        "--policy-version",
        "-1",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.splitlines() == [  # before: the whole usage block, then the line
        "bdn-publish: error: argument --policy-version: must be >= 0 (see bdn-publish full --help)"
    ], r
    r = subprocess.run([*cmd[:-1], "1", "--chunk-size", "7", "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and '"exit_code": 2' in r.stdout and len(r.stderr.splitlines()) == 1, r


@pytest.mark.parametrize("module", ["bdn.daemon.main", "bdn.cli.bdnctl", "bdn.cli.publish", "bdn.engines"])
def test_every_command_prints_its_version(module: str) -> None:
    """Issue 12, item 15: ``--version`` on every command (the engine runner included)."""
    from bdn import __version__

    r = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0 and r.stdout.strip() == f"bdn {__version__}", (r.returncode, r.stdout, r.stderr)
