"""The engine table and target kept across a restart (bdn/daemon/replica/registry.py): written and read back
as it was; a file that is missing, too large, not JSON, of another format, or with malformed or
repeated entries restores nothing or skips those entries, never raises; at most ``limit``."""

from __future__ import annotations

import json
from pathlib import Path

from bdn.daemon.replica import registry
from bdn.daemon.replica.engines import Engine


def test_a_table_round_trips_and_bad_files_or_entries_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / registry.FILE_NAME
    assert registry.load(path, 10) == ([], None)
    engines = [Engine("a1", "hf", acked="step000002", offered="step000003"), Engine("b2", "vllm")]
    registry.save(path, registry.encode(engines, {"identity": "step000003"}))
    assert registry.load(path, 10) == (
        [registry.Registered("a1", "hf", "step000002", "step000003"), registry.Registered("b2", "vllm", None, None)],
        {"identity": "step000003"},
    )
    assert registry.load(path, 1)[0] == [registry.Registered("a1", "hf", "step000002", "step000003")]
    for text in ("{", "[]", json.dumps({"format": "other", "engines": []}), " " * (registry.MAX_BYTES + 1)):
        path.write_text(text)
        assert registry.load(path, 10) == ([], None)
    good = {"engine_id": "c3", "name": "x", "acked": None}
    bad = [
        "nope",
        {"engine_id": "../x", "name": "x"},
        {"engine_id": "d4", "name": 5},
        {"engine_id": "e5", "name": "x", "acked": "../../etc"},
        {"engine_id": "f6", "name": "x", "offered": 7},
        good,
    ]
    path.write_text(json.dumps({"format": registry.FORMAT, "engines": [good, *bad]}))
    assert registry.load(path, 10) == ([registry.Registered("c3", "x", None, None)], None)
