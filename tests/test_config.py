"""bdnd's configuration: every mistake is refused at load with one line naming the key (exit 2).

Covers issue 12 items 9 (malformed values accepted or reported wrongly), 13 (the unauthenticated
local API on a non-loopback address) and 15 (``bdnd --help`` / ``--version``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bdn import __version__
from bdn.daemon.config import Config, ConfigError


@pytest.fixture
def base(tmp_path: Path) -> dict[str, str]:
    secret = tmp_path / "secret"
    secret.write_text("0" * 64 + "\n")
    return {"BDN_BUCKET": f"file://{tmp_path}/bucket", "BDN_PARTITION_SECRET_FILE": str(secret)}


def _load(env: dict[str, str], path: Path | None = None, **overrides: object) -> Config:
    return Config.load(path, env=env, overrides=overrides)


@pytest.mark.parametrize("url", ["s3:/x", "file://relative", "http://example.invalid/b", "s3://", "gs://A_b"])
def test_malformed_bucket_url_is_a_config_error(base: dict[str, str], url: str) -> None:
    with pytest.raises(ConfigError, match="bucket"):
        _load({**base, "BDN_BUCKET": url})


@pytest.mark.parametrize("peers", ["10.0.0.2:7080", "http://h:7080,node7", "ftp://h:1", "http://h:70/path"])
def test_peer_urls_must_be_http_urls(base: dict[str, str], peers: str) -> None:
    # a peer without its scheme was taken silently and sat "not alive" for good (new-user report)
    with pytest.raises(ConfigError, match="'peers' must hold URLs http://host:port"):
        _load({**base, "BDN_PEERS": peers})
    assert _load({**base, "BDN_PEERS": "http://10.0.0.2:7080,https://[::1]:7080/"}).peers == [
        "http://10.0.0.2:7080",
        "https://[::1]:7080",
    ]


def test_unknown_log_level(base: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match="log_level.*'loud'"):
        _load({**base, "BDN_LOG_LEVEL": "loud"})


def test_event_loop(base: dict[str, str]) -> None:
    # BDN_EVENT_LOOP=asyncio: for an A/B of a run against uvloop (the default)
    assert _load(base).event_loop == "uvloop"
    assert _load({**base, "BDN_EVENT_LOOP": "asyncio"}).event_loop == "asyncio"
    with pytest.raises(ConfigError, match="event_loop.*uvloop or asyncio.*'trio'"):
        _load({**base, "BDN_EVENT_LOOP": "trio"})


@pytest.mark.parametrize(
    "env",
    [
        {"BDN_KEEP_READY": "-1"},
        {"BDN_PEER_TIMEOUT_S": "-5"},
        {"BDN_MAX_UPLOADS": "0"},
        {"BDN_CHUNK_WAIT_S": "nan"},
        {"BDN_SHM_BUDGET_BYTES": "-1e9"},
    ],
)
def test_negative_durations_and_counts_refused(base: dict[str, str], env: dict[str, str]) -> None:
    (name,) = env
    with pytest.raises(ConfigError, match=name[4:].lower()):
        _load({**base, **env})


def test_integer_written_as_float(base: dict[str, str]) -> None:
    assert _load({**base, "BDN_SHM_BUDGET_BYTES": "1e9"}).shm_budget_bytes == 10**9
    with pytest.raises(ConfigError, match="expected an integer, got '1.5'"):
        _load({**base, "BDN_SHM_BUDGET_BYTES": "1.5"})


def test_unknown_bdn_variable_refused_but_cli_variables_ignored(base: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match="BDN_PEER_TIMEOUT: unknown variable"):
        _load({**base, "BDN_PEER_TIMEOUT": "5"})
    assert _load({**base, "BDN_URL": "http://127.0.0.1:7081", "BDN_GCS_ENDPOINT_URL": "x"}).bucket
    # the variables README documents for the examples and engines, exported in the shell bdnd inherits
    # (examples/fleet.py starts bdnd with its own environment: BDN_DEMO_ENGINE=numpy made it exit 2)
    assert _load({**base, "BDN_DEMO_ENGINE": "numpy", "BDN_VLLM_KEEP_UNPACKED": "1"}).bucket


def test_bdnd_table_beside_another_table(base: dict[str, str], tmp_path: Path) -> None:
    cfg = tmp_path / "bdnd.toml"
    cfg.write_text('[bdnd]\nkeep_ready = 3\n\n[engine]\nname = "x"\n')
    with pytest.raises(ConfigError, match=r"keys outside the \[bdnd\] table: engine"):
        _load(base, cfg)
    cfg.write_text("[other]\nkeep_ready = 3\n")
    with pytest.raises(ConfigError, match=r"unknown table \[other\]"):
        _load(base, cfg)
    cfg.write_text("[bdnd]\nkeep_ready = 3\n")
    assert _load(base, cfg).keep_ready == 3


def test_local_api_must_be_loopback_unless_allowed(base: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match="not a loopback address"):
        _load(base, local_listen="0.0.0.0:7081")
    assert _load(base, local_listen="0.0.0.0:7081", local_allow_remote=True).local_listen == "0.0.0.0:7081"
    for ok in ("127.0.0.1:7081", "localhost:7081", "[::1]:7081", "127.0.0.5:1"):
        assert _load(base, local_listen=ok).local_listen == ok


def test_the_transfer_wire_cannot_be_turned_off(base: dict[str, str]) -> None:
    """Chunks move between daemons only over the transfer wire: ``transfer_listen = ""`` (which
    turned it off once) is refused naming the key, not read as "auto" (an operator who set it
    expects no listener); "auto" and host:port load, anything else is refused."""
    for env in ({"BDN_TRANSFER_LISTEN": ""}, {}):
        with pytest.raises(ConfigError) as e:
            _load({**base, **env}, **({} if env else {"transfer_listen": ""}))
        assert "\n" not in str(e.value), e.value
        assert "'transfer_listen' cannot be empty" in str(e.value) and '"auto"' in str(e.value), e.value
    assert _load(base).transfer_listen == "auto"
    assert _load(base, transfer_listen="127.0.0.1:7090").transfer_listen == "127.0.0.1:7090"
    with pytest.raises(ConfigError, match="'transfer_listen' must be host:port or \"auto\""):
        _load(base, transfer_listen="off")


def test_local_api_needs_a_listener(base: dict[str, str], tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="local_listen .* or local_socket"):
        _load(base, local_listen="")
    assert _load(base, local_listen="", local_socket=str(tmp_path / "s.sock")).local_socket


# Every config error bdnd can meet at start-up goes through Config.load, tested here in-process:
# a ConfigError of one line naming the key and the value (or the file). bdnd prints that line as
# "bdnd: error: <line>" and exits 2; that path is run as a process for one flag below and for one
# config file in test_deploy.py.
FILE_ERRORS = {
    "unknown-key": (
        'bucket = "file:///tmp/b"\npartition_secret_file = "{secret}"\nbogus_key = 1\n',
        ["bogus_key", "{cfg}"],
    ),
    "wrong-type": ('bucket = "file:///tmp/b"\npartition_secret_file = "{secret}"\npeers = 5\n', ["peers", "{cfg}"]),
    "missing-secret-file": (
        'bucket = "file:///tmp/b"\npartition_secret_file = "{tmp}/nope.secret"\n',
        ["partition_secret_file", "{tmp}/nope.secret"],
    ),
    "secret-is-a-directory": (
        'bucket = "file:///tmp/b"\npartition_secret_file = "{tmp}"\n',
        ["partition_secret_file", "{tmp}"],
    ),
    "toml-syntax": ('bucket = "file:///tmp/b\npartition_secret_file = "{secret}"\n', ["{cfg}", "TOML"]),
    "unknown-key-in-bdnd-table": (
        '[bdnd]\nbucket = "file:///tmp/b"\npartition_secret_file = "{secret}"\npeer_port = 7080\n',
        ["peer_port"],
    ),
    # issue 12, item 9: these exited 1 with a traceback or a log line, or were accepted
    "malformed-s3-url": ('bucket = "s3:/x"\npartition_secret_file = "{secret}"\n', ["bucket", "s3:/x"]),
    "relative-file-url": (
        'bucket = "file://relative"\npartition_secret_file = "{secret}"\n',
        ["bucket", "file:///absolute/path"],
    ),
    "http-url": (
        'bucket = "http://example.invalid/b"\npartition_secret_file = "{secret}"\n',
        ["bucket", "http://example.invalid/b"],
    ),
    "unknown-log-level": (
        'bucket = "file:///tmp/b"\npartition_secret_file = "{secret}"\nlog_level = "loud"\n',
        ["log_level", "loud"],
    ),
    "negative-count": (
        'bucket = "file:///tmp/b"\npartition_secret_file = "{secret}"\nkeep_ready = -1\n',
        ["keep_ready", ">= 0"],
    ),
    "bdnd-table-beside-another": (
        '[bdnd]\nbucket = "file:///tmp/b"\npartition_secret_file = "{secret}"\n[engine]\nname = "x"\n',
        ["outside the [bdnd] table: engine"],
    ),
}


@pytest.mark.parametrize("case", list(FILE_ERRORS))
def test_config_file_error_is_one_line_naming_the_key(tmp_path: Path, case: str) -> None:
    text, needles = FILE_ERRORS[case]
    secret = tmp_path / "secret"
    secret.write_text("0" * 64 + "\n")
    cfg = tmp_path / "bdnd.toml"
    subs = {"secret": str(secret), "tmp": str(tmp_path), "cfg": str(cfg)}
    cfg.write_text(text.format(**subs))
    with pytest.raises(ConfigError) as e:
        _load({}, cfg)
    line = str(e.value)
    assert "\n" not in line, line
    for n in needles:
        assert n.format(**subs) in line, line


@pytest.mark.parametrize(
    "env, overrides, needle",
    [
        ({"BDN_PEER_TIMEOUT_S": "-5"}, {}, "peer_timeout_s"),
        ({"BDN_PEER_TIMEOUT": "5"}, {}, "BDN_PEER_TIMEOUT: unknown variable"),
        ({"BDN_SHM_BUDGET_BYTES": "1e9x"}, {}, "expected an integer"),
        ({}, {"local_listen": "0.0.0.0:7081"}, "not a loopback address"),
        ({}, {"local_listen": ""}, "local_listen (loopback host:port) or local_socket"),
    ],
    ids=["negative-env", "unknown-env", "bad-number-env", "remote-local-api", "no-local-api"],
)
def test_bad_config_is_one_line_naming_the_key(
    base: dict[str, str], env: dict[str, str], overrides: dict[str, object], needle: str
) -> None:
    with pytest.raises(ConfigError) as e:
        _load({**base, **env}, **overrides)
    assert "\n" not in str(e.value) and needle in str(e.value), e.value


def test_an_engine_window_shorter_than_a_poll_step_is_refused(base: dict[str, str]) -> None:
    """engine_stale_s = 0.01 s flagged a continuously polling engine stale and live again 23 times
    in 5 s in a real bdnd (a held poll marks it seen only every 0.05 s): refused; 0 is off."""
    for key in ("ENGINE_STALE_S", "ENGINE_TTL_S"):
        with pytest.raises(ConfigError, match=rf"'{key.lower()}' must be 0 \(off\) or at least 0.5 s, got 0.01"):
            _load({**base, f"BDN_{key}": "0.01"})
        assert getattr(_load({**base, f"BDN_{key}": "0"}), key.lower()) == 0
        assert getattr(_load({**base, f"BDN_{key}": "0.5"}), key.lower()) == 0.5
    import os

    clean = {k: v for k, v in os.environ.items() if not k.startswith("BDN_")}
    r = _bdnd("--engine-stale-s", "0.01", env={**clean, **base})  # the daemon itself: exit 2, one line
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "engine_stale_s" in r.stderr, r


def test_an_infinite_or_overflowing_number_is_refused(base: dict[str, str]) -> None:
    """engine_ttl_s = inf was accepted and sent to engines as ``Infinity`` (not JSON); a duration
    past ~9.2e9 s overflows socket and thread timeouts: every number is finite, every ``*_s`` at
    most 1e9 s."""
    for key, value in (("ENGINE_TTL_S", "inf"), ("MEMORY_PROBE_EVERY_S", "1e300"), ("PEER_TIMEOUT_S", "1e10")):
        with pytest.raises(ConfigError, match=rf"'{key.lower()}' must be a finite number of at most 1e\+09 s"):
            _load({**base, f"BDN_{key}": value})
    with pytest.raises(ConfigError, match=r"'bucket_mbit' must be a finite number, got inf"):
        _load({**base, "BDN_BUCKET_MBIT": "inf"})
    assert _load({**base, "BDN_MEMORY_PROBE_EVERY_S": "1e9"}).memory_probe_every_s == 1e9


def test_every_key_has_help() -> None:
    missing = [name for name, _, _, text in Config.keys() if not text.strip()]
    assert missing == []


def _bdnd(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bdn.daemon.main", *args], capture_output=True, text=True, env=env, timeout=240
    )  # generous: imports alone took 60+ s on a loaded machine


def test_bdnd_help_lists_every_key_with_its_variable() -> None:
    out = _bdnd("--help").stdout
    for name, _, _, _ in Config.keys():
        if name in ("partition_secret", "api_token"):
            continue  # secrets never come from flags (ps shows argv)
        assert f"--{name.replace('_', '-')}" in out, name
        assert f"BDN_{name.upper()}" in out, name


def test_bdnd_version() -> None:
    r = _bdnd("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"bdn {__version__}"


def test_a_mistyped_flag_is_one_line_exit_2() -> None:
    r = _bdnd("--keep-readdy", "3")  # argparse printed its 33-line usage block (new-user report)
    assert r.returncode == 2, r
    assert r.stderr == "bdnd: error: unrecognized arguments: --keep-readdy 3 (see bdnd --help)\n", r.stderr


def test_bad_config_exits_2_with_one_line(base: dict[str, str]) -> None:
    """Issue 12, items 9 and 13, as a process: exit 2 and one line (systemd does not restart it).
    One flag end to end; the loader's other errors are tested in-process above."""
    import os

    clean = {k: v for k, v in os.environ.items() if not k.startswith("BDN_")}
    r = _bdnd("--keep-ready", "-1", env={**clean, **base})
    assert r.returncode == 2, r
    assert r.stderr.strip().count("\n") == 0, r.stderr
    assert r.stderr.startswith("bdnd: error: ") and "keep_ready" in r.stderr, r.stderr


@pytest.mark.parametrize(
    "env, needle",
    [
        ({"BDN_PEERS": "http://[::1"}, "'peers' must hold URLs"),
        ({"BDN_ADVERTISE_URL": "http://[zz"}, "'advertise_url' must hold URLs"),
        ({"BDN_BUCKET": "s3://[x/p"}, "'bucket': bad bucket URL"),
        ({"BDN_BUCKET": "s3://b:99999/p"}, "'bucket'"),
        ({"BDN_ENDPOINT_URL": "http://[::1"}, "'endpoint_url' must hold an URL"),
        ({"BDN_ENDPOINT_URL": "notaurl"}, "'endpoint_url' must hold an URL"),
        ({"BDN_PEERS_DNS": "nohostport"}, "'peers_dns' must be host:port"),
    ],
    ids=[
        "peer-unclosed-bracket",
        "advertise-unclosed-bracket",
        "bucket-unclosed-bracket",
        "bucket-port",
        "endpoint-unclosed-bracket",
        "endpoint-no-scheme",
        "peers-dns-no-port",
    ],
)
def test_malformed_urls_and_addresses_are_one_line_naming_the_key(
    base: dict[str, str], env: dict[str, str], needle: str
) -> None:
    """breaker2: an unclosed '[' in a peer, advertise or bucket URL was a ValueError traceback
    (urlsplit's "Invalid IPv6 URL", exit 1); endpoint_url was not checked (exit 1 once the bucket
    opened) and peers_dns without a port exited 1 after bdnd listened."""
    with pytest.raises(ConfigError) as e:
        _load({**base, **env})
    assert "\n" not in str(e.value) and needle in str(e.value), e.value
    assert _load({**base, "BDN_ENDPOINT_URL": "https://s3.example.invalid:9000/proxy"}).endpoint_url


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--chunk-log", "/nonexistent-dir-bdn/x.jsonl"], "config key 'chunk_log': cannot open /nonexistent-dir-bdn"),
        (
            ["--bucket", "s3://abc/p", "--credentials-file", "/nonexistent-bdn.json"],
            "credentials_file",
        ),
    ],
    ids=["chunk-log-dir-missing", "credentials-file-missing"],
)
def test_a_file_bdnd_cannot_open_at_start_exits_2_with_one_line(
    base: dict[str, str], tmp_path: Path, flags: list[str], needle: str
) -> None:
    """breaker2: a chunk_log in a missing directory was a FileNotFoundError traceback and a missing
    credentials file one ERROR log line, both exit 1 (systemd restarts an exit 1 forever)."""
    import os

    from support.swarm import free_port

    clean = {k: v for k, v in os.environ.items() if not k.startswith("BDN_")}
    port = free_port()
    env = {
        **clean,
        **base,
        "BDN_SHM_DIR": str(tmp_path / "shm"),
        "BDN_PEER_LISTEN": f"127.0.0.1:{port}",
        "BDN_LOCAL_LISTEN": f"127.0.0.1:{free_port()}",
        "BDN_TRANSFER_LISTEN": f"127.0.0.1:{free_port()}",  # the wire cannot be off
        "BDN_LOAD_STARTUP": "false",
    }
    r = _bdnd(*flags, env=env)
    assert r.returncode == 2, r
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("bdnd: error: ") and needle in r.stderr, r.stderr


def test_shm_dir_is_required_and_made_absolute(base: dict[str, str], tmp_path: Path, monkeypatch) -> None:
    """breaker2: ``shm_dir = ""`` ran the store in the daemon's working directory, and a relative
    shm_dir was handed out as is: ``GET /v1/snapshots/X`` answered ``"path": "relshm/<swarm>/X"``,
    which an engine in another directory cannot open."""
    with pytest.raises(ConfigError, match="'shm_dir' must be a directory path"):
        _load({**base, "BDN_SHM_DIR": ""})
    monkeypatch.chdir(tmp_path)
    assert _load({**base, "BDN_SHM_DIR": "relshm"}).shm_dir == str(tmp_path / "relshm")


def test_background_nice_is_0_to_19(base: dict[str, str]) -> None:
    assert _load(base).background_nice == 10
    assert _load({**base, "BDN_BACKGROUND_NICE": "0"}).background_nice == 0
    with pytest.raises(ConfigError, match="'background_nice' must be 0-19, got 20"):
        _load({**base, "BDN_BACKGROUND_NICE": "20"})
    with pytest.raises(ConfigError, match="background_nice"):
        _load({**base, "BDN_BACKGROUND_NICE": "-1"})
