"""``bdnd``: the per-node daemon's command line: flags -> Config -> run (``bdn.daemon.app``
holds the lifecycle: signals, startup, main loop, shutdown).

Exit status: 0 after SIGTERM/SIGINT, 2 on a configuration error (one line on stderr, before
anything listens), 1 when a port cannot be bound.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import socket
import sys
import time

from bdn.daemon.app import App
from bdn.daemon.config import Config, ConfigError
from bdn.daemon.logctx import ContextFilter
from bdn.proto.errors import BdnError
from bdn.proto.keys import derive_keys

log = logging.getLogger("bdn.bdnd")


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in ("snapshot", "peer"):
            value = getattr(record, key, None)
            if value is not None:
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup_logging(cfg: Config) -> None:
    """Text or JSON (one object per line, with snapshot/peer fields) logs on stderr."""
    h = logging.StreamHandler(sys.stderr)
    if cfg.log_json:
        h.setFormatter(_JsonFormatter())
    else:
        h.setFormatter(logging.Formatter(f"%(asctime)s {cfg.node_id} %(levelname)s %(name)s: %(message)s"))
    h.addFilter(ContextFilter())
    root = logging.getLogger()
    root.handlers[:] = [h]
    root.setLevel(cfg.log_level.upper())
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def _raise_fd_limit() -> None:
    """Use the hard RLIMIT_NOFILE: a daemon serving a large fleet holds many sockets."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError):
        pass


def sd_notify(message: str) -> None:
    """Send ``message`` to systemd's notify socket (``$NOTIFY_SOCKET``), if there is one."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return
    if path.startswith("@"):
        path = "\0" + path[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.connect(path)
        s.sendall(message.encode())


def main(argv: list[str] | None = None) -> int:
    """The ``bdnd`` console script: flags -> Config -> ``App.serve()``. Exit 0, 1 (cannot listen) or 2 (config)."""
    ap = argparse.ArgumentParser(prog="bdnd", description="bdn per-node checkpoint distribution daemon")
    ap.add_argument("--config", help="TOML config file (see deploy/bdnd.toml.example)")
    ap.add_argument("--bucket", help="s3://bucket/prefix, gs://bucket/prefix or file:///path")
    ap.add_argument("--node-id")
    ap.add_argument("--peer-listen", help="host:port of the peer server")
    ap.add_argument("--advertise-url", help="URL peers use to reach this daemon")
    ap.add_argument("--local-listen", help="loopback host:port of the local API")
    ap.add_argument("--local-socket", help="unix socket path for the local API")
    ap.add_argument("--peers", help="comma-separated static peer URLs")
    ap.add_argument("--shm-dir")
    ap.add_argument("--partition-secret-file")
    ap.add_argument("--log-json", action="store_true", default=None)
    args = ap.parse_args(argv)
    overrides = {
        "bucket": args.bucket,
        "node_id": args.node_id,
        "peer_listen": args.peer_listen,
        "advertise_url": args.advertise_url,
        "local_listen": args.local_listen,
        "local_socket": args.local_socket,
        "peers": [p.strip() for p in args.peers.split(",") if p.strip()] if args.peers else None,
        "shm_dir": args.shm_dir,
        "partition_secret_file": args.partition_secret_file,
        "log_json": args.log_json,
    }
    try:
        cfg = Config.load(args.config, overrides=overrides)
        derive_keys(cfg.partition_secret)
    except (ConfigError, BdnError) as e:
        print(f"bdnd: error: {e}", file=sys.stderr)
        return 2
    setup_logging(cfg)
    _raise_fd_limit()
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:  # uvloop is a dependency, but the daemon still runs without it
        runner = asyncio.Runner()
    t0 = time.monotonic()
    with runner:
        try:
            return runner.run(App(cfg, notify=sd_notify).serve())
        except BdnError as e:
            log.error("%s", e)
            return 1
        finally:
            log.info("bdnd ran %.1f s", time.monotonic() - t0)


if __name__ == "__main__":
    sys.exit(main())
