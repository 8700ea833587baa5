"""bdnd's configuration: one Config object, the single source of truth (uvicorn's style).

Sources, later ones winning: built-in defaults, a TOML file (``--config``, flat keys or a
``[bdnd]`` table), ``BDN_<KEY>`` environment variables (e.g. ``BDN_BUCKET``, ``BDN_PEERS`` as a
comma list), then command-line flags. Unknown keys, wrong types and unreadable secret files are
errors that name the key or file: ``bdnd`` exits before it listens.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import tomllib
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

from bdn.bucket.base import BucketError
from bdn.bucket.urls import check_bucket_url
from bdn.proto.errors import BdnError
from bdn.proto.keys import NODE_ID_RE


class ConfigError(BdnError):
    """The configuration is invalid (message names the key or file)."""


#: ``BDN_*`` variables that other parts of bdn read; bdnd ignores them instead of refusing them.
FOREIGN_ENV = frozenset(
    {
        "BDN_URL",  # bdnctl / bdn.client: the local API to talk to
        "BDN_GCS_ENDPOINT_URL",  # bdn.bucket: GCS XML API endpoint override
        "BDN_PEERS_SERVICE",  # deploy/k8s: the headless Service the entrypoint resolves
        "BDN_DEMO_SECRET",  # examples/demo.py
        "BDN_DEMO_ENGINE",  # examples/fleet.py (which starts bdnd with its own environment)
        "BDN_VLLM_KEEP_UNPACKED",  # bdn.engines.vllm_worker, in the vLLM process
        "BDN_FAILPOINTS",  # bdn/daemon/process/failpoints.py: crash tests' pause points, unset in use
    }
)
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
#: The longest duration a ``*_s`` key takes (about 31 years): longer ones overflow the C timeouts
#: they end up in (``socket.settimeout``, ``threading.Event.wait``: "timestamp out of range"), and
#: an infinite one was sent to engines as ``Infinity``, which is not JSON.
MAX_SECONDS = 1e9
#: The shortest non-zero engine_stale_s / engine_ttl_s: a held poll marks its engine seen every
#: third of the window, at least 0.05 s apart (replica/engines.py ``poll_step``); below ~0.15 s a
#: polling engine is stale at every liveness tick (measured: 23 stale/live flips in 5 s at 0.01 s).
ENGINE_WINDOW_MIN_S = 0.5
# Lower bounds of numeric keys (inclusive); every other number must be >= 0.
_MINIMUM: dict[str, float] = {
    "max_inflight": 1,
    "bucket_concurrency": 1,
    "max_uploads": 1,
    "uploads_per_chunk": 1,
    "max_per_peer": 1,
    "peer_timeout_s": 0.001,
    "manifest_poll_s": 0.001,
    "progress_interval_s": 0.001,
    "peers_dns_interval_s": 0.001,
    "foreign_chunk_size": 4096,
    "max_delta_chain": 1,
    "swim_period_s": 0.05,
    "swim_ack_timeout_s": 0.01,
    "swim_suspect_mult": 1,
    "swim_sync_interval_s": 1,
    "status_aggregators": 1,
    "status_report_s": 0.1,
    "http_header_timeout_s": 0.001,
    "memory_probe_every_s": 0.1,
    "http_max_connections": 1,
    "shm_spare_bytes": -1,
}


@dataclass
class Config:
    """Every bdnd option, with its default. Units are in the names (``_s`` seconds, ``_bytes``)."""

    bucket: str = field(
        default="", metadata={"help": "origin: s3://b/prefix, gs://b/prefix or file:///path (required)"}
    )
    partition_secret: str = field(
        default="",
        repr=False,
        metadata={
            "help": "the partition secret itself (prefer partition_secret_file; not a flag: it would show in ps)"
        },
    )
    partition_secret_file: str = field(default="", metadata={"help": "file holding the partition secret"})
    node_id: str = field(default="", metadata={"help": "this daemon's name in the swarm (default: the hostname)"})
    peer_listen: str = field(default="0.0.0.0:7080", metadata={"help": "host:port of the peer (swarm) server"})
    advertise_url: str = field(
        default="", metadata={"help": "URL peers use to reach this daemon; default http://<host>:<port>"}
    )
    local_listen: str = field(
        default="127.0.0.1:7081", metadata={"help": 'loopback host:port of the local API ("" = only local_socket)'}
    )
    local_socket: str = field(default="", metadata={"help": "optional unix socket path for the local API"})
    peers: list[str] = field(default_factory=list, metadata={"help": "static peer URLs (http://host:port)"})
    shm_dir: str = field(default="/dev/shm/bdn", metadata={"help": "snapshots are rebuilt under <shm_dir>/<swarm_id>/"})
    credentials_file: str = field(default="", metadata={"help": "reader credentials JSON (aws_access_key_id, ...)"})
    endpoint_url: str = field(
        default="", metadata={"help": "S3 API endpoint override (else AWS_ENDPOINT_URL / default)"}
    )
    require_manifest: bool = field(
        default=True,
        metadata={
            "help": "wait for bdn.manifest.json before loading a snapshot (false: a snapshot without one is read from its listing, docs/OPERATIONS.md section 9)"
        },
    )
    foreign_chunk_size: int = field(
        default=16 << 20,
        metadata={"help": "chunk size (bytes) of snapshots without a manifest; the same on every daemon"},
    )
    foreign_base: str = field(
        default="",
        metadata={
            "help": "base of a delta without a manifest when the hot-load names none (previous_snapshot_identity)"
        },
    )
    foreign_restarts: int = field(
        default=3,
        metadata={
            "help": "times a snapshot without a manifest starts again on a fresh listing when an object is replaced mid-download, before it fails naming the object"
        },
    )
    allow_unverifiable: bool = field(
        default=False,
        metadata={
            "help": "take peers' bytes of objects the bucket keeps no checksum of (file://, SSE-KMS); false: each daemon reads those itself"
        },
    )
    max_delta_chain: int = field(
        default=64,
        metadata={"help": "most deltas between a hot-load target and its anchor; past it a full snapshot is required"},
    )
    fold_deltas: bool = field(
        default=True,
        metadata={
            "help": "a delta several steps ahead of what this node has is rebuilt once from the chain (the diffs applied in place on one copy), not one ready snapshot per step"
        },
    )
    load_startup: bool = field(default=True, metadata={"help": "load STARTUP_SNAPSHOT on start"})
    startup_settle_s: float = field(
        default=5.0, metadata={"help": "at start, wait up to this long for static peers to answer"}
    )
    shutdown_timeout_s: float = field(
        default=15.0,
        metadata={
            "help": "after SIGTERM/SIGINT, the process is gone within this long: worker threads still busy then are abandoned (exit 0, progress saved); if the event loop itself is stuck, every thread's stack is logged and bdnd exits 1 five seconds later (keep it below systemd's TimeoutStopSec and Kubernetes' terminationGracePeriodSeconds)"
        },
    )
    max_inflight: int = field(default=16, metadata={"help": "chunk transfers in flight per snapshot"})
    bucket_concurrency: int = field(
        default=8,
        metadata={
            "help": "concurrent bucket requests: a chunk is read as up to this many ranged GETs (>= 512 KiB each) queued in chunk order, so an owner's chunks finish one after another and flow to peers at once (8: the bucket reads keep their share of a downlink full of peer traffic)"
        },
    )
    bucket_readers: int = field(
        default=0,
        metadata={
            "help": "how many live daemons read each snapshot from the bucket (its chunks' owners: the top by HRW of the snapshot's identity, so the role rotates per snapshot); 0 = every daemon. For large fleets: about 1.5 x the bucket's aggregate rate / (bucket_concurrency x its per-connection rate) (bdn.control.owners.reader_count)"
        },
    )
    chunk_wait_s: float = field(
        default=30.0, metadata={"help": "how long an owner may hold a chunk request while it fetches"}
    )
    owner_patience_s: float = field(
        default=600.0, metadata={"help": 'keep asking a live owner that answers "still fetching" this long'}
    )
    max_uploads: int = field(
        default=8, metadata={"help": "chunk uploads served at once; beyond, 503 sends askers to other holders"}
    )
    uploads_per_chunk: int = field(
        default=2, metadata={"help": "peers served one chunk at once; others are sent to holders (fan-out tree)"}
    )
    steal_reads: bool = field(
        default=True,
        metadata={
            "help": "a daemon whose own bucket reads of an anchor are done reads the last chunks of the owner with the most left (announced over the transfer wire, so the owner skips them; fleets within one peer set only); false: every chunk is read by its owner"
        },
    )
    cut_through: bool = field(
        default=True,
        metadata={
            "help": "an owner sends a chunk on to the askers parked on it while its bucket read still lands (over the transfer wire; the last bytes only once it verified the whole chunk); false: store and forward"
        },
    )
    manifest_wait_s: float = field(
        default=600.0, metadata={"help": "how long a prefetch waits for the manifest to appear"}
    )
    manifest_poll_s: float = field(
        default=1.0, metadata={"help": "how often a waiting prefetch looks for the manifest"}
    )
    peer_timeout_s: float = field(default=60.0, metadata={"help": "one peer request (after any wait)"})
    penalty_s: float = field(default=30.0, metadata={"help": "how long a peer that sent bad bytes is skipped"})
    sparse_apply: bool = field(
        default=True,
        metadata={
            "help": 'a bdn_planes_v1 delta is applied in place to a spare that holds an earlier snapshot of the file, writing only the changed words (DESIGN.md, "Sparse apply"); false: every delta is a full apply'
        },
    )
    sparse_max_chain: int = field(
        default=4, metadata={"help": "most deltas a spare may be behind to be brought forward sparsely"}
    )
    sparse_seed_mbit: float = field(
        default=8000.0,
        metadata={
            "help": 'when no spare holds the served snapshot (an anchor, a cold start), a buffer is copied from it in the background at this rate, Mbit/s (full speed once a delta waits for it), so the next bdn_planes_v1 delta applies sparsely too (DESIGN.md, "Sparse apply"); 0 = no such copy (that delta is a full apply)'
        },
    )
    apply_workers: int = field(default=0, metadata={"help": "threads decoding deltas (0 = one per core)"})
    background_nice: int = field(
        default=10,
        metadata={
            "help": "nice increment (0-19) of the threads doing work no hot-load waits for: a freed spare's catch-up, background seeds, the scrub (bdn/priority.py); 0 = the daemon's own priority"
        },
    )
    keep_ready: int = field(
        default=2, metadata={"help": "GC keeps this many newest ready snapshots (plus leased/current/target)"}
    )
    engine_ttl_s: float = field(
        default=30.0,
        metadata={
            "help": "an engine that has not polled for this long is dropped and its leases released (0 = never; else at least 0.5 s); must exceed its longest prepare + swap"
        },
    )
    memory_probe_dir: str = field(
        default="",
        metadata={
            "help": 'diagnosis only, slows the daemon: trace Python allocations and append what grew, RssAnon by mapping and the sizes of long-lived structures to DIR/memprobe.jsonl every memory_probe_every_s ("" = off)'
        },
    )
    memory_probe_trace: bool = field(
        default=True,
        metadata={
            "help": "the memory probe traces Python allocations (tracemalloc: what grew, by code line); false: pymalloc's own arena figures instead, which CPython gives only untraced"
        },
    )
    memory_probe_every_s: float = field(
        default=300.0, metadata={"help": "seconds between two lines of the memory probe"}
    )
    engine_stale_s: float = field(
        default=10.0,
        metadata={
            "help": "an engine not heard from (poll, heartbeat, ack) for this long is stale: the replica stops waiting for it and says so; live again when heard from (0 = never stale; else at least 0.5 s; above engine_ttl_s it has no effect)"
        },
    )
    gc_grace_s: float = field(
        default=60.0,
        metadata={
            "help": "a snapshot that just became ready is kept at least this long, unless it was the hot-load target, served or leased and no longer is"
        },
    )
    shm_budget_bytes: int = field(
        default=0, metadata={"help": "most bytes of snapshots (rebuilt + stored diffs) in shm; 0 = no budget"}
    )
    shm_spare_bytes: int = field(
        default=-1,
        metadata={
            "help": "most bytes of collected snapshots' shm files kept (no process mapping or holding them) to become the next snapshot's files, counted in shm_budget_bytes; -1 = as many as the largest snapshot collected, 0 = none"
        },
    )
    peer_upload_mbit: float = field(
        default=0.0, metadata={"help": "limit on chunk bytes served to peers, Mbit/s; 0 = none"}
    )
    peer_download_mbit: float = field(
        default=0.0, metadata={"help": "limit on chunk bytes fetched from peers, Mbit/s; 0 = none"}
    )
    bucket_mbit: float = field(
        default=0.0, metadata={"help": "limit on chunk bytes read from the bucket, Mbit/s; 0 = none"}
    )
    max_per_peer: int = field(default=4, metadata={"help": "chunk requests in flight to any one peer"})
    endgame_chunks: int = field(
        default=4, metadata={"help": "when this few chunks are left, ask a second source for each"}
    )
    peers_dns: str = field(
        default="", metadata={"help": "host:port whose DNS A/AAAA records are all the daemons (k8s headless Service)"}
    )
    peers_dns_interval_s: float = field(default=10.0, metadata={"help": "how often peers_dns is re-resolved"})
    progress_interval_s: float = field(
        default=0.5, metadata={"help": "how often download progress is persisted for resume"}
    )
    api_token: str = field(
        default="",
        repr=False,
        metadata={"help": "bearer token for the fleet hot-load API (prefer api_token_file; not a flag)"},
    )
    api_token_file: str = field(
        default="", metadata={"help": "file holding the bearer token of the fleet hot-load API"}
    )
    max_chunks_per_snapshot: int = field(
        default=2_000_000,
        metadata={"help": "a manifest listing more chunks (stored plus rebuilt) is refused; 0 = no limit"},
    )
    max_files_per_snapshot: int = field(
        default=200_000, metadata={"help": "a manifest listing more files is refused; 0 = no limit"}
    )
    log_repeat_s: float = field(
        default=10.0,
        metadata={
            "help": "a log line repeated per chunk or per peer is written once per this interval, then one summary line"
        },
    )
    log_level: str = field(default="info", metadata={"help": "debug, info, warning, error or critical"})
    log_json: bool = field(default=False, metadata={"help": "one JSON object per log line"})
    event_loop: str = field(
        default="uvloop",
        metadata={
            "help": "the asyncio event loop: uvloop, or asyncio (the standard library's; for A/B runs and debugging)"
        },
    )
    transfer_listen: str = field(
        default="auto",
        metadata={
            "help": 'host:port of the transfer server, the one path of every chunk between daemons (the wire of bdn.proto.wire); "auto" = the peer host and port + 1 (+ 2 where local_listen has + 1); it cannot be turned off'
        },
    )
    transfer_advertise: str = field(
        default="",
        metadata={
            "help": 'host:port peers use to reach the transfer server (NAT, a Service port); "" = the advertise_url host and the bound port'
        },
    )
    chunk_log: str = field(
        default="",
        metadata={
            "help": 'path of a JSON-lines log with one line per chunk fetched (source, start, end, bytes, retries, busy answers); "" = off'
        },
    )
    scrub_mbit: float = field(
        default=0.0,
        metadata={
            "help": "background re-hash of every ready snapshot's chunks in shm at this rate, Mbit/s, over and over (a chunk gone bad is quarantined and fetched again); 0 = off"
        },
    )
    http_header_timeout_s: float = field(
        default=10.0,
        metadata={
            "help": "a connection to the peer port or the local API whose request headers are not complete this long after connect (or after its first bytes on a keep-alive connection) is closed (slowloris)"
        },
    )
    http_max_connections: int = field(
        default=4096,
        metadata={
            "help": "most open connections on each HTTP listener (peer port, local API); more are answered 503 and closed"
        },
    )
    local_allow_remote: bool = field(
        default=False, metadata={"help": "allow local_listen on a non-loopback address (the local API has no auth)"}
    )
    # membership and hot-load spread (bdn.control; DESIGN.md "Membership", "Hot-load")
    swim_period_s: float = field(
        default=1.0, metadata={"help": "SWIM protocol period: each daemon probes one member per period"}
    )
    swim_ack_timeout_s: float = field(
        default=0.5,
        metadata={"help": "SWIM: without an ack this long after a ping, ask swim_indirect_k members to probe"},
    )
    swim_indirect_k: int = field(
        default=3, metadata={"help": "SWIM: members asked for an indirect probe of a member that missed its ack"}
    )
    swim_suspect_mult: float = field(
        default=5.0,
        metadata={"help": "SWIM: a suspect is dead after this many periods x max(1, log10(N+1)) unless it refutes"},
    )
    swim_sync_interval_s: float = field(
        default=30.0,
        metadata={
            "help": "SWIM: full-table exchange with one random member this often (scaled with log N above 32 members)"
        },
    )
    hotload_fanout: int = field(
        default=0,
        metadata={
            "help": "a daemon that adopts a newer hot-load target pushes it to this many random members (0: ceil(ln N) + 3; a fixed 3 leaves about 5 percent of a large fleet to the SWIM piggyback)"
        },
    )
    status_aggregators: int = field(
        default=3, metadata={"help": "daemons that collect replica stages for the fleet hot-load GET"}
    )
    status_report_s: float = field(
        default=10.0,
        metadata={"help": "each replica re-reports its stage to the aggregators this often (and at once on a change)"},
    )

    # ---- loading -------------------------------------------------------------------------
    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
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
            if "bdnd" in data and isinstance(data["bdnd"], dict):
                others = sorted(k for k in data if k != "bdnd")
                if others:
                    raise ConfigError(
                        f"{path}: keys outside the [bdnd] table: {', '.join(others)} (put every key "
                        "in [bdnd], or use flat keys without a table)"
                    )
                data = data["bdnd"]
            for k, v in data.items():
                if isinstance(v, dict):
                    raise ConfigError(f"{path}: unknown table [{k}] (bdnd reads flat keys or one [bdnd] table)")
            for k, v in data.items():
                cfg._set(k, v, hints, f"{path}: ")
        env = os.environ if env is None else env
        for k, v in env.items():
            if not k.startswith("BDN_") or k in ("BDN_URL",):
                continue
            if k in FOREIGN_ENV:
                continue  # read by bdnctl, the bucket layer or the deploy scripts, not by bdnd
            name = k[4:].lower()
            if name not in hints:
                raise ConfigError(
                    f"environment {k}: unknown variable (bdnd reads BDN_<KEY> for its config keys; see bdnd --help)"
                )
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
            tname = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(
                t, "a list of strings"
            )
            raise ConfigError(f"{where}config key {key!r} must be {tname}, got {value!r}")
        setattr(self, key, float(value) if t is float else value)

    def _finish(self) -> None:
        if not self.bucket:
            raise ConfigError("config key 'bucket' is required (s3://, gs:// or file:// URL)")
        _check_bucket_url(self.bucket)
        if self.log_level.lower() not in LOG_LEVELS:
            raise ConfigError(f"config key 'log_level' must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if self.event_loop not in ("uvloop", "asyncio"):
            raise ConfigError(f"config key 'event_loop' must be uvloop or asyncio, got {self.event_loop!r}")
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                lo = _MINIMUM.get(f.name, 0)
                if v < lo or v != v:
                    raise ConfigError(f"config key {f.name!r} must be >= {lo:g}, got {v!r}")
                if not math.isfinite(v) or (f.name.endswith("_s") and v > MAX_SECONDS):
                    raise ConfigError(
                        f"config key {f.name!r} must be a finite number"
                        + (f" of at most {MAX_SECONDS:g} s (0 turns most timers off)" if f.name.endswith("_s") else "")
                        + f", got {v!r}"
                    )
        if self.background_nice > 19:
            raise ConfigError(f"config key 'background_nice' must be 0-19, got {self.background_nice!r}")
        for key in ("engine_stale_s", "engine_ttl_s"):
            v = getattr(self, key)
            if 0 < v < ENGINE_WINDOW_MIN_S:
                raise ConfigError(
                    f"config key {key!r} must be 0 (off) or at least {ENGINE_WINDOW_MIN_S:g} s, got {v!r}: a polling "
                    "engine is marked seen every third of it and no more often than every 0.05 s, so a shorter "
                    "window flags live engines"
                )
        if not self.shm_dir.strip():
            raise ConfigError("config key 'shm_dir' must be a directory path, got ''")
        # absolute: the snapshot paths the local API hands to engines and clients (other
        # processes, other working directories) are under it; "" was the daemon's own cwd
        self.shm_dir = os.path.abspath(self.shm_dir)
        if not self.local_listen and not self.local_socket:
            raise ConfigError("the local API needs local_listen (loopback host:port) or local_socket (a path)")
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
        if self.local_listen and not self.local_allow_remote:
            lhost = split_hostport(self.local_listen)[0]  # checked as host:port above
            if lhost not in LOOPBACK_HOSTS and not lhost.startswith("127."):
                raise ConfigError(
                    f"config key 'local_listen' is {self.local_listen!r}, not a loopback address: the local "
                    "API has no authentication; set local_allow_remote = true to allow it anyway"
                )
        if not self.transfer_listen:
            # refused, not read as "auto": "" used to turn the wire off, and an operator who set
            # it so expects no listener; silently opening one would surprise their firewall
            raise ConfigError(
                "config key 'transfer_listen' cannot be empty: chunks move between daemons only "
                'over the transfer wire; set "auto" (the default) or host:port'
            )
        if self.transfer_listen != "auto" and _split_hostport(self.transfer_listen, "transfer_listen") is None:
            raise ConfigError(
                f"config key 'transfer_listen' must be host:port or \"auto\", got {self.transfer_listen!r}"
            )
        if self.transfer_advertise and _split_hostport(self.transfer_advertise, "transfer_advertise") is None:
            raise ConfigError(
                f"config key 'transfer_advertise' must be host:port or \"\", got {self.transfer_advertise!r}"
            )
        if not self.advertise_url:
            host, port = split_hostport(self.peer_listen)  # checked as host:port above
            if host in ("0.0.0.0", "::", ""):
                host = socket.gethostname()
            self.advertise_url = f"http://{host}:{port}"
        self.peers = [p.rstrip("/") for p in self.peers if p.strip()]
        for key, urls in (("peers", self.peers), ("advertise_url", [self.advertise_url])):
            for url in urls:
                _check_peer_url(url, key)
        if self.endpoint_url:
            _check_peer_url(self.endpoint_url, "endpoint_url", any_path=True)
        if self.peers_dns and _split_hostport(self.peers_dns, "peers_dns") is None:
            raise ConfigError(f"config key 'peers_dns' must be host:port, got {self.peers_dns!r}")
        if self.apply_workers <= 0:
            self.apply_workers = os.cpu_count() or 2

    @classmethod
    def keys(cls) -> list[tuple[str, Any, Any, str]]:
        """Every config key as ``(name, type, default, help)``, in declaration order (for --help)."""
        hints = get_type_hints(cls)
        out = []
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                raise TypeError(f"config key {f.name!r} has no default")
            out.append((f.name, hints[f.name], default, f.metadata.get("help", "")))
        return out


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
    if t is float:
        try:
            return float(v)
        except ValueError:
            raise ConfigError(f"environment {name}: expected a number, got {v!r}") from None
    if t is int:
        try:
            return int(v)
        except ValueError:
            pass
        try:
            f = float(v)  # 1e9, 4.0: integral values written as floats are fine
        except ValueError:
            f = float("nan")
        if f == f and f not in (float("inf"), float("-inf")) and f == int(f):
            return int(f)
        raise ConfigError(f"environment {name}: expected an integer, got {v!r}")
    if t == list[str]:
        return [x.strip() for x in v.split(",") if x.strip()]
    return v


def _check_bucket_url(url: str) -> None:
    """Refuse a malformed bucket URL at load time, with the reason the bucket layer gives."""
    try:
        check_bucket_url(url)
    except BucketError as e:
        raise ConfigError(f"config key 'bucket': {e}") from None


def _check_peer_url(url: str, key: str, any_path: bool = False) -> None:
    """Refuse a peer URL that is not ``http(s)://host[:port]`` (``10.0.0.2:7080`` without a
    scheme was taken and the peer never answered); ``any_path``: a path is allowed (an S3
    endpoint behind a proxy)."""
    what = "an URL http(s)://host[:port][/path]" if any_path else "URLs http://host:port"
    try:
        u = urllib.parse.urlsplit(url)
        _ = u.port  # raises ValueError on a bad port
    except ValueError:  # a bad port, or an unclosed '[' ("Invalid IPv6 URL")
        raise ConfigError(f"config key {key!r} must hold {what}, got {url!r}") from None
    if (
        u.scheme not in ("http", "https")
        or not u.hostname
        or (u.path not in ("", "/") and not any_path)
        or u.query
        or u.fragment
    ):
        raise ConfigError(f"config key {key!r} must hold {what}, got {url!r}")


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
