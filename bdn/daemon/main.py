"""``bdnd``: the per-node daemon's command line: flags -> Config -> run (``bdn.daemon.app``
holds the lifecycle: signals, startup, main loop, shutdown).

Exit status: 0 after SIGTERM/SIGINT (the process is gone within ``shutdown_timeout_s``), 2 on a
configuration error or a ``shm_dir`` another process holds (one line on stderr, before anything
listens), 1 on an unexpected error, a second SIGTERM while stopping, or a stop stuck past
``shutdown_timeout_s`` + 5 s (every thread's stack is in the log then). SIGUSR1 writes every
thread's stack to the log.
"""

from __future__ import annotations

import os
import signal
import sys


class EarlyStop(SystemExit):
    """SIGTERM/SIGINT before the App's handlers are in place: exit 0 (nothing was started)."""


def _stop_early(signum: int, frame: object) -> None:
    raise EarlyStop(0)


# Before the heavy imports below (aiohttp, numpy, boto3: ~0.3 s): the default action of SIGTERM
# would end bdnd by the signal, which systemd and Kubernetes report as a failure. Only when this
# module is the program (``bdnd``, ``python -m bdn.daemon.main``), not when a test imports it.
IS_PROGRAM = __name__ == "__main__" or os.path.basename(sys.argv[0] if sys.argv else "") == "bdnd"
if IS_PROGRAM:
    signal.signal(signal.SIGTERM, _stop_early)
    signal.signal(signal.SIGINT, _stop_early)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the App logs a SIGHUP once its handlers are in

import argparse  # the handlers above come first on purpose (E402 off for this file: pyproject.toml)
import asyncio
import faulthandler
import json
import logging
import socket
import time
from typing import Any, NoReturn

from bdn import __version__
from bdn.daemon.app import App
from bdn.daemon.config import Config, ConfigError
from bdn.daemon.observe.logctx import ContextFilter
from bdn.daemon.process.listening import CannotListen
from bdn.daemon.process.shmlock import ShmFull, ShmLock
from bdn.daemon.process.shutdown import StopClock, join_workers
from bdn.proto.errors import BdnError
from bdn.proto.keys import derive_keys

log = logging.getLogger("bdn.bdnd")


def plain(value: object) -> object:
    """A log argument as an operator reads it: a dict as ``key=value`` pairs, a list, tuple or
    set as a comma list, a path as its text, a float to 3 decimals; anything else unchanged
    (identities, node ids and URLs are passed as plain strings and logged with ``%s``)."""
    if isinstance(value, dict):
        return " ".join(f"{k}={plain(v)}" for k, v in value.items())
    if isinstance(value, (list, tuple, set, frozenset)):
        return ",".join(str(plain(v)) for v in value)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, float):
        return round(value, 3)
    return value


class PlainArgs(logging.Filter):
    """Renders every record's arguments with :func:`plain`, so no Python repr (``{'a': 1}``,
    ``['x']``, ``PosixPath(...)``) reaches a message, in text and in JSON logs alike."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and args:
            record.args = tuple(plain(a) for a in args)
        elif isinstance(args, dict) and args:
            record.args = {k: plain(v) for k, v in args.items()}
        return True


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
    h.addFilter(ContextFilter())
    h.addFilter(PlainArgs())
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


SECRET_KEYS = ("partition_secret", "api_token")  # files or environment only: argv shows in ps


class _OneLineParser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # no prefix matching: "--partition-secret X" was taken as --partition-secret-file X
        # (a new user's report; the error then printed the secret as a file name)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        # argparse would print the whole usage block (30+ lines of flags); the rule is one line.
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """``bdnd``'s flags: ``--config`` plus one flag per config key (``--shm-dir`` for ``shm_dir``)."""
    ap = _OneLineParser(
        prog="bdnd",
        description="bdn per-node checkpoint distribution daemon. Every option is a config key: "
        "set it in the TOML file (--config), as BDN_<KEY> in the environment, or as a flag; "
        "later sources win (defaults < file < environment < flags).",
        epilog="Secrets are read from files (partition_secret_file, api_token_file) or the "
        "environment (BDN_PARTITION_SECRET, BDN_API_TOKEN), never from flags. Exit status: 0 after "
        "SIGTERM/SIGINT (within shutdown_timeout_s), 1 on an unexpected error or a stuck stop, 2 on a "
        "configuration error (a listen address in use included). SIGHUP is ignored; SIGUSR1 logs every thread's stack.",
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
    """The ``bdnd`` console script: flags -> Config -> ``App.serve()``. Exit 0, 1 (an unexpected error) or 2 (config, a port in use, no room in shm_dir for the store).

    As the program (``IS_PROGRAM``) it does not return once the daemon ran: the process ends with
    ``os._exit`` after the logs are flushed, within ``shutdown_timeout_s`` of the stop request
    (``bdn.daemon.process.shutdown``)."""
    args = build_parser().parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if k != "config" and v is not None}
    if isinstance(overrides.get("peers"), str):
        overrides["peers"] = [p.strip() for p in overrides["peers"].split(",") if p.strip()]
    try:
        cfg = Config.load(args.config, overrides=overrides)
        derive_keys(cfg.partition_secret)
        shm_lock = ShmLock.acquire(cfg.shm_dir)  # held until the process ends; ShmInUse -> exit 2
    except (ConfigError, BdnError) as e:
        print(f"bdnd: error: {e}", file=sys.stderr)
        return 2
    setup_logging(cfg)
    # SIGUSR1: every thread's stack on stderr (the log), for a daemon that seems stuck (stdlib
    # faulthandler: it writes from the signal handler, so it works while the event loop is blocked).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    _raise_fd_limit()
    runner = asyncio.Runner()
    if cfg.event_loop == "uvloop":
        try:
            import uvloop

            runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
        except ImportError:  # uvloop is a dependency, but the daemon still runs without it
            pass
    t0 = time.monotonic()
    bound = True
    stop = StopClock(watchdog=True)
    code = 1
    with runner:  # closing it cancels what is left and shuts the default executor (no waiting)
        try:
            code = runner.run(App(cfg, notify=sd_notify, shm_lock=shm_lock, stop_clock=stop).serve())
        except (
            CannotListen,
            ShmFull,
            ConfigError,
        ) as e:  # found at bind / at the store's or bucket's creation: one line, exit 2
            bound = False
            print(f"bdnd: error: {e}", file=sys.stderr)
            code = 2
        except BdnError as e:
            log.error("%s", e)
            code = 1
    if bound:
        log.info("bdnd ran %.1f s", time.monotonic() - t0)
    # The interpreter would join every worker thread at exit, without a bound (one may sit in a
    # bucket read); the rest of shutdown_timeout_s is theirs, then they are abandoned.
    abandoned = join_workers(stop.left() if stop.deadline is not None else cfg.shutdown_timeout_s)
    if IS_PROGRAM or abandoned:
        # Everything kept is on disk (progress files, READY snapshots) and the logs are flushed
        # here: the interpreter's own finalisation (a garbage collection of every object, module
        # teardown) only frees memory the kernel frees anyway, and took 40 s of wall time at
        # nice 19 on a loaded machine (docs/decisions/0029-bounded-shutdown.md).
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    stop.disarm()
    return code


if __name__ == "__main__":
    sys.exit(main())
