"""bdnd's configuration: one Config object, the single source of truth (uvicorn's style).

Sources, later ones winning: built-in defaults, a TOML file (``--config``, flat keys or a
``[bdnd]`` table), ``BDN_<KEY>`` environment variables (e.g. ``BDN_BUCKET``, ``BDN_PEERS`` as a
comma list), then command-line flags. Unknown keys, wrong types and unreadable secret files are
errors that name the key or file: ``bdnd`` exits before it listens.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

from bdn.proto.errors import BdnError
from bdn.proto.keys import NODE_ID_RE


class ConfigError(BdnError):
    """The configuration is invalid (message names the key or file)."""


@dataclass
class Config:
    """Every bdnd option, with its default. Units are in the names (``_s`` seconds, ``_bytes``)."""

    bucket: str = ""  # origin: s3://b/prefix, gs://b/prefix or file:///path (required)
    partition_secret: str = field(default="", repr=False)  # prefer partition_secret_file
    partition_secret_file: str = ""  # file holding the partition secret
    node_id: str = ""  # default: the hostname
    peer_listen: str = "0.0.0.0:7080"  # host:port of the peer (swarm) server
    advertise_url: str = ""  # URL peers use to reach this daemon; default http://<host>:<port>
    local_listen: str = "127.0.0.1:7081"  # loopback host:port of the local API ("" = off)
    local_socket: str = ""  # optional unix socket path for the local API
    peers: list[str] = field(default_factory=list)  # static peer URLs (http://host:port)
    shm_dir: str = "/dev/shm/bdn"  # snapshots are rebuilt under <shm_dir>/<swarm_id>/
    credentials_file: str = ""  # reader credentials JSON (aws_access_key_id, ...)
    endpoint_url: str = ""  # S3 API endpoint override (else AWS_ENDPOINT_URL / default)
    require_manifest: bool = True  # wait for bdn.manifest.json before loading a snapshot
    load_startup: bool = True  # load STARTUP_SNAPSHOT on start
    startup_settle_s: float = 5.0  # at start, wait up to this long for static peers to answer
    max_inflight: int = 16  # chunk transfers in flight per snapshot
    bucket_concurrency: int = 4  # concurrent bucket requests (few: an owner's chunks then finish
    # one after another and flow to peers at once, instead of all finishing together at the end)
    chunk_wait_s: float = 30.0  # how long an owner may hold a chunk request while it fetches
    owner_patience_s: float = 600.0  # keep asking a live owner that answers "still fetching" this long
    max_uploads: int = 8  # chunk uploads served at once; beyond, 503 sends askers to other holders
    uploads_per_chunk: int = 2  # peers served one chunk at once; others are sent to holders (fan-out tree)
    manifest_wait_s: float = 600.0  # how long a prefetch waits for the manifest to appear
    manifest_poll_s: float = 1.0  # how often it looks
    peer_timeout_s: float = 60.0  # one peer request (after any wait)
    penalty_s: float = 30.0  # how long a peer that sent bad bytes is skipped
    apply_workers: int = 0  # threads decoding deltas (0 = one per core)
    keep_ready: int = 2  # GC keeps this many newest ready snapshots (plus leased/current/target)
    gc_grace_s: float = 60.0  # a snapshot that just became ready is kept at least this long
    shm_budget_bytes: int = 0  # most bytes of snapshots (rebuilt + stored diffs) in shm; 0 = no budget
    peer_upload_mbit: float = 0.0  # limit on chunk bytes served to peers, Mbit/s; 0 = none
    peer_download_mbit: float = 0.0  # limit on chunk bytes fetched from peers, Mbit/s; 0 = none
    bucket_mbit: float = 0.0  # limit on chunk bytes read from the bucket, Mbit/s; 0 = none
    max_per_peer: int = 4  # chunk requests in flight to any one peer
    endgame_chunks: int = 4  # when this few chunks are left, ask a second source for each
    peers_dns: str = ""  # host:port whose DNS A/AAAA records are all the daemons (k8s headless Service)
    peers_dns_interval_s: float = 10.0  # how often peers_dns is re-resolved
    progress_interval_s: float = 0.5  # how often download progress is persisted for resume
    api_token: str = field(default="", repr=False)  # bearer token for the fleet hot-load API
    api_token_file: str = ""
    log_level: str = "info"
    log_json: bool = False

    # ---- loading -------------------------------------------------------------------------
    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str] | None = None,
        env: dict[str, str] | None = None,
        overrides: dict[str, Any] | None = None,
    ) -> Config:
        """Build a Config from a TOML file, the environment and overrides; validate it.

        Raises:
            ConfigError: unknown key, wrong type, unreadable file, missing required value.
        """
        cfg = cls()
        hints = get_type_hints(cls)
        if path:
            try:
                with open(path, "rb") as f:
                    data = tomllib.load(f)
            except OSError as e:
                raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
            except tomllib.TOMLDecodeError as e:
                raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
            if set(data) == {"bdnd"} and isinstance(data["bdnd"], dict):
                data = data["bdnd"]
            for k, v in data.items():
                cfg._set(k, v, hints, f"{path}: ")
        env = os.environ if env is None else env
        for k, v in env.items():
            if not k.startswith("BDN_") or k in ("BDN_URL",):
                continue
            name = k[4:].lower()
            if name not in hints:
                continue  # other BDN_* variables belong to the CLIs
            cfg._set(name, _from_env(v, hints[name], k), hints, f"environment {k}: ")
        for k, v in (overrides or {}).items():
            if v is not None:
                cfg._set(k, v, hints, "flag ")
        cfg._finish()
        return cfg

    def _set(self, key: str, value: Any, hints: dict[str, Any], where: str) -> None:
        if key not in hints:
            raise ConfigError(f"{where}unknown config key {key!r}")
        t = hints[key]
        ok = (
            (t is bool and isinstance(value, bool))
            or (t is int and isinstance(value, int) and not isinstance(value, bool))
            or (t is float and isinstance(value, (int, float)) and not isinstance(value, bool))
            or (t is str and isinstance(value, str))
            or (t == list[str] and isinstance(value, list) and all(isinstance(x, str) for x in value))
        )
        if not ok:
            tname = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(t, "a list of strings")
            raise ConfigError(f"{where}config key {key!r} must be {tname}, got {value!r}")
        setattr(self, key, float(value) if t is float else value)

    def _finish(self) -> None:
        if not self.bucket:
            raise ConfigError("config key 'bucket' is required (s3://, gs:// or file:// URL)")
        if self.partition_secret_file:
            self.partition_secret = _read_secret(self.partition_secret_file, "partition_secret_file")
        if not self.partition_secret:
            raise ConfigError(
                "a partition secret is required: set partition_secret_file "
                "(or BDN_PARTITION_SECRET_FILE / BDN_PARTITION_SECRET)"
            )
        if self.api_token_file:
            self.api_token = _read_secret(self.api_token_file, "api_token_file")
        if not self.node_id:
            self.node_id = socket.gethostname()
        if not NODE_ID_RE.match(self.node_id):
            raise ConfigError(f"config key 'node_id' must match {NODE_ID_RE.pattern}, got {self.node_id!r}")
        for key in ("peer_listen", "local_listen"):
            v = getattr(self, key)
            if v and _split_hostport(v, key) is None:
                raise ConfigError(f"config key {key!r} must be host:port, got {v!r}")
        for key in ("max_inflight", "bucket_concurrency"):
            if getattr(self, key) < 1:
                raise ConfigError(f"config key {key!r} must be >= 1")
        if not self.advertise_url:
            host, port = _split_hostport(self.peer_listen, "peer_listen")  # type: ignore[misc]
            if host in ("0.0.0.0", "::", ""):
                host = socket.gethostname()
            self.advertise_url = f"http://{host}:{port}"
        self.peers = [p.rstrip("/") for p in self.peers if p.strip()]
        if self.apply_workers <= 0:
            self.apply_workers = os.cpu_count() or 2

    def public_dict(self) -> dict[str, Any]:
        """The configuration without secrets, for logs and the status endpoint."""
        d = dataclasses.asdict(self)
        d.pop("partition_secret", None)
        d.pop("api_token", None)
        return d


def _split_hostport(v: str, key: str) -> tuple[str, int] | None:
    host, sep, port = v.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        return None
    return host.strip("[]"), int(port)


def split_hostport(v: str) -> tuple[str, int]:
    """``"127.0.0.1:7080"`` -> ``("127.0.0.1", 7080)`` (brackets around IPv6 hosts removed)."""
    r = _split_hostport(v, "")
    if r is None:
        raise ConfigError(f"not host:port: {v!r}")
    return r


def _from_env(v: str, t: Any, name: str) -> Any:
    if t is bool:
        if v.lower() in ("1", "true", "yes", "on"):
            return True
        if v.lower() in ("0", "false", "no", "off", ""):
            return False
        raise ConfigError(f"environment {name}: expected true/false, got {v!r}")
    if t is int or t is float:
        try:
            return t(v)
        except ValueError:
            raise ConfigError(f"environment {name}: expected a number, got {v!r}") from None
    if t == list[str]:
        return [x.strip() for x in v.split(",") if x.strip()]
    return v


def _read_secret(path: str, key: str) -> str:
    try:
        text = Path(path).read_text().strip()
    except OSError as e:
        raise ConfigError(f"{key}: cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{key}: {path} is not UTF-8 text") from None
    if not text:
        raise ConfigError(f"{key}: {path} is empty")
    return text
