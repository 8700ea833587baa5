"""``bdnd``: the per-node daemon. Startup, main loop, shutdown and signals, uvicorn-style.

Exit status: 0 after SIGTERM/SIGINT, 2 on a configuration error (one line on stderr, before
anything listens), 1 when a port cannot be bound.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import sys
import time

from aiohttp import web

from bdn import __version__
from bdn.daemon.config import Config, ConfigError, split_hostport
from bdn.proto.errors import BdnError

log = logging.getLogger("bdn.bdnd")


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            "node_id": _NODE_ID,
        }
        for key in ("snapshot", "peer"):
            value = getattr(record, key, None)
            if value is not None:
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


_NODE_ID = ""
# Libraries whose INFO lines are not the daemon's news (botocore logs every credential lookup).
QUIET_LOGGERS = ("aiohttp.access", "botocore", "boto3", "s3transfer", "urllib3")


def setup_logging(cfg: Config) -> None:
    """Text or JSON (one object per line, with node_id and snapshot/peer fields) logs on stderr."""
    global _NODE_ID
    _NODE_ID = cfg.node_id
    h = logging.StreamHandler(sys.stderr)
    if cfg.log_json:
        h.setFormatter(_JsonFormatter())
    else:
        h.setFormatter(logging.Formatter(f"%(asctime)s {cfg.node_id} %(levelname)s %(name)s: %(message)s"))
    from bdn.daemon.logctx import ContextFilter

    h.addFilter(ContextFilter())
    root = logging.getLogger()
    root.handlers[:] = [h]
    root.setLevel(cfg.log_level.upper())
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


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


async def serve(cfg: Config) -> int:
    """Run one daemon until SIGTERM/SIGINT: start the node, both servers, notify systemd; 0 or 1."""
    from bdn.daemon.local_api import make_local_app
    from bdn.daemon.node import Node
    from bdn.daemon.peer_server import make_peer_app

    node = Node(cfg)
    await node.start()
    runners: list[web.AppRunner] = []
    try:
        # keepalive_timeout also bounds a connection that never completes a request (aiohttp
        # arms it at connect), so idle or slowloris connections cannot pile up for minutes.
        peer_runner = web.AppRunner(make_peer_app(node), access_log=None, keepalive_timeout=15)
        await peer_runner.setup()
        runners.append(peer_runner)
        host, port = split_hostport(cfg.peer_listen)
        await web.TCPSite(peer_runner, host or None, port, reuse_address=True).start()
        local_runner = web.AppRunner(make_local_app(node), access_log=None, keepalive_timeout=75)
        await local_runner.setup()
        runners.append(local_runner)
        if cfg.local_listen:
            lhost, lport = split_hostport(cfg.local_listen)
            await web.TCPSite(local_runner, lhost, lport, reuse_address=True).start()
        if cfg.local_socket:
            if os.path.exists(cfg.local_socket):
                os.unlink(cfg.local_socket)
            await web.UnixSite(local_runner, cfg.local_socket).start()
    except OSError as e:
        log.error("cannot listen: %s", e)
        for r in runners:
            await r.cleanup()
        await node.stop()
        return 1
    log.info(
        "bdnd %s listening: peers on %s (advertised %s), local API on %s%s; swarm %s; bucket %s",
        cfg.node_id, cfg.peer_listen, cfg.advertise_url, cfg.local_listen or "-",
        f" and {cfg.local_socket}" if cfg.local_socket else "", node.keys.swarm_id, cfg.bucket,
    )
    await node.after_listen()
    sd_notify("READY=1\nSTATUS=serving")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("bdnd %s stopping", cfg.node_id)
    sd_notify("STOPPING=1")
    for r in reversed(runners):
        await r.cleanup()
    await node.stop()
    return 0


SECRET_KEYS = ("partition_secret", "api_token")  # files or environment only: argv shows in ps


def build_parser() -> argparse.ArgumentParser:
    """``bdnd``'s flags: ``--config`` plus one flag per config key (``--shm-dir`` for ``shm_dir``)."""
    ap = argparse.ArgumentParser(
        prog="bdnd",
        description="bdn per-node checkpoint distribution daemon. Every option is a config key: "
        "set it in the TOML file (--config), as BDN_<KEY> in the environment, or as a flag; "
        "later sources win (defaults < file < environment < flags).",
        epilog="Secrets are read from files (partition_secret_file, api_token_file) or the "
        "environment (BDN_PARTITION_SECRET, BDN_API_TOKEN), never from flags. Exit status: 0 after "
        "SIGTERM/SIGINT, 1 when a port cannot be bound, 2 on a configuration error. SIGHUP is ignored.",
    )
    ap.add_argument("--version", action="version", version=f"bdn {__version__}")
    ap.add_argument("--config", metavar="FILE", help="TOML config file (see deploy/bdnd.toml.example)")
    for name, typ, default, help_text in Config.keys():
        if name in SECRET_KEYS:
            continue
        flag = "--" + name.replace("_", "-")
        env = f"BDN_{name.upper()}"
        shown = ",".join(default) if isinstance(default, list) else default
        text = f"{help_text} [{env}; default {shown!r}]"
        if typ is bool:
            ap.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=text)
        elif typ in (int, float):
            ap.add_argument(flag, dest=name, type=typ, default=None, metavar="N", help=text)
        elif typ == list[str]:
            ap.add_argument(flag, dest=name, default=None, metavar="URL,...", help=text + " (comma list)")
        else:
            ap.add_argument(flag, dest=name, default=None, metavar="VALUE", help=text)
    return ap


def main(argv: list[str] | None = None) -> int:
    """The ``bdnd`` console script: flags -> Config -> serve(). Exit 0, 1 (cannot listen) or 2 (config)."""
    args = build_parser().parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if k != "config" and v is not None}
    if isinstance(overrides.get("peers"), str):
        overrides["peers"] = [p.strip() for p in overrides["peers"].split(",") if p.strip()]
    try:
        cfg = Config.load(args.config, overrides=overrides)
        from bdn.proto.keys import derive_keys

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
            return runner.run(serve(cfg))
        except BdnError as e:
            log.error("%s", e)
            return 1
        finally:
            log.info("bdnd ran %.1f s", time.monotonic() - t0)


if __name__ == "__main__":
    sys.exit(main())
