"""RepeatLog (bdn.daemon.observe.lograte) and ChunkList/check_limits (bdn.daemon.store.chunklist): pure, with
a fake clock (issue 12, item 2)."""

from __future__ import annotations

import logging

import pytest

from bdn.daemon.observe.lograte import RepeatLog
from bdn.daemon.process.clock import FakeClock
from bdn.daemon.store.chunklist import ChunkList, SnapshotTooLarge, check_limits
from bdn.proto.manifest import FileEntry, Manifest


def test_repeat_log_writes_once_per_interval_then_a_summary(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    log = logging.getLogger("test.repeat")
    r = RepeatLog(log, 10.0, clock)
    with caplog.at_level(logging.WARNING, "test.repeat"):
        assert r.log(logging.WARNING, "bad", "chunk %d bad", 1)
        for i in range(2, 1000):
            assert not r.log(logging.WARNING, "bad", "chunk %d bad", i)
        assert r.log(logging.WARNING, "other", "other %d", 1)  # another kind has its own window
        clock.advance(10.0)
        assert r.log(logging.WARNING, "bad", "chunk %d bad", 1000)
    msgs = [rec.getMessage() for rec in caplog.records]
    assert msgs == ["chunk 1 bad", "other 1", "chunk 1000 bad (and 998 more like it in the last 10 s)"]


def _manifest() -> Manifest:
    files = (
        FileEntry("a.bin", 10_000, tuple(f"{i:032x}" for i in range(3))),
        FileEntry("empty.txt", 0, ()),
        FileEntry("b.bin", 4096, (f"{9:032x}",)),
    )
    return Manifest(identity="step000001", kind="full", policy_version=1, chunk_size=4096, files=files)


def test_chunk_list_is_the_manifest_order_without_one_object_per_chunk() -> None:
    m = _manifest()
    cl = ChunkList(m, result=False)
    assert list(cl) == list(m.stored_chunks())
    assert [cl[i] for i in range(len(cl))] == list(m.stored_chunks()) and cl[-1] == list(m.stored_chunks())[-1]
    assert [cl.position(r) for r in cl] == list(range(4))
    assert [cl.digest(i) for i in range(4)] == list(cl.digests()) == [r.digest for r in cl]
    with pytest.raises(IndexError):
        cl[4]
    for picked in ([], [0], [2], [3], [0, 2, 3], [0, 1, 2, 3]):
        assert cl.bytes_of(picked) == sum(cl[i].length for i in picked)


def test_limits_refuse_naming_the_numbers() -> None:
    m = _manifest()
    check_limits(m, 4, 3)
    with pytest.raises(SnapshotTooLarge, match=r"lists 4 chunks, over max_chunks_per_snapshot = 3"):
        check_limits(m, 3, 0)
    with pytest.raises(SnapshotTooLarge, match=r"lists 3 files, over max_files_per_snapshot = 2"):
        check_limits(m, 0, 2)


def test_log_args_are_rendered_without_python_reprs() -> None:
    from pathlib import Path

    from bdn.daemon.main import PlainArgs

    rec = logging.LogRecord(
        "bdn.x",
        logging.INFO,
        __file__,
        1,
        "stages %s files %s at %s took %s",
        ({"queued": 0.1234, "ready": 2}, ["a.bin", "b.bin"], Path("/dev/shm/x"), 1.23456),
        None,
    )
    assert PlainArgs().filter(rec)
    assert rec.getMessage() == "stages queued=0.123 ready=2 files a.bin,b.bin at /dev/shm/x took 1.235"


def test_peer_connect_errors_read_as_words() -> None:
    import asyncio
    import socket

    import aiohttp

    from bdn.daemon.swarm.peer_client import why

    with socket.socket() as s:  # a port nobody listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

        async def attempt() -> BaseException:
            async with aiohttp.ClientSession() as session:
                try:
                    await session.get(f"http://127.0.0.1:{port}/")
                except aiohttp.ClientError as e:
                    return e
            raise AssertionError("connected")

        text = why(asyncio.run(attempt()))
    assert text.startswith(f"cannot connect to 127.0.0.1:{port}: ") and "(" not in text and "[" not in text, text
