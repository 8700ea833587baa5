"""bench/soak/objprobe.py: the census counts what a bdn instance's containers hold (also dicts of
atomic values, which the cyclic collector does not track) and the growth table names them."""

from __future__ import annotations

import gc
import json
import logging
from pathlib import Path

from bdn.daemon.observe.lograte import RepeatLog
from bench.soak.objprobe import census, growth


def test_census_counts_a_growing_structure(tmp_path: Path) -> None:
    rl = RepeatLog(logging.getLogger("test.objprobe"), 60.0)
    # The type counts are the interpreter's net counts: garbage of earlier tests collected between
    # the two censuses would offset the growth (seen in CI: +217 tuples for 600 made), so collect
    # first and hold the collector off in between.
    gc.collect()
    gc.disable()
    try:
        before = census()
        for i in range(300):
            rl._kinds[("kind", i)] = (float(i), i)  # what RepeatLog.log adds per new kind
        after = census()
    finally:
        gc.enable()
    assert after["owned"]["RepeatLog._kinds"][0] - before["owned"].get("RepeatLog._kinds", [0, 0])[0] == 300
    # the 300 (float, int) tuples are reachable only through the dict: counted one level down
    assert after["types"]["tuple"][0] - before["types"]["tuple"][0] >= 300
    f = tmp_path / "objprobe.jsonl"
    f.write_text("".join(json.dumps({"t_s": t, **c}) + "\n" for t, c in ((0.0, before), (60.0, after))))
    table = growth(f)
    owned = table.split("types:")[0]
    assert "+300  RepeatLog._kinds" in owned, table
    # 300 more dict slots, keys (str, int) tuples and values (float, int) tuples: > 300 * 2 * 56 bytes
    grew = after["owned"]["RepeatLog._kinds"][2] - before["owned"].get("RepeatLog._kinds", [0, 0, 0])[2]
    assert grew > 300 * 2 * 56, grew
