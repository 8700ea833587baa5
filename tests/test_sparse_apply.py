"""Sparse apply through real bdnd processes and real safetensors files (DESIGN.md, "Sparse apply";
issue 28): a node turns snapshot N into N+1 by applying ``bdn_planes_v1`` deltas in place to a
spare that holds an earlier snapshot of each shard, writing only the changed words.

Promises checked: a chain of 20 sparse deltas ends byte-identical to the trainer's files at every
step (and the daemon says it applied them sparsely); a buffer whose bytes are not what its tag
says is refused (one log line naming the buffer's snapshot and the delta's base) and the file is
applied in full, correct; a killed daemon restarted mid-chain makes the snapshot READY with the
trainer's bytes; a byte flipped in a READY snapshot's buffer is found by the scrub and the
snapshot is no longer ready (not offered); the pure kernel's result equals a full apply.
"""

from __future__ import annotations

import os
import re
import zlib
from pathlib import Path

import numpy as np
import pytest

from bdn import fileops
from bdn.proto import arc, sparse
from bdn.proto.errors import ChecksumError
from bdn.proto.keys import derive_keys
from support.api import wait_for
from support.chains import ANCHOR, chain_states, file_chain, load_step, step_id, write_chain
from support.swarm import SECRET, Daemon, sparse_counters

CHUNK = 64 << 10
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
SWARM_ID = derive_keys(SECRET).swarm_id
ENV = {"BDN_LOAD_STARTUP": "false", "BDN_KEEP_READY": "1", "BDN_GC_GRACE_S": "0"}

pytestmark = pytest.mark.timeout(600)


def _state(d: Daemon, identity: str) -> str:
    status, rec = d.request("GET", f"/v1/snapshots/{identity}")
    return rec.get("state", "") if status == 200 else ""


def _load(d: Daemon, identity: str) -> None:
    assert d.prefetch(identity)[0] in (200, 202)
    d.wait_ready(identity, 300)


def _same_as_trainer(d: Daemon, identity: str, trainer: Path) -> None:
    got = d.shm_dir / SWARM_ID / identity
    for shard in SHARDS:
        assert (got / shard).read_bytes() == (trainer / shard).read_bytes(), f"{identity}/{shard}"


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "numpy"])
def test_kernel_matches_a_full_apply_and_refuses_a_wrong_buffer(tmp_path: Path, fused: bool) -> None:
    dirs = write_chain(tmp_path / "ck", chain_states(2, frac=0.02))
    shard = SHARDS[0]
    diff = tmp_path / "d"
    fileops.write_diff_file(dirs[0] / shard, dirs[1] / shard, diff, "bdn_planes_v1")
    buf = np.fromfile(dirs[0] / shard, dtype=np.uint8)
    header = fileops.read_header(dirs[0] / shard)
    d = np.fromfile(diff, dtype=np.uint8)
    _, streams = arc.read_diff_header(d, len(d))
    res = sparse.apply_sparse(buf, header, d, streams, None, map=fileops.thread_map(2), fused=fused)
    assert buf.tobytes() == (dirs[1] / shard).read_bytes()
    assert res.written < len(buf) // 10 and res.ranges
    for name, ranges in res.ranges.items():  # every changed byte lies in a range of its tensor
        t = header.tensors[name]
        assert all(t.start <= lo < hi <= t.end for lo, hi in ranges)
    for name, t in header.tensors.items():
        assert res.adlers[name] == zlib.adler32(buf[t.start : t.end].tobytes())
    # A buffer that is not the base where the delta writes: the Adler-32 of that tensor catches
    # it. Elsewhere the bytes are not read on this path (the scrub's job, the last test).
    base = np.fromfile(dirs[0] / shard, dtype=np.uint8)
    known = {n: zlib.adler32(base[t.start : t.end].tobytes()) for n, t in header.tensors.items()}
    at = int(np.flatnonzero(base != np.fromfile(dirs[1] / shard, dtype=np.uint8))[0])
    wrong = base.copy()
    wrong[at] ^= 0x10
    with pytest.raises(ChecksumError, match="adler32 mismatch for tensor"):
        sparse.apply_sparse(wrong, header, d, streams, known, fused=fused)


def test_a_chain_of_20_sparse_deltas_is_byte_identical_to_the_trainer(tmp_path: Path) -> None:
    steps = 20
    chain = file_chain(
        tmp_path, steps, chunk_size=CHUNK, frac=0.01, formats={v: "bdn_planes_v1" for v in range(2, steps + 2)}
    )
    d = Daemon(tmp_path / "work", "node0", chain.url, extra_env=ENV)
    d.start([])
    try:
        d.wait_healthy()
        _load(d, ANCHOR)
        for v in range(2, steps + 2):
            _load(d, step_id(v))
            _same_as_trainer(d, step_id(v), chain.dirs[v - 1])
        got = sparse_counters(d)
        # the anchor and step 2 have no earlier buffer; from then on each shard is brought forward
        assert got["applies"] >= 2 * (steps - 2), got
        assert got["fallbacks"] == 0 and got["chunks_bad"] == 0, got
        log = d.log_path.read_text()
        assert "brought forward sparsely" in log
        # the buffers GC tagged after a READY were mapped (populated) before the next step took them
        hot = [int(n) for n in re.findall(r"(\d+) through a mapping populated ahead", log)]
        assert hot and max(hot) >= 1, hot
    finally:
        d.stop()


def test_a_buffer_that_is_not_what_its_tag_says_falls_back_to_a_full_apply(tmp_path: Path) -> None:
    chain = file_chain(tmp_path, 4, chunk_size=CHUNK, frac=0.02, formats={v: "bdn_planes_v1" for v in range(2, 6)})
    d = Daemon(tmp_path / "work", "node0", chain.url, extra_env=ENV)
    d.start([])
    try:
        d.wait_healthy()
        for v in range(1, 4):
            _load(d, step_id(v))
        # step 2 is a spare now, tagged "step000002": make its bytes something else (every tensor)
        spares = d.shm_dir / SWARM_ID / ".spares"
        flipped = 0
        for p in spares.iterdir():
            if p.is_file() and (spares / ".tags" / p.name).is_file():
                os.chmod(p, 0o644)
                with open(p, "r+b") as fh:
                    raw = bytearray(fh.read())
                    header = fileops.read_header(p)
                    for t in header.tensors.values():
                        raw[t.start : t.end] = bytes(b ^ 0x01 for b in raw[t.start : t.end])
                    fh.seek(0)
                    fh.write(raw)
                flipped += 1
        assert flipped, "no tagged spare to corrupt"
        _load(d, step_id(4))
        _same_as_trainer(d, step_id(4), chain.dirs[3])
        got = sparse_counters(d)
        assert got["fallbacks"] >= 1, got
        wait_for(
            lambda: "the buffer holds step000002, the delta's base is step000003" in d.log_path.read_text(),
            30,
            "the refusal's log line",
        )
    finally:
        d.stop()


def test_kill_9_during_a_sparse_chain_then_restart_is_ready_with_the_trainers_bytes(tmp_path: Path) -> None:
    chain = file_chain(tmp_path, 5, chunk_size=CHUNK, frac=0.02, formats={v: "bdn_planes_v1" for v in range(2, 7)})
    d = Daemon(tmp_path / "work", "node0", chain.url, extra_env=ENV)
    d.start([])
    try:
        d.wait_healthy()
        for v in range(1, 4):
            _load(d, step_id(v))
        assert d.prefetch(step_id(4))[0] in (200, 202)
        wait_for(lambda: _state(d, step_id(4)) not in ("", "queued"), 120, "step 4 under way")
        d.kill()  # SIGKILL, wherever it is
        # What a crash in the middle of a sparse apply leaves: a staging file that is neither the
        # buffer's snapshot nor the target (whatever the kill hit, the bytes there now are that).
        staging = d.shm_dir / SWARM_ID / ".staging" / step_id(4)
        for shard in SHARDS:
            p = staging / shard
            if p.is_file():
                with open(p, "r+b") as fh:
                    fh.seek(p.stat().st_size // 2)
                    fh.write(b"\xff" * 64)
        d.start([])
        d.wait_healthy()
        for v in (4, 5, 6):
            _load(d, step_id(v))
            _same_as_trainer(d, step_id(v), chain.dirs[v - 1])
    finally:
        d.stop()


def test_a_byte_flipped_in_a_sparse_built_snapshot_is_found_by_the_scrub_and_no_longer_offered(tmp_path: Path) -> None:
    chain = file_chain(tmp_path, 3, chunk_size=CHUNK, frac=0.02, formats={v: "bdn_planes_v1" for v in range(2, 5)})
    d = Daemon(tmp_path / "work", "node0", chain.url, extra_env=dict(ENV, BDN_SCRUB_MBIT="200"))
    d.start([])
    try:
        d.wait_healthy()
        for v in range(1, 5):
            _load(d, step_id(v))
        assert sparse_counters(d)["applies"] >= 1
        victim = d.shm_dir / SWARM_ID / step_id(4) / SHARDS[0]
        os.chmod(victim, 0o644)
        with open(victim, "r+b") as fh:  # a stray writer (or a bit flip) in the served buffer
            fh.seek(victim.stat().st_size - 100)
            b = fh.read(1)
            fh.seek(-1, 1)
            fh.write(bytes([b[0] ^ 0x04]))
        wait_for(lambda: _state(d, step_id(4)) != "ready", 120, "the scrub took the snapshot out of ready")
        text = d.get("/metrics").decode()
        assert re.search(r"^bdn_chunks_quarantined_total [1-9]", text, re.MULTILINE), text
        assert "corrupted chunk" in d.log_path.read_text()
    finally:
        d.stop()


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "numpy"])  # the compiled kernel and its numpy path
@pytest.mark.parametrize("every", [2, 9, 40])  # a dense block; a sparse one past 1/16 of the bytes; a sparse one below
def test_the_kernel_is_exact_on_every_block_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, every: int, fused: bool
) -> None:
    import ml_dtypes

    from bdn.proto import planes

    monkeypatch.setattr(planes, "PLANES_BLOCK", 4096)
    monkeypatch.setattr(sparse, "SERIAL_BYTES", 0)  # blocks on 2 threads
    rng = np.random.default_rng(every)
    base = {f"t{i}": (rng.standard_normal((100 + i, 300)) * 0.02).astype(ml_dtypes.bfloat16) for i in range(4)}
    target = {k: v.copy() for k, v in base.items()}
    for v in target.values():
        v.reshape(-1).view(np.uint16)[::every] ^= 1
    fileops.save(tmp_path / "b", base)
    fileops.save(tmp_path / "t", target)
    fileops.write_diff_file(tmp_path / "b", tmp_path / "t", tmp_path / "x", "bdn_planes_v1")
    buf = np.fromfile(tmp_path / "b", dtype=np.uint8)
    header = fileops.read_header(tmp_path / "b")
    d = np.fromfile(tmp_path / "x", dtype=np.uint8)
    _, streams = arc.read_diff_header(d, len(d))
    known = {n: zlib.adler32(buf[t.start : t.end].tobytes()) for n, t in header.tensors.items()}
    res = sparse.apply_sparse(buf, header, d, streams, known, map=fileops.thread_map(2), fused=fused)
    assert buf.tobytes() == (tmp_path / "t").read_bytes()
    assert res.checksummed == 0 and set(res.ranges) == set(base)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "numpy"])  # the compiled kernel and its numpy path
@pytest.mark.parametrize(
    "run", [1, 3, 64]
)  # every light block alone; runs cut by RUN_BLOCKS and heavy blocks; by RUN_WORDS
def test_light_blocks_applied_in_runs_match_the_trainer_and_the_streams_ranges(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    run: int,
    fused: bool,
) -> None:
    import ml_dtypes

    from bdn.proto import planes

    monkeypatch.setattr(planes, "PLANES_BLOCK", 4096)
    monkeypatch.setattr(sparse, "RUN_BLOCKS", run)
    monkeypatch.setattr(sparse, "RUN_WORDS", 12 if run == 64 else 1 << 20)  # 64: runs cut by their words (7 a block)
    if run != 3:
        monkeypatch.setattr(sparse, "SERIAL_BYTES", 0)  # on 2 threads (small files run serially)
    rng = np.random.default_rng(run)
    base = {f"t{i}": (rng.standard_normal((200 + i, 300)) * 0.02).astype(ml_dtypes.bfloat16) for i in range(3)}
    target = {k: v.copy() for k, v in base.items()}
    for v in target.values():
        bits = v.reshape(-1).view(np.uint16)
        for blk in range(len(bits) // 4096):  # 4096-word blocks: light, light, heavy, same, ...
            lo = blk * 4096
            if blk % 4 in (0, 1):
                bits[lo + rng.choice(4096, 7, replace=False)] ^= 3  # light: far below 1/16 of the bytes
            elif blk % 4 == 2:
                bits[lo : lo + 4096 : 2] ^= 1  # heavy
    fileops.save(tmp_path / "b", base)
    fileops.save(tmp_path / "t", target)
    fileops.write_diff_file(tmp_path / "b", tmp_path / "t", tmp_path / "x", "bdn_planes_v1")
    buf = np.fromfile(tmp_path / "b", dtype=np.uint8)
    header = fileops.read_header(tmp_path / "b")
    d = np.fromfile(tmp_path / "x", dtype=np.uint8)
    _, streams = arc.read_diff_header(d, len(d))
    known = {n: zlib.adler32(buf[t.start : t.end].tobytes()) for n, t in header.tensors.items()}
    res = sparse.apply_sparse(buf, header, d, streams, known, map=fileops.thread_map(2), fused=fused)
    assert buf.tobytes() == (tmp_path / "t").read_bytes()
    tgt = np.fromfile(tmp_path / "t", dtype=np.uint8)
    for name, info in header.tensors.items():
        assert res.adlers[name] == zlib.adler32(tgt[info.start : info.end].tobytes())
        s = streams[name]
        assert res.ranges[name] == sparse.stream_ranges(d[s.frame_start : s.frame_end], info)


def test_after_a_swap_the_freed_spare_is_brought_forward_in_the_background_and_the_next_delta_applies_once(
    tmp_path: Path,
) -> None:
    """Hot-loads (no engine: the daemon serves what is ready): once step N is served, the spare GC
    made of N-1 is brought forward to N off the critical path, its touched chunks hashed, and
    tagged N; the next delta then applies only itself, through a mapping populated ahead. The
    bytes stay the trainer's at every step; a restart deletes a spare a catch-up had claimed."""

    steps = 5
    chain = file_chain(
        tmp_path, steps, chunk_size=CHUNK, frac=0.02, formats={v: "bdn_planes_v1" for v in range(2, steps + 2)}
    )
    d = Daemon(tmp_path / "work", "node0", chain.url, extra_env=ENV)
    d.start([])
    try:
        d.wait_healthy()
        for v in range(1, steps + 2):
            load_step(d, chain.dirs, v, SHARDS)
            if v >= 3:  # step v-1's spares exist from step 3 on: each is brought forward to step v
                # (every shard's: a delta that came in the middle would stop the catch-up, and
                # bring the shards it did not reach forward by two deltas itself)
                wait_for(
                    lambda v=v: d.log_path.read_text().count(f"to {step_id(v)} in the background") == len(SHARDS),
                    120,
                    f"the catch-up to {step_id(v)}",
                )
        log = d.log_path.read_text()
        got = sparse_counters(d)
        assert got["caught_up"] >= len(SHARDS) * (steps - 1), got
        assert got["fallbacks"] == 0 and got["chunks_bad"] == 0, got
        # from step 4 on every sparse apply started from a buffer caught up to its base: one delta each
        for v in range(4, steps + 2):
            line = next(ln for ln in log.splitlines() if f"{step_id(v)}" in ln and "brought forward sparsely" in ln)
            assert "(1 delta(s)" in line and f"{len(SHARDS)} through a mapping populated ahead" in line, line
        # the caught-up spares are plain spares again after a restart that finds one claimed
        claimed = d.shm_dir / SWARM_ID / ".spares" / ".claimed-0-0"
        d.stop()
        claimed.write_bytes(b"partial")
        d.start([])
        d.wait_healthy()
        assert not claimed.exists()
    finally:
        d.stop()


def test_the_first_delta_on_an_anchor_applies_sparsely_on_a_verified_copy_of_it(tmp_path: Path) -> None:
    """No spare holds an anchor: once it is READY a buffer is copied from it in the background,
    every chunk checked against READY, tagged with each tensor's Adler-32 (a seed); the first delta
    then applies only itself on that buffer, through its populated mapping, and the anchor's own
    file, freed by the swap, is caught up to step 2 for step 3. Bytes are the trainer's throughout."""
    from bdn.client.fleet import hot_load

    chain = file_chain(tmp_path, 3, chunk_size=CHUNK, frac=0.02, formats={v: "bdn_planes_v1" for v in range(2, 5)})
    d = Daemon(tmp_path / "work", "node0", chain.url, extra_env=ENV)
    d.start([])
    try:
        d.wait_healthy()
        hot_load(d.url, ANCHOR)
        d.wait_ready(ANCHOR, 300)
        wait_for(lambda: sparse_counters(d).get("seeded", 0) >= len(SHARDS), 120, "both shards of the anchor seeded")
        log = d.log_path.read_text()
        for shard in SHARDS:
            assert f"seed: a buffer of {shard} copied from {ANCHOR} and verified" in log
        for v in (2, 3, 4):
            load_step(d, chain.dirs, v, SHARDS)
            line = next(
                ln for ln in d.log_path.read_text().splitlines() if f"{step_id(v)}: " in ln and "sparsely" in ln
            )
            assert "(1 delta(s)" in line and f"{len(SHARDS)} through a mapping populated ahead" in line, line
            wait_for(  # (every shard's: see the test above)
                lambda v=v: d.log_path.read_text().count(f"to {step_id(v)} in the background") == len(SHARDS),
                120,
                f"the catch-up to {step_id(v)}",
            )
        got = sparse_counters(d)
        # only the anchor needed a copy; then the freed files are caught up. The anchor's READY
        # and its being served both ask for a background seed: the second finds the first in
        # flight (under load both used to copy it: 4, seen in CI; a model copy more in shm)
        assert got["seeded"] == len(SHARDS), got
        assert got["fallbacks"] == 0 and got["chunks_bad"] == 0, got
    finally:
        d.stop()


def test_a_delta_waiting_for_a_rate_bound_seed_lifts_the_bound(tmp_path: Path) -> None:
    """At 1 kbit/s the background copy of the anchor would take hours: the delta that starts from
    it stops it (``Forward.settle``: the lowered copy is not waited for), copies the anchor itself
    at full speed, then applies sparsely on it."""
    chain = file_chain(tmp_path, 1, chunk_size=CHUNK, frac=0.02, formats={2: "bdn_planes_v1"})
    d = Daemon(tmp_path / "work", "node0", chain.url, extra_env=dict(ENV, BDN_SPARSE_SEED_MBIT="0.001"))
    d.start([])
    try:
        d.wait_healthy()
        _load(d, ANCHOR)
        spares = d.shm_dir / SWARM_ID / ".spares"
        wait_for(lambda: any(n.startswith(".claimed-") for n in os.listdir(spares)), 60, "the seed under way")
        _load(d, step_id(2))
        _same_as_trainer(d, step_id(2), chain.dirs[1])
        got = sparse_counters(d)
        assert got["seeded"] == len(SHARDS) and got["applies"] == len(SHARDS), got
        assert got["fallbacks"] == 0 and got["chunks_bad"] == 0, got
    finally:
        d.stop()


def test_no_seed_past_the_shm_budget(tmp_path: Path) -> None:
    """With ``shm_budget_bytes`` room for the anchor and a fifth of a model more, no buffer is copied
    from it (a seed is made only within what the budget leaves)."""
    chain = file_chain(tmp_path, 1, chunk_size=CHUNK, frac=0.02, formats={2: "bdn_planes_v1"})
    model = sum(p.stat().st_size for p in chain.dirs[0].rglob("*") if p.is_file())
    d = Daemon(tmp_path / "work", "node0", chain.url, extra_env=dict(ENV, BDN_SHM_BUDGET_BYTES=str(int(model * 1.2))))
    d.start([])
    try:
        d.wait_healthy()
        _load(d, ANCHOR)
        wait_for(
            lambda: f"of {ANCHOR} not copied: the shm budget leaves" in d.log_path.read_text(), 60, "the seed refused"
        )
        spares = d.shm_dir / SWARM_ID / ".spares"
        assert not [n for n in os.listdir(spares) if n.startswith(".claimed-")]
        assert sparse_counters(d).get("seeded", 0) == 0
        assert "seed: a buffer" not in d.log_path.read_text()
    finally:
        d.stop()
