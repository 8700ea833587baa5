"""``python -m bdn.engines hf|sglang|vllm``: run an engine adapter under the node's bdnd.

    python -m bdn.engines hf --bdn-url http://127.0.0.1:7081 --listen 127.0.0.1:8000 --replica-id node0
    python -m bdn.engines sglang --bdn-url http://127.0.0.1:7081 --engine-url http://127.0.0.1:30000
    python -m bdn.engines vllm --bdn-url http://127.0.0.1:7081 --engine-url http://127.0.0.1:8000

``hf`` serves the model itself (OpenAI-compatible chat, bdn.engines.openai_api); ``sglang`` and
``vllm`` drive a server started separately on bdn's snapshot directory. Each registers with bdnd
(retried for ``--connect-timeout`` seconds) and hot-swaps until SIGTERM/SIGINT (exit 0). Exit 2
with one line on a usage error, 1 when the engine cannot start.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING

from bdn.cli.helpfmt import DefaultsFormatter
from bdn.proto.errors import BdnError

if TYPE_CHECKING:
    from bdn.engines.driver import Adapter

log = logging.getLogger("bdn.engines")
# httpx logs every request at INFO (the long-poll to bdnd, every 5 s); httpcore its connections at DEBUG.
QUIET_LOGGERS = ("httpx", "httpcore")


def _hostport(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host or "127.0.0.1", int(port)


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 <= v < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text!r}")
    return v


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m bdn.engines`` (subcommands ``hf``, ``sglang``, ``vllm``)."""
    from bdn import __version__

    ap = argparse.ArgumentParser(
        prog="python -m bdn.engines", description="run an engine adapter under bdnd", formatter_class=DefaultsFormatter
    )  # every --help shows the defaults
    ap.add_argument("--version", action="version", version=f"bdn {__version__}")  # as bdnd, bdnctl, bdn-publish
    sub = ap.add_subparsers(dest="engine", required=True)
    for name in ("hf", "sglang", "vllm"):
        p = sub.add_parser(name, formatter_class=DefaultsFormatter)
        p.add_argument("--bdn-url", default="http://127.0.0.1:7081", help="the node's bdnd local API")
        p.add_argument("--name", default=name, help="the engine's name in bdnd's logs")
        p.add_argument("--connect-timeout", type=_seconds, default=60.0, help="seconds to wait for bdnd")
        p.add_argument(
            "--log-level",
            default="info",
            choices=["debug", "info", "warning", "error"],
            help="the adapter's logging level",
        )
        if name == "hf":
            p.add_argument("--listen", type=_hostport, default=("127.0.0.1", 8000), help="HOST:PORT of the chat server")
            p.add_argument("--replica-id", default="replica", help="reported in every answer's engine_data")
            p.add_argument("--served-model-name", default="model", help="the model name the chat server answers to")
            p.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
            p.add_argument("--full-reload", action="store_true", help="reload every tensor on every swap")
            p.add_argument(
                "--swap-in-place",
                action="store_true",
                help="copy new tensors into the parameters' own storage in the pause (pointer-stable, "
                "for captured kernels) instead of rebinding the parameters to them",
            )
            p.add_argument(
                "--words",
                choices=("pingpong", "inplace", "off"),
                default=None,
                help="a bdn_planes_v1 delta on the served snapshot: XOR its changed words into spare buffers "
                "kept one step behind while serving, the pause a rebind (pingpong, the default: two copies of "
                "the changed parameters), into the parameters in the pause (inplace, one copy of the model; "
                "the default with --swap-in-place), or stage the changed tensors from the snapshot (off)",
            )
            p.add_argument(
                "--background-nice",
                type=int,
                choices=range(20),
                metavar="0-19",
                default=None,
                help="nice increment of the engine's background threads (the ping-pong catch-up after a "
                "swap, checksums after a load), so they give the cores to serving and to the next ack "
                "(default 10; 0 = the engine's own priority)",
            )
        else:
            p.add_argument("--engine-url", required=True, help="the engine server's base URL")
            p.add_argument("--api-key", default=None, help="the engine's API key (bearer token)")
            p.add_argument(
                "--full-reload",
                action="store_true",
                help="load the whole snapshot on every swap (default: only the changed tensors when "
                "possible; docs/ENGINES.md)",
            )
        if name == "vllm":
            p.add_argument(
                "--require-weight-change",
                action="store_true",
                help="fail a swap whose reload changed no weight checksum",
            )
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run the adapter ``argv`` names (default ``sys.argv[1:]``) until SIGTERM/SIGINT.

    Returns the exit status: 0 after a clean stop, 1 when the engine cannot start or bdnd is
    unreachable (a :class:`BdnError`, one line on stderr). A usage error exits 2 from argparse.
    """
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger().level))
    stop = threading.Event()
    signalled: list[str] = []  # the signals' names, for the log

    def on_signal(signum: int, _frame: object) -> None:
        signalled.append(signal.Signals(signum).name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    try:
        if a.engine == "hf":
            from bdn.engines.service import HFService

            svc = HFService(
                a.bdn_url,
                a.listen[0],
                a.listen[1],
                replica_id=a.replica_id,
                served_name=a.served_model_name,
                partial=not a.full_reload,
                device=a.device,
                name=a.name,
                swap_method="copy" if a.swap_in_place else "rebind",
                words=a.words,
                background_nice=a.background_nice,
            )
            svc.start(a.connect_timeout)
            print(f"serving on {svc.url}; hot-loads from {a.bdn_url}", flush=True)
            stop.wait()
            t0 = time.monotonic()
            log.info("%s: stopping", ", ".join(signalled) or "stop")
            svc.stop()
            log.info("stopped in %.2f s", time.monotonic() - t0)
            return 0
        from bdn.engines.service import register, run_driver
        from bdn.engines.sglang import SGLangAdapter
        from bdn.engines.vllm import VLLMAdapter

        adapter: Adapter
        if a.engine == "sglang":
            adapter = SGLangAdapter(a.engine_url, a.api_key, partial=not a.full_reload)
        else:
            adapter = VLLMAdapter(
                a.engine_url, a.api_key, require_change=a.require_weight_change, partial=not a.full_reload
            )
        link = register(a.bdn_url, a.name, a.connect_timeout)
        t = run_driver(link, adapter, stop, poll_timeout=5.0)
        print(f"driving {a.engine} at {a.engine_url}; hot-loads from {a.bdn_url}", flush=True)
        stop.wait()
        t0 = time.monotonic()
        log.info("%s: stopping", ", ".join(signalled) or "stop")
        t.close()
        adapter.close()
        log.info("stopped in %.2f s", time.monotonic() - t0)
        return 0
    except BdnError as exc:
        print(f"python -m bdn.engines: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    code = main()
    # Stopped, unregistered and flushed: the interpreter's own finalisation (module teardown, a
    # collection of every object) only frees memory, and with torch and transformers loaded it
    # held the process 4-14 s after "stopped in 0.07 s" on a loaded 2-core machine (three hf
    # engines stopping at load 13), past `make demo`'s 10 s before SIGKILL. End here, as bdnd does.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
