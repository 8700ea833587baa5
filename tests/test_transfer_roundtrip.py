"""bdn.transfer over real loopback sockets and real /dev/shm files: many chunks bit-exact,
several streams and threads, the asyncio pool, admission (busy / not here / wait), fd caching,
bounded memory."""

from __future__ import annotations

import asyncio
import os
import threading
import tracemalloc

import pytest

from bdn.proto import wire
from bdn.transfer import (
    GRANTED,
    NOT_HERE,
    Busy,
    FetchPool,
    Granted,
    Outcome,
    Peer,
    TransferClient,
    TransferServer,
)
from support.api import wait_for
from support.transfer import KEYS, Target, make_chunk_file

CHUNK = 1 << 20


@pytest.fixture
def src(shm):
    # 37 chunks of 1 MiB and a short last one
    return make_chunk_file(shm / "model.safetensors", 37 * CHUNK + 12345, CHUNK)


def _fetch_all(client, peer, src, target, order=None):
    results = []
    for i in order if order is not None else range(len(src.digests)):
        off, n = i * src.chunk_size, min(src.chunk_size, src.size - i * src.chunk_size)
        results.append(client.fetch_into(peer, src.address(i), target.map, off, n, src.digests[i]))
    return results


def test_many_chunks_bit_exact_over_one_persistent_stream(shm, src):
    with TransferServer(KEYS, "srv", src.resolve) as srv:
        client = TransferClient(KEYS, "cli", streams_per_peer=1)
        target = Target(shm / "out", src.size)
        try:
            peer = Peer("srv", *srv.address)
            results = _fetch_all(client, peer, src, target, order=reversed(range(len(src.digests))))
            assert all(r.ok for r in results), results
            assert target.map[:] == src.path.read_bytes()
            assert srv.stats.connections == 1 and client.streams_open(peer) == 1
            # the server counts a chunk once sendfile returns, which may be after the client has it
            wait_for(
                lambda: srv.stats.chunks_out,
                60,
                "the server to count every chunk out",
                0.01,
                until=lambda n: n >= len(src.digests),
            )
            assert srv.stats.chunks_out == len(src.digests) and srv.stats.bytes_out == src.size
        finally:
            client.close()
            target.close()


def test_threads_and_streams_from_two_servers(shm, src):
    with TransferServer(KEYS, "a", src.resolve) as a, TransferServer(KEYS, "b", src.resolve) as b:
        client = TransferClient(KEYS, "cli", streams_per_peer=2)
        target = Target(shm / "out", src.size)
        peers = [Peer("a", *a.address), Peer("b", *b.address)]
        failures: list[object] = []

        def worker(k: int) -> None:
            for i in range(k, len(src.digests), 6):
                off, n = i * CHUNK, min(CHUNK, src.size - i * CHUNK)
                r = client.fetch_into(peers[i % 2], src.address(i), target.map, off, n, src.digests[i])
                if not r.ok:
                    failures.append(r)

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert not failures
            assert target.map[:] == src.path.read_bytes()
            assert all(client.streams_open(p) <= 2 for p in peers)
            assert a.stats.connections <= 2 and b.stats.connections <= 2
        finally:
            client.close()
            target.close()


def test_fetch_pool_from_asyncio(shm, src):
    with TransferServer(KEYS, "srv", src.resolve) as srv:
        client = TransferClient(KEYS, "cli", streams_per_peer=2)
        pool = FetchPool(client, workers=2)
        target = Target(shm / "out", src.size)
        peer = Peer("srv", *srv.address)

        async def main():
            return await asyncio.gather(
                *(
                    pool.fetch(
                        peer, src.address(i), target.map, i * CHUNK, min(CHUNK, src.size - i * CHUNK), src.digests[i]
                    )
                    for i in range(len(src.digests))
                )
            )

        try:
            results = asyncio.run(main())
            assert [r.outcome for r in results] == [Outcome.OK] * len(src.digests)
            assert target.map[:] == src.path.read_bytes()
        finally:
            pool.close()
            client.close()
            target.close()


def test_partial_range_of_a_chunk(shm, src):
    from bdn.proto.chunks import digest

    with TransferServer(KEYS, "srv", src.resolve) as srv:
        client = TransferClient(KEYS, "cli")
        target = Target(shm / "out", CHUNK)
        data = src.path.read_bytes()[3 * CHUNK : 4 * CHUNK]
        try:
            piece = data[1000:5000]
            r = client.fetch_into(
                Peer("srv", *srv.address), src.address(3), target.map, 0, 4000, digest(piece), chunk_offset=1000
            )
            assert r.ok and target.map[:4000] == piece
            # a range past the chunk's end is not held here
            r = client.fetch_into(
                Peer("srv", *srv.address), src.address(3), target.map, 0, 4000, digest(piece), chunk_offset=CHUNK - 10
            )
            assert r.outcome is Outcome.NOT_HERE
        finally:
            client.close()
            target.close()


def test_admission_busy_not_here_and_release(shm, src):
    verdicts = {src.address(0): Busy(0.75), src.address(1): NOT_HERE}
    released: list[tuple[str, bool]] = []
    seen: list[tuple[str, str]] = []

    def admit(peer: str, ask: wire.Ask):
        seen.append((peer, ask.snapshot or ""))
        v = verdicts.get(ask.address)
        return v if v is not None else Granted(lambda sent: released.append((ask.address, sent)))

    with TransferServer(KEYS, "srv", src.resolve, admit=admit) as srv:
        client = TransferClient(KEYS, "cli", streams_per_peer=1)
        target = Target(shm / "out", src.size)
        peer = Peer("srv", *srv.address)
        try:
            r0 = client.fetch_into(peer, src.address(0), target.map, 0, CHUNK, src.digests[0], snapshot="step000001")
            r1 = client.fetch_into(peer, src.address(1), target.map, CHUNK, CHUNK, src.digests[1])
            r2 = client.fetch_into(peer, src.address(2), target.map, 2 * CHUNK, CHUNK, src.digests[2])
            absent = client.fetch_into(peer, "ab" * 16, target.map, 0, CHUNK, src.digests[0])
            assert (r0.outcome, r0.retry_after_s) == (Outcome.BUSY, 0.75)
            assert r1.outcome is Outcome.NOT_HERE and r2.ok and absent.outcome is Outcome.NOT_HERE
            # every grant is released once its answer is out, also when resolve then found nothing
            # (then not as sent: the daemon counts only chunks that went out whole)
            wait_for(lambda: len(released) == 2, 60, "both grants released", 0.01)
            assert released == [(src.address(2), True), ("ab" * 16, False)]
        finally:
            client.close()
            target.close()
    assert seen[0] == ("cli", "step000001")
    assert srv.stats.busy == 1 and srv.stats.not_here == 2


def test_owner_holds_a_request_while_it_fetches(shm, src):
    """``wait_s``: the admission blocks until the chunk is indexed, then the bytes flow."""
    arrived = threading.Event()
    held = threading.Event()
    index: dict[str, tuple[str, int, int]] = {}

    def admit(peer: str, ask: wire.Ask):
        if ask.address not in index:
            held.set()
            arrived.wait(ask.wait_ms / 1000)
        return GRANTED if ask.address in index else NOT_HERE

    with TransferServer(KEYS, "owner", index.get, admit=admit) as srv:
        client = TransferClient(KEYS, "cli", io_timeout_s=5)
        pool = FetchPool(client, workers=1)
        target = Target(shm / "out", src.size)
        try:
            fut = pool.submit(
                Peer("owner", *srv.address), src.address(5), target.map, 5 * CHUNK, CHUNK, src.digests[5], wait_s=30
            )
            assert held.wait(60)
            assert not fut.done()
            index.update(src.table)
            arrived.set()
            assert fut.result(60).ok
            assert target.map[5 * CHUNK : 6 * CHUNK] == src.path.read_bytes()[5 * CHUNK : 6 * CHUNK]
        finally:
            pool.close()
            client.close()
            target.close()


def test_take_is_decided_by_the_server_and_answered_on_a_busy_peer(shm, src):
    # the owner's word on a read given up (bdn.daemon.fetch.fetcher.give): what the hook says,
    # asked with the asking peer's proven node id; refused without a hook; answered even while
    # every pooled stream to the owner is held by a parked request (a stream of its own)
    asked: list[tuple[str, str, int]] = []
    parked, release = threading.Event(), threading.Event()

    def on_take(peer: str, take: wire.Take) -> bool:
        asked.append((peer, take.identity, take.index))
        return take.index % 2 == 0

    def admit(peer: str, ask: wire.Ask):
        parked.set()
        release.wait(60)
        return GRANTED

    with (
        TransferServer(KEYS, "srv", src.resolve, admit=admit, on_take=on_take) as srv,
        TransferServer(KEYS, "old", src.resolve) as old,
    ):
        client = TransferClient(KEYS, "cli", streams_per_peer=1)
        peer, old_peer = Peer("srv", *srv.address), Peer("old", *old.address)
        target = Target(shm / "out", src.size)
        try:
            assert client.take(peer, "step000001", 4) is True
            assert client.take(peer, "step000001", 5) is False
            assert client.take(old_peer, "step000001", 4) is False  # no hook: every TAKE refused
            t = threading.Thread(
                target=client.fetch_into, args=(peer, src.address(0), target.map, 0, src.chunk_size, src.digests[0])
            )
            t.start()
            assert parked.wait(60)
            assert client.streams_open(peer) == 1  # the only pooled stream is held by the ask
            assert client.take(peer, "step000001", 6) is True
            release.set()
            t.join(60)
            assert asked == [("cli", "step000001", 4), ("cli", "step000001", 5), ("cli", "step000001", 6)]
            wait_for(lambda: srv.stats.takes == 3 and srv.stats.given == 2, 60, "counted", 0.01)
            with pytest.raises(ValueError):
                client.take(peer, "", 0)
        finally:
            release.set()
            client.close()
            target.close()


def _fds_to(path) -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == str(path):
                n += 1
        except OSError:
            pass
    return n


def test_file_descriptors_cached_then_forgotten_and_replaced_files_reopened(shm, src):
    with TransferServer(KEYS, "srv", src.resolve) as srv:
        client = TransferClient(KEYS, "cli")
        target = Target(shm / "out", src.size)
        peer = Peer("srv", *srv.address)
        try:
            assert all(r.ok for r in _fetch_all(client, peer, src, target))
            assert _fds_to(src.path) == 1  # opened once for 38 chunks
            srv.forget(src.path)
            wait_for(lambda: _fds_to(src.path) == 0, 60, "the descriptor closed", 0.01)
            # the file is replaced under the same path (new inode): the new bytes are served
            new = make_chunk_file(shm / "new", src.size, CHUNK)
            os.replace(new.path, src.path)
            r = client.fetch_into(peer, src.address(0), target.map, 0, CHUNK, src.digests[0])
            assert r.outcome is Outcome.CORRUPT  # old digest, new bytes: caught by the receiver
            wait_for(lambda: _fds_to(src.path) == 1, 60, "the new file opened once", 0.01)
        finally:
            client.close()
            target.close()


def test_bounded_memory_no_allocation_per_chunk(shm):
    src = make_chunk_file(shm / "big", 4 * (16 << 20), 16 << 20)
    with TransferServer(KEYS, "srv", src.resolve) as srv:
        client = TransferClient(KEYS, "cli", streams_per_peer=1)
        target = Target(shm / "out", src.size)
        peer = Peer("srv", *srv.address)
        try:
            assert all(r.ok for r in _fetch_all(client, peer, src, target))  # warm: stream open
            tracemalloc.start()
            for _ in range(16):  # 1 GiB
                assert all(r.ok for r in _fetch_all(client, peer, src, target))
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            assert peak < 1 << 20, f"{peak} bytes allocated in Python while receiving 1 GiB"
        finally:
            client.close()
            target.close()


def test_many_chunks_bit_exact_into_a_file_descriptor(shm, src):
    with TransferServer(KEYS, "srv", src.resolve) as srv:
        client = TransferClient(KEYS, "cli", streams_per_peer=2)
        fd = os.open(shm / "out", os.O_RDWR | os.O_CREAT, 0o600)
        peer = Peer("srv", *srv.address)
        try:
            os.posix_fallocate(fd, 0, src.size)
            tracemalloc.start()
            for i in reversed(range(len(src.digests))):
                off, n = i * CHUNK, min(CHUNK, src.size - i * CHUNK)
                assert client.fetch_into(peer, src.address(i), fd, off, n, src.digests[i]).ok
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            assert peak < 2 << 20  # the 1 MiB receive buffer is per thread (a mapping), nothing per chunk
            assert (shm / "out").read_bytes() == src.path.read_bytes()
        finally:
            client.close()
            os.close(fd)


def test_idle_stream_closed_by_the_server_is_replaced_not_failed(shm, src):
    with TransferServer(KEYS, "srv", src.resolve, idle_timeout_s=0.2) as srv:
        client = TransferClient(KEYS, "cli", streams_per_peer=1)
        target = Target(shm / "out", src.size)
        peer = Peer("srv", *srv.address)
        try:
            assert client.fetch_into(peer, src.address(0), target.map, 0, CHUNK, src.digests[0]).ok
            # the server dropped the idle stream
            wait_for(srv.open_connections, 60, "the server to drop the idle stream", 0.01, until=lambda n: not n)
            assert client.fetch_into(peer, src.address(1), target.map, CHUNK, CHUNK, src.digests[1]).ok
            assert srv.stats.connections == 2
            client.close_peer(peer)
            assert client.streams_open(peer) == 0
        finally:
            client.close()
            target.close()


def test_without_a_digest_the_bytes_arrive_unchecked_for_the_caller_to_verify(shm, src):
    """``digest`` None (a snapshot without a manifest: its chunk ids are no digests): the answer
    is OK once it arrived whole, wrong bytes included; with the digest the same bytes are CORRUPT."""
    swapped = {src.address(0): src.table[src.address(1)]}  # the server answers chunk 0 with chunk 1's bytes
    with TransferServer(KEYS, "srv", swapped.get) as srv:
        client = TransferClient(KEYS, "cli", streams_per_peer=1)
        try:
            peer = Peer("srv", *srv.address)
            buf = bytearray(CHUNK)
            r = client.fetch_into(peer, src.address(0), buf, 0, CHUNK, None)
            assert r.outcome is Outcome.OK and bytes(buf) == src.path.read_bytes()[CHUNK : 2 * CHUNK], r
            for into in (bytearray(CHUNK), os.open(shm / "out", os.O_RDWR | os.O_CREAT, 0o600)):
                try:
                    r = client.fetch_into(peer, src.address(0), into, 0, CHUNK, src.digests[0])
                    assert r.outcome is Outcome.CORRUPT, r
                finally:
                    if isinstance(into, int):
                        os.close(into)
            r = client.fetch_into(peer, src.address(1), buf, 0, CHUNK, None)
            assert r.outcome is Outcome.NOT_HERE, r
        finally:
            client.close()
