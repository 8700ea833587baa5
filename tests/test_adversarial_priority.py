"""A delta that comes while the background catch-up runs (bdn/daemon/apply/forward.py) on the
lowered threads (``background_nice``, bdn/priority.py), with real bdnd processes, real safetensors
files and a ``file://`` bucket.

Found by breaker5: with the cores busy at nice 0 (other processes, an engine serving), the
catch-up at nice +10 gets about a tenth of what they get, and ``Forward.settle`` made the delta
wait for the whole of it. Measured on this 2-core machine with three ``while 1: pass`` at nice 0
next to bdnd (150 MB model, 2 % changed per step, 5 deltas back to back, each POSTed while a
catch-up was in flight): the deltas' ``queued`` stage (their wait in ``settle``) had a median of
4.3 s (1.8-17.3 s) at ``background_nice`` 10 and 0.58 s (0.30-4.1 s) at 0, while the same sparse
apply done by the delta itself took 0.5-0.8 s. A delta now stops the catch-up before its next
file and brings the spares the catch-up did not reach forward itself, at normal priority.

The catch-up is held in its first file until the delta waits (failpoint
``catch_up.first_claimed``: a lowered thread that made no progress while the cores were busy).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bdn.daemon.process import failpoints
from bdn.proto.keys import derive_keys
from support.api import wait_for
from support.chains import file_chain, load_step, step_id
from support.swarm import SECRET, Daemon, sparse_counters

CHUNK = 64 << 10
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
SWARM_ID = derive_keys(SECRET).swarm_id
ENV = {"BDN_LOAD_STARTUP": "false", "BDN_KEEP_READY": "1", "BDN_GC_GRACE_S": "0"}

pytestmark = pytest.mark.timeout(600)


def test_a_delta_waits_for_the_catch_up_file_in_flight_only_and_brings_the_rest_forward_itself(
    tmp_path: Path,
) -> None:
    steps = 4
    chain = file_chain(
        tmp_path, steps, chunk_size=CHUNK, frac=0.02, formats={v: "bdn_planes_v1" for v in range(2, steps + 2)}
    )
    held = step_id(3)
    d = Daemon(
        tmp_path / "work",
        "node0",
        chain.url,
        extra_env=dict(ENV, **{failpoints.ENV: f"catch_up.first_claimed={held}"}),
    )
    d.start([])
    try:
        d.wait_healthy()
        for v in range(1, steps + 2):
            load_step(d, chain.dirs, v, SHARDS)
            if v == 3:  # the spares of step 2 are being brought forward to step 3: the first is held
                wait_for(
                    lambda: f"failpoint catch_up.first_claimed reached ({held})" in d.log_path.read_text(),
                    120,
                    f"the catch-up to {held} in its first file",
                )
        log = d.log_path.read_text()
        # the file in flight was finished; the other was left to the delta, which waited for no more
        assert f"catch-up to {held} stopped before 1 of {len(SHARDS)} file(s)" in log, log[-4000:]
        assert log.count(f"brought forward to {held} in the background") == 1
        line = next(ln for ln in log.splitlines() if f"{step_id(4)}: " in ln and "brought forward sparsely" in ln)
        # the file caught up to step 3 took one delta, the one left at step 2 two
        assert f"{len(SHARDS)} file(s) brought forward sparsely (2 delta(s)" in line, line
        got = sparse_counters(d)
        assert got["fallbacks"] == 0 and got["chunks_bad"] == 0, got
    finally:
        d.stop()
