"""A bucket serving crafted ``bdn_planes_v1`` deltas to a real bdnd that applies them sparsely (in
place, to a spare holding an earlier snapshot: bdn/proto/sparse_kernel.py, bdn/daemon/apply/): a
changed word past its block, an Adler-32 that is not the target's, a truncated zstd frame. The
crafted diff's chunks match its manifest (a hostile or broken publisher, not bit rot).

Promises checked: each crafted delta ends ``failed`` with one line naming what is wrong; the
snapshot served meanwhile keeps the trainer's bytes; the spare the failed apply wrote into is not
used as a base again: the honest delta published afterwards under the same identity, and the next
one, are READY with the trainer's bytes."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import xxhash
import zstandard

from bdn import fileops
from bdn.proto.keys import derive_keys
from support.api import wait_for
from support.chains import Chain, file_chain, step_id
from support.swarm import SECRET, Daemon

CHUNK = 64 << 10
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
SWARM_ID = derive_keys(SECRET).swarm_id
ENV = {"BDN_LOAD_STARTUP": "false", "BDN_KEEP_READY": "1", "BDN_GC_GRACE_S": "0"}
HEAD = struct.Struct("<4sBBHQII")  # bdn/proto/planes.py's stream header
REC = struct.Struct("<BIII")  # one block record: mode, k, e, payload length

pytestmark = pytest.mark.timeout(900)


def _last_block(stream: bytes, craft: Callable[[int, int, bytes], tuple[int, int, int, bytes]]) -> bytes:
    """``stream`` with its last block's ``(mode, k, e, payload)`` replaced by ``craft(w, elems,
    payload)`` (the header and the other blocks kept)."""
    magic, version, w, reserved, n, block, nblocks = HEAD.unpack_from(stream, 0)
    recs = list(REC.iter_unpack(stream[HEAD.size : HEAD.size + nblocks * REC.size]))
    pos = HEAD.size + nblocks * REC.size
    payloads = []
    for _, _, _, ln in recs:
        payloads.append(stream[pos : pos + ln])
        pos += ln
    m = n // w
    elems = m - (nblocks - 1) * block
    mode, k, e, payload = craft(w, elems, payloads[-1])
    recs[-1] = (mode, k, e, len(payload))
    payloads[-1] = payload
    return stream[: HEAD.size] + b"".join(REC.pack(*r) for r in recs) + b"".join(payloads)


def _last_mode(stream: bytes) -> int:
    nblocks = HEAD.unpack_from(stream, 0)[-1]
    return REC.unpack_from(stream, HEAD.size + (nblocks - 1) * REC.size)[0]


def _past_the_block(w: int, elems: int, payload: bytes) -> tuple[int, int, int, bytes]:
    """One changed word, its escaped gap past the block's end."""
    raw = bytes([255]) + struct.pack("<I", elems + 300) + bytes([1] * w)
    return 1, 1, 1, zstandard.ZstdCompressor(write_content_size=True).compress(raw)


def _craft(chain: Chain, identity: str, kind: str) -> dict[str, bytes]:
    """Replace ``identity``'s diff of the second shard in the bucket with a crafted one (its last
    tensor's stream, or its Adler-32) and the manifest's entry for it, so the chunks match.
    Returns the honest bytes of what was replaced (to put back)."""
    shard = SHARDS[1]
    path = chain.bucket / identity / shard
    manifest = chain.bucket / identity / "bdn.manifest.json"
    saved = {shard: path.read_bytes(), "bdn.manifest.json": manifest.read_bytes()}
    header = fileops.read_header(path)
    raw = path.read_bytes()
    tensors = {t.name: ("U8", (t.nbytes,), raw[t.start : t.end]) for t in header.tensors.values()}
    meta = dict(header.metadata)
    last = [n for n in sorted(tensors) if _last_mode(tensors[n][2]) != 0][-1]  # a changed tensor
    stream = tensors[last][2]
    if kind == "adler":
        meta[last] = str((int(meta[last]) + 1) % (1 << 32))
    elif kind == "past-block":
        stream = _last_block(stream, _past_the_block)
    elif kind == "truncated-zstd":
        # keep the record's mode, k and e; only the payload (and its length) shrink
        magic, version, w, reserved, n, block, nblocks = HEAD.unpack_from(stream, 0)
        recs = list(REC.iter_unpack(stream[HEAD.size : HEAD.size + nblocks * REC.size]))
        mode, k, e, _ = recs[-1]
        stream = _last_block(stream, lambda w, el, p: (mode, k, e, p[: max(1, 2 * len(p) // 3)]))
    tensors[last] = ("U8", (len(stream),), stream)
    fileops.save_raw(path, tensors, meta)
    data = path.read_bytes()
    m = json.loads(manifest.read_text())
    for f in m["files"]:
        if f["path"] == shard:
            f["size"] = len(data)
            f["chunks"] = [
                xxhash.xxh3_128_hexdigest(data[i : i + m["chunk_size"]]) for i in range(0, len(data), m["chunk_size"])
            ]
    manifest.write_text(json.dumps(m))
    return saved


def _restore(chain: Chain, identity: str, saved: dict[str, bytes]) -> None:
    for name, data in saved.items():
        if name != "bdn.manifest.json":
            (chain.bucket / identity / name).write_bytes(data)
    (chain.bucket / identity / "bdn.manifest.json").write_bytes(saved["bdn.manifest.json"])


def _state(d: Daemon, identity: str) -> dict:
    status, rec = d.request("GET", f"/v1/snapshots/{identity}")
    return rec if status == 200 else {}


def _same_as_trainer(d: Daemon, identity: str, trainer: Path) -> None:
    got = d.shm_dir / SWARM_ID / identity
    for shard in SHARDS:
        assert (got / shard).read_bytes() == (trainer / shard).read_bytes(), f"{identity}/{shard}"


def test_crafted_sparse_deltas_fail_with_one_line_and_leave_no_bad_buffer_behind(tmp_path: Path) -> None:
    chain = file_chain(tmp_path, 4, chunk_size=CHUNK, frac=0.02, formats={v: "bdn_planes_v1" for v in range(2, 6)})
    d = Daemon(tmp_path / "work", "node0", chain.url, extra_env=ENV)
    d.start([])
    try:
        d.wait_healthy()
        for v in range(1, 4):
            assert d.prefetch(step_id(v))[0] in (200, 202)
            d.wait_ready(step_id(v), 300)
            _same_as_trainer(d, step_id(v), chain.dirs[v - 1])
        target = step_id(4)
        for kind, needle in (
            ("past-block", "past the block"),
            ("truncated-zstd", "zstd"),
            ("adler", "dler"),
        ):
            saved = _craft(chain, target, kind)
            assert d.prefetch(target)[0] in (200, 202)
            rec = wait_for(
                lambda: _state(d, target),
                300,
                f"{kind}: {target} failed",
                until=lambda r: r.get("state") in ("failed", "ready"),
            )
            assert rec["state"] == "failed", (kind, rec)
            reason = rec.get("reason") or ""
            assert "\n" not in reason and needle in reason, (kind, reason)
            _same_as_trainer(d, step_id(3), chain.dirs[2])  # the served snapshot is untouched
            _restore(chain, target, saved)
        assert d.prefetch(target)[0] in (200, 202)
        d.wait_ready(target, 300)
        _same_as_trainer(d, target, chain.dirs[3])
        assert d.prefetch(step_id(5))[0] in (200, 202)
        d.wait_ready(step_id(5), 300)
        _same_as_trainer(d, step_id(5), chain.dirs[4])
        log = d.log_path.read_text()
        # the first crafted delta met the spare (a sparse apply refused, then the full apply failed)
        assert "sparse apply of model-00002-of-00002.safetensors refused" in log
        assert f"snapshot {step_id(5)}: 2 file(s) brought forward sparsely" in log
    finally:
        d.stop()
