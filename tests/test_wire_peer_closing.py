"""A stopping daemon's transfer server answers at once instead of waiting for the event loop
(bdn/daemon/serve/wire_peer.py, ``WirePeer.closing``).

``App.shutdown`` closes the transfer server on the event loop, and ``TransferServer.close`` joins
the connection threads; a thread in ``admit`` (or ``take``) waits for a decision that only that
loop can make. Found by the one-hour soak: a daemon's loop and two connection threads waited for
each other until its 20 s watchdog ended it with exit 1. The loop is really blocked here (as the
join blocks it), the decision a coroutine that never finishes (an owner holding a request while
it fetches); nothing is timed: the thread must answer once the daemon says it is stopping."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

from bdn.daemon.config import Config
from bdn.daemon.observe.stats import Stats
from bdn.daemon.serve.wire_peer import WirePeer
from bdn.daemon.store.index import ChunkIndex
from bdn.proto import wire
from bdn.proto.keys import derive_keys
from bdn.transfer import NOT_HERE

KEYS = derive_keys("3f1c0e9a8b7d6c5e4f3a2b1c0d9e8f7a")


class HeldServing:
    """An owner that holds every request (``ChunkServing.request`` waiting for a chunk)."""

    def __init__(self) -> None:
        self.entered = threading.Event()

    async def request(self, address, wait, hint, cut, asker=None):  # noqa: ANN001, ANN201
        self.entered.set()
        await asyncio.sleep(3600)


def test_a_thread_waiting_in_admit_answers_once_the_daemon_stops_while_the_loop_is_blocked() -> None:
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    serving = HeldServing()
    cfg = Config(node_id="n1", transfer_listen="127.0.0.1:0")
    disk = ThreadPoolExecutor(1)
    wp = WirePeer(cfg, KEYS, ChunkIndex(KEYS.address), Stats(), disk)
    wp.start(loop, serving, None)  # type: ignore[arg-type]  # no HAVE subscriber asks here
    answers: list[object] = []
    blocked, release = threading.Event(), threading.Event()
    try:
        asker = threading.Thread(target=lambda: answers.append(wp.admit("n2", wire.Ask("ab" * 16, 0, 1, 60_000))))
        asker.start()
        assert serving.entered.wait(60)  # the decision is held on the loop
        loop.call_soon_threadsafe(lambda: (blocked.set(), release.wait(120)))  # the loop joins threads now
        assert blocked.wait(60)
        late = threading.Thread(target=lambda: answers.append(wp.take("n2", wire.Take("step000001", 0))))
        wp.close_client()  # App.shutdown says the daemon stops
        late.start()
        asker.join(60)
        late.join(60)
        assert not asker.is_alive() and not late.is_alive()  # answered without the loop
        assert NOT_HERE in answers and False in answers
        assert wp.admit("n3", wire.Ask("cd" * 16, 0, 1, 60_000)) is NOT_HERE  # and at once from now on
    finally:
        release.set()

        async def cancel_held() -> None:  # the held decisions end with the test's loop
            held = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in held:
                t.cancel()
            await asyncio.gather(*held, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(cancel_held(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        runner.join(60)
        wp.close()
        disk.shutdown()
        loop.close()
