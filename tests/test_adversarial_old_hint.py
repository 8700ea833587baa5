"""A peer's chunk request naming an old snapshot (bdn/daemon/serve/serving.py joins the snapshot a
request hints at, so that an owner fetches what its peers fetch), with a real bdnd, real
safetensors files and a ``file://`` bucket that still holds every published step.

Found by breaker5: the catalog remembers only the newest 256 collected identities
(``MAX_COLLECTED``; a hint naming one of them is "old here"). A hint naming an older one (a new
node starting from an anchor collected here long ago) loaded the whole snapshot again, and for a
delta its base chain, though GC collects it as soon as its grace ends; under ``shm_budget_bytes``
sized for a few models that copy made this node's own next hot-load fail ("shm budget exceeded:
... in use by <the old snapshot>"). An identity published but never held here is in the same
state as one forgotten after 256 newer collections: neither in the catalog nor in the collected
set; the test uses one (``oldanchor``) rather than hot-loading 257 snapshots first. Now such a
hint costs one manifest read: the snapshot fails at once with the reason, the asker goes to its
next source, and a hint naming a newer snapshot still starts its fetch.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bdn.client.fleet import hot_load
from bdn.proto.keys import derive_keys
from bdn.publish import publish_delta, publish_full
from bdn.transfer import Outcome
from support.api import wait_for
from support.chains import file_chain, step_id
from support.swarm import SECRET, Daemon
from support.transfer import ask_daemon

CHUNK = 64 << 10
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
KEYS = derive_keys(SECRET)

pytestmark = pytest.mark.timeout(600)


def _hint(d: Daemon, identity: str) -> Outcome:
    outcome, _ = ask_daemon(
        KEYS, d.node_id, d.transfer_port, os.urandom(16).hex(), 1024, wait_s=0.1, snapshot=identity, me="newnode"
    )
    return outcome


def _record(d: Daemon, identity: str) -> dict:
    status, rec = d.request("GET", f"/v1/snapshots/{identity}")
    return rec if status == 200 else {}


def test_a_hint_naming_an_old_snapshot_loads_nothing_and_the_next_hot_load_fits_the_budget(tmp_path: Path) -> None:
    steps = 6
    chain = file_chain(tmp_path, steps, chunk_size=CHUNK, frac=0.02)
    publish_full(chain.url, "oldanchor", 1, dir=chain.dirs[0], chunk_size=CHUNK)
    publish_delta(chain.url, "olddelta", 2, "oldanchor", dir=chain.dirs[1], base_dir=chain.dirs[0], chunk_size=CHUNK)
    model = sum(p.stat().st_size for p in chain.dirs[0].rglob("*") if p.is_file())
    env = {
        "BDN_LOAD_STARTUP": "false",
        "BDN_KEEP_READY": "1",
        "BDN_GC_GRACE_S": "60",
        "BDN_SHM_BUDGET_BYTES": str(int(model * 2.5)),  # the served snapshot, the next one, a spare
    }
    d = Daemon(tmp_path / "work", "node0", chain.url, extra_env=env)
    d.start([])
    try:
        d.wait_healthy()
        previous = None
        for v in range(1, 6):
            hot_load(d.url, step_id(v), previous=previous)
            d.wait_ready(step_id(v), 300)
            previous = step_id(v)
        for old in ("oldanchor", "olddelta"):
            assert _hint(d, old) is Outcome.NOT_HERE
            rec = wait_for(lambda old=old: _record(d, old).get("state") == "failed" and _record(d, old), 120, old)
            assert "older than the 1 newest ready here (up to step000005" in rec["reason"], rec
            assert rec["bytes_from_bucket"] == 0, rec
            assert _hint(d, old) is Outcome.NOT_HERE  # the failed record answers at once
        assert not _record(d, step_id(1)), "the delta's collected base was loaded again"
        assert not (d.store / "oldanchor").exists()
        # this node's own next snapshot fits the budget
        hot_load(d.url, step_id(6), previous=previous)
        d.wait_ready(step_id(6), 300)
        for shard in SHARDS:
            assert (d.store / step_id(6) / shard).read_bytes() == (chain.dirs[5] / shard).read_bytes()
        # a hint naming a newer snapshot still makes this node fetch it (the owners' single flight)
        assert _hint(d, step_id(7)) is Outcome.NOT_HERE
        rec = d.wait_ready(step_id(7), 300)
        assert rec["requested_by"] == "peer", rec
    finally:
        d.stop()
