"""Issue 31, class 6: a ``*.safetensors`` file READY lets through is one the daemon serves. The
safetensors library accepts a few headers bdn's own parser (the one ``GET .../tensors`` uses)
refuses: such a file reached READY and then every tensor request answered 500. Now the check
before READY runs both parsers (the snapshot fails with one line naming the file and the key),
bdn-publish refuses the file, and a snapshot already READY with one (made by an older bdnd) is
answered 409 with one line, logged once. Real daemon, real files, a file:// bucket."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from safetensors import safe_open

from bdn.proto.chunks import digest
from bdn.proto.manifest import MANIFEST_NAME
from bdn.publish import publish_full
from bdn.publish.errors import PublishError
from support.api import wait_for
from support.swarm import Daemon

CONFIG = b'{"model_type": "toy"}'


def _st(header: str, data: bytes) -> bytes:
    h = header.encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def _publish_raw(bucket: Path, identity: str, files: dict[str, bytes], pv: int = 1) -> None:
    """A full snapshot written straight into a file:// bucket (as a foreign publisher would)."""
    snap = bucket / identity
    snap.mkdir(parents=True)
    entries = []
    for name, data in sorted(files.items()):
        (snap / name).write_bytes(data)
        entries.append({"path": name, "size": len(data), "chunks": [digest(data)]})
    m = {
        "format": "bdn.snapshot/1",
        "identity": identity,
        "kind": "full",
        "policy_version": pv,
        "created_at": "2026-12-06T00:00:00Z",
        "chunk_size": 1 << 20,
        "files": entries,
    }
    (snap / MANIFEST_NAME).write_text(json.dumps(m, indent=1, sort_keys=True) + "\n")


# a tensor entry with a field besides dtype/shape/data_offsets, under a key with a leading space:
# the library opens it, bdn's parser refuses it naming the key
EXTRA = '{" lead":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1}}'
# the header JSON preceded by a space: the library opens it, bdn's parser refuses it
LEADING = ' {"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
GOOD = '{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}} '  # the same length as LEADING
DATA = struct.pack("<2f", 1.5, -2.0)


def test_the_library_opens_what_bdn_refuses(tmp_path: Path) -> None:
    """The premise: these files open in the safetensors library (so only bdn's parser stops them)."""
    for header in (EXTRA, LEADING):
        p = tmp_path / "x.safetensors"
        p.write_bytes(_st(header, DATA))
        with safe_open(str(p), framework="numpy") as f:
            assert len(list(f.keys())) == 1


def test_refused_before_ready_naming_the_key_and_by_publish(tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    _publish_raw(bucket, "step000001", {"config.json": CONFIG, "model.safetensors": _st(EXTRA, DATA)})
    _publish_raw(bucket, "step000002", {"config.json": CONFIG, "model.safetensors": _st(LEADING, DATA)}, 2)
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "config.json").write_bytes(CONFIG)
    (ck / "model.safetensors").write_bytes(_st(EXTRA, DATA))
    with pytest.raises(PublishError, match="model.safetensors: bdn refuses its header: tensor ' lead'"):
        publish_full(f"file://{tmp_path / 'other'}", "step000001", 1, dir=ck)

    d = Daemon(
        tmp_path / "nodes",
        "n0",
        f"file://{bucket}",
        extra_env={"BDN_LOAD_STARTUP": "false", "BDN_STARTUP_SETTLE_S": "0"},
    )
    try:
        d.start([])
        d.wait_healthy()
        for ident, what in (
            ("step000001", "tensor ' lead': entry must have exactly dtype, shape, data_offsets"),
            ("step000002", "header does not start with '{'"),
        ):
            assert d.prefetch(ident)[0] in (200, 202, 409, 422)
            rec = d.wait_settled(ident)
            assert rec["state"] == "failed", rec
            assert rec["reason"].startswith("model.safetensors: bdn refuses its header:") and what in rec["reason"], rec
            assert not (d.store / ident).exists()
        assert d.get("/v1/health")["status"] == "ok"
    finally:
        d.stop()


def test_a_ready_snapshot_bdn_cannot_parse_is_answered_409_once_logged(tmp_path: Path) -> None:
    """A snapshot made READY by a bdnd without the check (simulated: its file rewritten in shm,
    READY made to match, then a restart) is answered 409 naming the file, never 500."""
    bucket = tmp_path / "bucket"
    _publish_raw(bucket, "step000001", {"config.json": CONFIG, "model.safetensors": _st(GOOD, DATA)})
    d = Daemon(
        tmp_path / "nodes",
        "n0",
        f"file://{bucket}",
        extra_env={"BDN_LOAD_STARTUP": "false", "BDN_STARTUP_SETTLE_S": "0"},
    )
    try:
        d.start([])
        d.wait_healthy()
        d.prefetch("step000001")
        d.wait_ready("step000001")
        assert d.request("GET", "/v1/snapshots/step000001/tensors/w")[0] == 200
        d.stop()
        bad = _st(LEADING, DATA)
        f = d.store / "step000001" / "model.safetensors"
        assert len(bad) == f.stat().st_size
        f.chmod(0o644)
        f.write_bytes(bad)
        ready = d.store / "step000001" / "READY"
        doc = json.loads(ready.read_text())
        for e in doc["files"]:
            if e["path"] == "model.safetensors":
                e["chunks"] = [digest(bad)]
        ready.chmod(0o644)
        ready.write_text(json.dumps(doc))
        d.start([])
        d.wait_healthy()
        assert d.get("/v1/snapshots/step000001")["state"] == "ready"
        for _ in range(3):
            status, body = d.request("GET", "/v1/snapshots/step000001/tensors/w")
            assert status == 409, (status, body)
            assert "model.safetensors" in body["error"] and "header does not start with '{'" in body["error"], body
        wait_for(lambda: "tensors not served" in d.log(), 30, "the refusal logged")
        assert d.log().count("tensors not served") == 1, d.log()
    finally:
        d.stop()
