"""Run an engine adapter under bdn: the engine link, the hot-swap driver and (for HF) the chat server.

``HFService`` is one serving process's worth of threads, used by ``python -m bdn.engines hf`` and
by the tests (in-process, with a real HTTP server on loopback and a real bdnd)::

    svc = HFService("http://127.0.0.1:7081", "127.0.0.1", 8000, replica_id="node0").start()
    ...                       # serves /v1/chat/completions; hot-loads come from bdnd
    svc.stop()
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from aiohttp import web

from bdn import retry
from bdn.client import EngineLink
from bdn.client.errors import DaemonError, DaemonUnreachable
from bdn.engines.driver import Adapter, drive

log = logging.getLogger("bdn.engines.service")

__all__ = ["Driver", "HFService", "HttpThread", "register", "run_driver"]


def register(bdn_url: str, name: str, connect_timeout_s: float = 60.0) -> EngineLink:
    """``EngineLink`` to bdnd, retried for ``connect_timeout_s`` (engines and bdnd often start together)."""
    for attempt in retry.attempts(
        deadline_s=connect_timeout_s, first_s=0.2, max_s=2.0, on=(DaemonUnreachable, DaemonError)
    ):
        with attempt:
            return EngineLink(bdn_url, name=name)
    raise AssertionError("unreachable")


class Driver(threading.Thread):
    """``drive(link, adapter, stop=stop, **kw)`` on a daemon thread, and its prompt stop (:meth:`close`)."""

    def __init__(self, link: EngineLink, adapter: Adapter, stop: threading.Event, **kw: Any) -> None:
        self.link, self.stop_event = link, stop
        self.polling = threading.Event()  # drive sets it while it waits for an offer
        super().__init__(
            target=drive,
            args=(link, adapter),
            kwargs={"stop": stop, "polling": self.polling, **kw},
            name="bdn-hot-swap",
            daemon=True,
        )

    def close(self, unregister: bool = True, timeout_s: float = 60.0) -> None:
        """Set ``stop``, unregister from bdnd, join the thread and close the link.

        A load in progress finishes and is acked first (the thread is joined for up to
        ``timeout_s`` seconds before unregistering); a long-poll in flight does not hold the
        stop: unregistering (``DELETE /v1/engines/{id}``) makes the daemon answer it at once, and
        the thread is then joined (up to ``timeout_s``). ``unregister=False`` leaves the daemon's
        entry and the link open (a crash, in tests): the long-poll then runs to its timeout.
        """
        self.stop_event.set()
        if not unregister:
            self.join(timeout_s)
            return
        if not self.polling.is_set():  # loading: let it finish and ack before the DELETE
            self.join(timeout_s)
        self.link.unregister()
        self.join(timeout_s)
        if self.is_alive():
            log.warning("the hot-swap driver did not stop within %g s; leaving it", timeout_s)
        self.link.close()


def run_driver(link: EngineLink, adapter: Adapter, stop: threading.Event, **kw: Any) -> Driver:
    """``drive`` on a daemon thread (a :class:`Driver`), returned started; ``close()`` stops it."""
    t = Driver(link, adapter, stop, **kw)
    t.start()
    return t


class HttpThread:
    """An aiohttp application served on its own event loop thread (loopback or any host)."""

    def __init__(self, app: web.Application, host: str, port: int) -> None:
        self.app, self.host, self.port = app, host, port
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="engine-http", daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._runner = web.AppRunner(self.app, access_log=None)
            self._loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, self.host, self.port)
            self._loop.run_until_complete(site.start())
        except BaseException as exc:
            self._error = exc
            self._started.set()
            return
        self._started.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())
        self._loop.close()

    def start(self) -> HttpThread:
        """Start the server thread and wait until it listens; re-raises its start-up error."""
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise self._error
        return self

    def stop(self) -> None:
        """Stop the server's loop and join its thread (at most 30 s)."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)


class HFService:
    """HFEngine + OpenAI chat server + hot-swap driver, registered with one bdnd.

    Args:
        bdn_url: the daemon's local API.
        host, port: where the chat server listens.
        replica_id: reported in every answer's ``engine_data``.
        partial: swap changed tensors only (False: full reload on every swap).
        swap_method: ``"rebind"`` or ``"copy"`` (``bdn.engines.hf.HFEngine``).
        words: where a word-level swap writes: ``"pingpong"``, ``"inplace"`` or ``"off"`` (``HFEngine``;
            None: its default).
        background_nice: nice increment of the engine's background threads (``HFEngine``).
        poll_timeout: seconds per long-poll (``stop`` does not wait for one: it unregisters).
    """

    def __init__(
        self,
        bdn_url: str,
        host: str,
        port: int,
        replica_id: str = "replica",
        served_name: str = "model",
        partial: bool = True,
        device: str = "cpu",
        name: str = "hf",
        poll_timeout: float = 5.0,
        swap_method: str = "rebind",
        words: str | None = None,
        background_nice: int | None = None,
    ) -> None:
        from bdn.engines.hf import HFEngine
        from bdn.engines.openai_api import make_app
        from bdn.priority import BACKGROUND_NICE

        self.bdn_url = bdn_url
        self.engine = HFEngine(
            device=device,
            partial=partial,
            swap_method=swap_method,
            words=words,
            background_nice=BACKGROUND_NICE if background_nice is None else background_nice,
        )
        self.http = HttpThread(make_app(self.engine, served_name, replica_id), host, port)
        self.name = name
        self.poll_timeout = poll_timeout
        self.stop_event = threading.Event()
        self.link: EngineLink | None = None
        self._driver: Driver | None = None
        self.reports: list[dict[str, Any]] = []

    @property
    def url(self) -> str:
        """The chat server's base URL (``http://host:port``)."""
        return f"http://{self.http.host}:{self.http.port}"

    def start(self, connect_timeout_s: float = 60.0) -> HFService:
        """Start the chat server, register with the daemon (waiting up to ``connect_timeout_s``
        seconds for it) and start the hot-swap driver thread. Returns ``self``."""
        self.http.start()
        self.link = register(self.bdn_url, self.name, connect_timeout_s)
        self._driver = run_driver(
            self.link,
            self.engine,
            self.stop_event,
            poll_timeout=self.poll_timeout,
            on_swapped=lambda _s, r: self.reports.append(r),
        )
        return self

    def stop(self, unregister: bool = True) -> None:
        """Stop the driver (a swap in progress finishes; a long-poll does not hold it: see
        :meth:`Driver.close`), unregister from bdnd, then stop the chat server.
        ``unregister=False`` leaves the daemon's entry (a crash)."""
        self.stop_event.set()
        if self._driver is not None:
            self._driver.close(unregister, timeout_s=self.poll_timeout + 60)
        elif self.link is not None and unregister:
            self.link.close()
        self.http.stop()

    def __enter__(self) -> HFService:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
