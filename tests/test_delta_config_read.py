"""bdn.daemon.apply.delta_config reads config.json at its size: the whole small file, at most one byte
over MAX_CONFIG_BYTES for a big one (refused by parse_config), never a 1 MiB buffer for a file of
a few hundred bytes (issue 12's soak: those blocks fragmented glibc's heap)."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import pytest

from bdn.daemon.apply import delta_config
from bdn.daemon.errors import Conflict
from bdn.daemon.replica.contract import MAX_CONFIG_BYTES


def test_small_file_whole_without_a_limit_sized_buffer(tmp_path: Path) -> None:
    p = tmp_path / "config.json"
    p.write_bytes(b'{"hidden_size": 384}')
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        got = delta_config._read(p)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got == b'{"hidden_size": 384}'
    assert peak < 64 << 10  # was MAX_CONFIG_BYTES + 1


def test_big_file_at_most_one_byte_over_and_refused(tmp_path: Path) -> None:
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "config.json").write_bytes(b" " * (MAX_CONFIG_BYTES + 100))
    assert len(delta_config._read(tmp_path / "a" / "config.json") or b"") == MAX_CONFIG_BYTES + 1
    with pytest.raises(Conflict, match="over the"):
        delta_config.check_delta_config("s2", "s1", tmp_path / "a", tmp_path / "b")


def test_missing_file_is_none(tmp_path: Path) -> None:
    assert delta_config._read(tmp_path / "config.json") is None
