"""Wrong bytes and lost service (issue 12, items 1, 3, 4, 5 and 16), on real bdnd processes.

- item 1: a checkpoint with a file named like bdn's READY marker is refused at publish, and a
  bucket whose manifest lists one anyway (another publisher) fails the snapshot on every daemon
  with that reason, instead of the trainer's file being replaced by the marker; progress files and
  READY's temporary file never share a name with a snapshot's files or staging directories;

- item 3: every safetensors header of a snapshot is checked before READY by the rule of the
  real ``safetensors`` package: a corpus of files it refuses and files it accepts (some of which
  bdn's own strict parser would refuse) goes through a daemon, and the daemon's verdict is the
  library's for each; a refusal fails the snapshot with a reason naming the file;
- item 4: two daemons on one ``shm_dir``: the second exits 2 before it listens, naming the pid
  of the first;
- item 5: a byte corrupted in a READY file in shm: ``bdnctl verify`` reports it and changes
  nothing; ``bdnctl verify --repair`` (``POST /v1/snapshots/{id}/repair``) quarantines the chunk
  at once (not served to peers nor through the local API, counted in
  ``bdn_chunks_quarantined_total``, the snapshot ``downloading`` with the reason) and fetches it
  again, after which the file is the trainer's again; a chunk no source can give keeps the
  quarantine and fails the snapshot with the reason;
- item 16: a signed peer request a real daemon made for one daemon is refused (401) by another
  daemon of the swarm, and accepted by the one it was made for;
"""

from __future__ import annotations

import http.client
import http.server
import json
import re
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import safetensors

from bdn.bucket import open_bucket
from bdn.daemon.store.store import Store
from bdn.proto.chunks import buffer_digests
from bdn.proto.errors import BdnError, PathError
from bdn.proto.keys import derive_keys
from bdn.proto.manifest import MANIFEST_NAME, FileEntry, Manifest
from bdn.publish import publish_full
from bdn.transfer import Outcome
from support.api import wait_for
from support.checkpoints import flip_byte, make_state, write_hf_dir
from support.swarm import SECRET, Daemon, Swarm, free_port, running
from support.transfer import ask_daemon

CHUNK = 64 << 10
NO_STARTUP = {"BDN_LOAD_STARTUP": "false"}


def _exit_code(d: Daemon, timeout: float = 120.0) -> int:
    assert d.proc is not None
    try:
        return d.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"bdnd {d.node_id} did not exit:\n{d.log()}") from None


# ---- item 4: one daemon per shm_dir ------------------------------------------------------------


def test_second_daemon_on_the_same_shm_dir_exits_2_naming_the_first(tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    first = Daemon(tmp_path, "first", f"file://{bucket}")
    second = Daemon(tmp_path, "second", f"file://{bucket}", extra_env={"BDN_SHM_DIR": str(first.shm_dir)})
    first.start([])
    try:
        first.wait_healthy()
        second.start([])
        assert _exit_code(second) == 2, second.log()
        assert first.proc is not None
        lines = [ln for ln in second.log().splitlines() if ln.strip()]
        assert lines == [
            f"bdnd: error: shm_dir {str(first.shm_dir)!r} is in use by pid {first.proc.pid} (one bdnd per shm_dir)"
        ], lines
        first.get("/v1/health")  # the first one is untouched
        # once the first is gone, the directory is free again (the kernel drops the flock)
        first.stop()
        assert first.proc.returncode == 0, first.log()
        second.start([])
        second.wait_healthy()
    finally:
        second.stop()
        first.stop()


# ---- item 16: a signature is bound to the daemon it is for -----------------------------------


class _Capture(http.server.ThreadingHTTPServer):
    """A listener posing as a peer: answers a request signed for nobody in particular the way a
    daemon does (401 naming ``pose_as``), and records every request signed for ``pose_as``."""

    def __init__(self, pose_as: str) -> None:
        self.pose_as = pose_as
        self.captured: list[tuple[str, str, dict[str, str], bytes]] = []
        self.seen_targets: list[str] = []
        super().__init__(("127.0.0.1", free_port()), _CaptureHandler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _CaptureHandler(http.server.BaseHTTPRequestHandler):
    server: _Capture

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        auth = self.headers.get("Authorization") or ""
        m = re.search(r"\bto=([^,]+),", auth)
        to = m.group(1) if m else ""
        self.server.seen_targets.append(to)
        if to == self.server.pose_as:
            self.server.captured.append((self.command, self.path, dict(self.headers), body))
        self.send_response(401)
        self.send_header("X-BDN-Node", self.server.pose_as)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def _replay(url: str, req: tuple[str, str, dict[str, str], bytes]) -> int:
    method, path, headers, body = req
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        keep = {k: v for k, v in headers.items() if k.lower() in ("authorization", "content-type")}
        conn.request(method, path, body=body, headers=keep)
        r = conn.getresponse()
        r.read()
        return r.status
    finally:
        conn.close()


def test_request_captured_on_its_way_to_one_daemon_is_refused_by_another(tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    target = Daemon(tmp_path, "target", f"file://{bucket}")
    other = Daemon(tmp_path, "other", f"file://{bucket}")
    signer = Daemon(tmp_path, "signer", f"file://{bucket}")
    capture = _Capture(pose_as="target")
    threading.Thread(target=capture.serve_forever, daemon=True).start()
    try:
        target.start([])
        other.start([])
        target.wait_healthy()
        other.wait_healthy()
        # The signer's membership rounds go to the capture, which says it is "target": the signer
        # signs its next POST members for "target", and that request is what an eavesdropper has.
        signer.start([capture.url])
        signer.wait_healthy()
        wait_for(lambda: capture.captured, 120, "a request signed for 'target'", detail=signer.log)
        assert capture.seen_targets[0] == "-"  # it did not know whom it reached: signed for nobody
        req = capture.captured[0]
        assert "to=target," in req[2]["Authorization"]
        assert _replay(other.peer_url, req) == 401  # another daemon of the swarm refuses it
        assert _replay(target.peer_url, req) == 200  # the daemon it was made for takes it, once
        assert _replay(target.peer_url, req) == 401
    finally:
        capture.shutdown()
        for d in (signer, other, target):
            d.stop()


# ---- item 1: bdn's own names never stand for the trainer's files -------------------------------


def test_a_checkpoint_file_named_ready_is_refused_at_publish(tmp_path: Path) -> None:
    ck = write_hf_dir(tmp_path / "ck", make_state(0), 1)
    (ck / "READY").write_text("the trainer's own file\n")
    with pytest.raises(PathError, match="'READY' is reserved"):
        publish_full(f"file://{tmp_path}/bucket", "step000001", 1, dir=ck, chunk_size=CHUNK)
    (ck / "READY").unlink()
    (ck / "READY").mkdir()
    (ck / "READY" / "notes.txt").write_text("a directory there would block the marker\n")
    with pytest.raises(PathError, match="'READY/notes.txt' is reserved"):
        publish_full(f"file://{tmp_path}/bucket", "step000001", 1, dir=ck, chunk_size=CHUNK)
    with pytest.raises(PathError, match="reserved"):
        publish_full(
            f"file://{tmp_path}/bucket",
            "step000001",
            1,
            state_dict=make_state(0),
            extra_files={"READY": b"x"},
            chunk_size=CHUNK,
        )


def _publish_with_a_ready_file(tmp_path: Path, bucket: str, identity: str) -> bytes:
    """What another publisher could write: a checkpoint whose manifest lists a file 'READY'."""
    ck = write_hf_dir(tmp_path / "ck", make_state(0), 1)
    m = publish_full(bucket, identity, 1, dir=ck, chunk_size=CHUNK)
    trainer_ready = json.dumps({"format": "bdn.ready/1", "note": "the trainer's bytes"}).encode()
    b = open_bucket(bucket)
    try:
        b.write(f"{identity}/READY", trainer_ready)
        files = (*m.files, FileEntry("READY", len(trainer_ready), tuple(buffer_digests(trainer_ready, CHUNK))))
        forged = Manifest(
            identity=identity,
            kind="full",
            policy_version=1,
            chunk_size=CHUNK,
            files=tuple(sorted(files, key=lambda f: f.path)),
            created_at=m.created_at,
        )
        b.write(f"{identity}/{MANIFEST_NAME}", forged.to_json())
    finally:
        b.close()
    return trainer_ready


def test_a_manifest_listing_ready_fails_the_snapshot_with_the_reason_on_every_daemon(tmp_path: Path) -> None:
    bucket = f"file://{tmp_path}/bucket"
    _publish_with_a_ready_file(tmp_path, bucket, "step000001")
    with Swarm(tmp_path / "nodes", 2, bucket, extra_env=NO_STARTUP) as swarm:
        for d in swarm.daemons:
            assert d.prefetch("step000001")[0] == 202
        for d in swarm.daemons:
            status, body = d.request("GET", "/v1/snapshots/step000001/wait?state=ready&timeout=120", timeout=150)
            assert status == 409, (d.node_id, status, body)
            reason = body["snapshot"]["reason"]
            assert "'READY' is reserved" in reason, reason
            assert not any(p.name == "step000001" for p in d.shm_dir.rglob("step000001"))
            assert d.status()["counters"]["chunk_verify_failures"] == 0  # nobody was called a liar


def test_progress_files_and_the_ready_temporary_never_share_a_snapshot_name(tmp_path: Path) -> None:
    store = Store(tmp_path / "shm", "0011223344556677")
    # "a.progress" and "a.tmp" are valid identities: their staging directories must not be the
    # progress file (or its temporary) of "a".
    m = Manifest(
        identity="a.progress",
        kind="full",
        policy_version=1,
        chunk_size=CHUNK,
        files=(FileEntry("config.json", 3, tuple(buffer_digests(b"abc", CHUNK))),),
    )
    store.prepare_staging(m)
    store.prepare_staging(Manifest(identity="a", kind="full", policy_version=1, chunk_size=CHUNK, files=m.files))
    store.save_progress("a", "m" * 32, b"\x80", b"\x80")
    store.save_progress("a.progress", "n" * 32, b"\x00", b"\x00")
    assert (store.staging_dir("a.progress") / "config.json").is_file()
    assert store.load_progress("a", "m" * 32) == (b"\x80", b"\x80")
    assert store.load_progress("a.progress", "n" * 32) == (b"\x00", b"\x00")
    assert store.resumable() == ["a", "a.progress"]
    store.clean_staging({"a.progress"})
    assert store.resumable() == ["a.progress"] and not store.staging_dir("a").exists()
    (store.staging_dir("a.progress") / "config.json").write_bytes(b"abc")
    store.publish(m)
    assert sorted(p.name for p in store.ready_dir("a.progress").iterdir()) == ["READY", "config.json"]
    assert store.list_ready()[0].identity == "a.progress"


def test_a_staging_file_truncated_behind_the_daemon_is_not_published(shm: Path) -> None:
    """A target file truncated in ``.staging`` while it downloads and grown back to its size by
    later writes holds zeros where verified chunks were: publish refuses it (breaker's finding:
    it was served READY with wrong bytes)."""
    import os

    store = Store(shm / "store", "0011223344556677")
    data = os.urandom(3 * CHUNK)
    m = Manifest(
        identity="step000001",
        kind="full",
        policy_version=1,
        chunk_size=CHUNK,
        files=(FileEntry("model.safetensors", len(data), tuple(buffer_digests(data, CHUNK))),),
    )
    store.prepare_staging(m)
    f = store.staging_dir("step000001") / "model.safetensors"
    fd = os.open(f, os.O_RDWR)
    try:
        os.pwrite(fd, data[: 2 * CHUNK], 0)  # chunks 0 and 1 verified
        os.truncate(f, 1000)  # behind the daemon's back
        os.pwrite(fd, data[2 * CHUNK :], 2 * CHUNK)  # the last chunk lands: the size is right again
    finally:
        os.close(fd)
    assert f.stat().st_size == len(data)
    rfd = os.open(f, os.O_RDONLY)
    try:
        if os.lseek(rfd, 0, os.SEEK_HOLE) >= len(data):
            pytest.skip("this file system reports no holes")
    finally:
        os.close(rfd)
    with pytest.raises(BdnError, match=r"model.safetensors has a hole at byte \d+ of \d+ .*not published"):
        store.publish(m)
    assert not store.ready_dir("step000001").exists()
    f.write_bytes(data)  # written whole again: published
    store.publish(m)
    assert (store.ready_dir("step000001") / "model.safetensors").read_bytes() == data


# ---- item 3: safetensors headers checked before READY, by the library's rule -------------------


def _st(header: dict | None, data: bytes, raw: bytes | None = None, n: int | None = None) -> bytes:
    h = raw if raw is not None else json.dumps(header, separators=(",", ":")).encode()
    return struct.pack("<Q", len(h) if n is None else n) + h + data


def _t(dtype: str, shape: list[int], begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


HEADER_CASES: dict[str, bytes] = {
    "good": _st({"w": _t("F32", [2, 2], 0, 16), "__metadata__": {"format": "pt"}}, bytes(16)),
    "overlapping tensors": _st({"a": _t("F32", [2], 0, 8), "b": _t("F32", [2], 4, 12)}, bytes(12)),
    "gap before a tensor": _st({"a": _t("F32", [1], 0, 4), "b": _t("F32", [1], 8, 12)}, bytes(12)),
    "unknown dtype": _st({"a": _t("F31", [2], 0, 8)}, bytes(8)),
    "bytes after the last tensor": _st({"a": _t("F32", [2], 0, 8)}, bytes(12)),
    "size not the shape's": _st({"a": _t("F32", [3], 0, 8)}, bytes(8)),
    "header over 100,000,000 bytes": _st(None, b"", raw=b"{}", n=100_000_001),
    "NUL padding": _st(None, bytes(8), raw=b'{"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}}\0\0'),
    "metadata value not a string": _st({"__metadata__": {"k": 1}}, b""),
    "not a JSON object": _st(None, b"", raw=b"[]    "),
    "shape overflows": _st({"a": _t("F32", [2**62, 16], 0, 8)}, bytes(8)),
    # accepted by the library; bdn's own parser (the one tensor pulls use) refuses the first two,
    # so READY does too (issue 31: they reached READY and then every tensor pull answered 500)
    "leading whitespace": _st(None, bytes(8), raw=b' {"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'),
    "an extra key in a tensor entry": _st({"a": {**_t("F32", [2], 0, 8), "note": "x"}}, bytes(8)),
    "empty tensors at one offset": _st(
        {"e": _t("F32", [0], 0, 0), "f": _t("BF16", [0, 3], 0, 0), "a": _t("BF16", [4], 0, 8)}, bytes(8)
    ),
    "no tensors": _st({"__metadata__": None}, b""),
}


def _library_accepts(path: Path) -> bool:
    try:
        with safetensors.safe_open(str(path), framework="numpy"):
            return True
    except Exception:  # the library's verdict, whatever it raises
        return False


def _bdn_accepts(path: Path) -> bool:
    from bdn.fileops import read_header
    from bdn.proto.safetensors_fmt import SafetensorsError

    try:
        read_header(path)
        return True
    except SafetensorsError:
        return False


def test_each_safetensors_header_gets_both_parsers_verdict_before_ready(tmp_path: Path) -> None:
    bucket = f"file://{tmp_path}/bucket"
    cases = {}
    for i, (what, data) in enumerate(HEADER_CASES.items()):
        ck = tmp_path / f"ck{i}"
        ck.mkdir()
        (ck / "config.json").write_text(json.dumps({"case": what}))
        (ck / "model.safetensors").write_bytes(data)
        ident = f"case{i:03d}"
        publish_full(bucket, ident, i, dir=ck, chunk_size=CHUNK, check_headers=False)  # the daemon's check is tested
        lib = _library_accepts(ck / "model.safetensors")
        cases[ident] = (what, ck, lib and _bdn_accepts(ck / "model.safetensors"))
        if what in ("leading whitespace", "an extra key in a tensor entry"):
            assert lib and not cases[ident][2], what  # the cases only bdn's parser refuses
    verdicts = [v for _, _, v in cases.values()]
    assert verdicts.count(True) >= 2 and verdicts.count(False) >= 10, verdicts  # the corpus has both
    with running(Daemon(tmp_path, "node0", bucket, extra_env=dict(NO_STARTUP, BDN_KEEP_READY="100"))) as d:
        for ident in cases:
            assert d.prefetch(ident)[0] == 202
        for ident, (what, ck, accepted) in cases.items():
            status, body = d.request("GET", f"/v1/snapshots/{ident}/wait?state=ready&timeout=120", timeout=150)
            if accepted:
                assert status == 200, (what, status, body)
                got = Path(body["path"]) / "model.safetensors"
                assert got.read_bytes() == (ck / "model.safetensors").read_bytes(), what
            else:
                assert status == 409, (what, status, body)
                reason = body["snapshot"]["reason"]
                assert reason.startswith(
                    (
                        "model.safetensors: the safetensors library refuses its header: ",
                        "model.safetensors: bdn refuses its header: ",
                    )
                ), (what, reason)
                assert "\n" not in reason
                assert not list(d.shm_dir.glob(f"*/{ident}")), what  # nothing handed out


# ---- item 5: quarantine and repair of a corrupted READY chunk ----------------------------------

SHARD = "model-00001-of-00002.safetensors"


def _bdnctl(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bdn.cli.bdnctl", "--url", url, *args], capture_output=True, text=True, timeout=120
    )


def _peer_get_chunk(d: Daemon, digest: str, length: int = CHUNK) -> tuple[Outcome, bytes]:
    """What ``d``'s transfer server answers a member asking for the chunk of ``digest``."""
    keys = derive_keys(SECRET)
    return ask_daemon(keys, d.node_id, d.transfer_port, keys.address(digest), length)


def _quarantined(d: Daemon) -> float:
    text = d.get("/metrics").decode()
    m = re.search(r"^bdn_chunks_quarantined_total (\S+)$", text, re.M)
    assert m, text[:2000]
    return float(m.group(1))


def test_a_corrupted_ready_chunk_is_quarantined_and_fetched_again(tmp_path: Path) -> None:
    bucket = f"file://{tmp_path}/bucket"
    ck = write_hf_dir(tmp_path / "ck", make_state(0, scale=2), 1)
    m = publish_full(bucket, "step000001", 1, dir=ck, chunk_size=CHUNK)
    shard = m.file(SHARD)
    assert len(shard.chunks) >= 3
    with Swarm(tmp_path / "nodes", 2, bucket, extra_env=NO_STARTUP) as swarm:
        victim, other = swarm.daemons
        for d in swarm.daemons:
            assert d.prefetch("step000001")[0] == 202
        path = Path(victim.wait_ready("step000001")["path"])
        other.wait_ready("step000001")
        flip_byte(path / SHARD, CHUNK + 5)  # chunk 1 of the shard
        # served as it is on disk: the bad bytes would reach peers and engines
        outcome, body = _peer_get_chunk(victim, shard.chunks[1])
        assert outcome is Outcome.OK and body != (ck / SHARD).read_bytes()[CHUNK : 2 * CHUNK]

        r = _bdnctl(victim.url, "verify", "step000001")  # reports, changes nothing
        assert r.returncode == 1, r
        assert f"{SHARD} chunk 1 " in r.stderr and "bdnctl verify --repair step000001" in r.stderr, r.stderr
        assert victim.get("/v1/snapshots/step000001")["state"] == "ready"
        assert _quarantined(victim) == 0

        r = _bdnctl(victim.url, "verify", "--repair", "step000001", "--json")
        assert r.returncode == 0, (r.stdout, r.stderr, victim.log())
        out = json.loads(r.stdout)
        assert out["repaired"] == 1 and out["corrupted"] == [
            {"path": SHARD, "chunk": 1, "offset": CHUNK, "length": CHUNK}
        ], out
        snap = victim.get("/v1/snapshots/step000001")
        assert snap["state"] == "ready" and snap["path"] == str(path), snap
        assert (path / SHARD).read_bytes() == (ck / SHARD).read_bytes()
        assert sorted(p.name for p in path.iterdir()) == sorted([*(p.name for p in ck.iterdir()), "READY"])
        assert _quarantined(victim) == 1
        assert _peer_get_chunk(victim, shard.chunks[1]) == (Outcome.OK, (ck / SHARD).read_bytes()[CHUNK : 2 * CHUNK])
        assert _bdnctl(victim.url, "verify", "step000001").returncode == 0
        r = _bdnctl(victim.url, "verify", "--repair", "step000001")
        assert r.returncode == 0 and "nothing to repair" in r.stdout, r
        assert _quarantined(victim) == 1


def test_a_quarantined_chunk_no_source_can_give_stays_quarantined_and_fails_the_snapshot(tmp_path: Path) -> None:
    bucket_dir = tmp_path / "bucket"
    ck = write_hf_dir(tmp_path / "ck", make_state(0, scale=2), 1)
    m = publish_full(f"file://{bucket_dir}", "step000001", 1, dir=ck, chunk_size=CHUNK)
    shard = m.file(SHARD)
    with running(Daemon(tmp_path, "alone", f"file://{bucket_dir}", extra_env=NO_STARTUP)) as d:
        assert d.prefetch("step000001")[0] == 202
        path = Path(d.wait_ready("step000001")["path"])
        flip_byte(path / SHARD, 2 * CHUNK + 1)
        stored = bucket_dir / "step000001" / SHARD
        good = stored.read_bytes()
        flip_byte(stored, 2 * CHUNK + 1)  # and the bucket's copy: no source has the chunk now
        status, ans = d.request("POST", "/v1/snapshots/step000001/repair")
        assert status == 200, ans
        assert ans["corrupted"] == [{"path": SHARD, "chunk": 2, "offset": 2 * CHUNK, "length": CHUNK}], ans
        assert ans["state"] == "downloading" and ans["reason"].startswith("repairing 1 corrupted chunk(s)"), ans
        assert f"{SHARD} chunk 2 (bytes {2 * CHUNK}-{3 * CHUNK})" in ans["reason"]
        # quarantined at once: not served to peers, not through the local API, not in shm as ready
        assert _peer_get_chunk(d, shard.chunks[2])[0] is Outcome.NOT_HERE
        assert d.request("GET", f"/v1/snapshots/step000001/files/{SHARD}")[0] == 409
        assert not path.exists()
        status, body = d.request("GET", "/v1/snapshots/step000001/wait?state=ready&timeout=120", timeout=150)
        assert status == 409, body
        assert body["snapshot"]["reason"].startswith("repair failed: "), body
        assert "does not match the manifest digest" in body["snapshot"]["reason"], body
        assert _peer_get_chunk(d, shard.chunks[2])[0] is Outcome.NOT_HERE
        assert _quarantined(d) == 1
        # once the bucket is right again, a prefetch rebuilds it
        stored.write_bytes(good)
        assert d.prefetch("step000001")[0] == 202
        path = Path(d.wait_ready("step000001")["path"])
        assert (path / SHARD).read_bytes() == (ck / SHARD).read_bytes()
