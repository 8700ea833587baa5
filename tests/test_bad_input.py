"""Bad input against real bdnd processes: strangers, hostile identities and manifests, corrupt
deltas, a lying peer, unknown formats, and half-published snapshots.

Every test starts real daemons (``tests/support/swarm.py``) on loopback with a ``file://`` bucket
under ``tmp_path``; the lying peer is a real aiohttp process (``tests/support/liar.py``). Small
checkpoints with 64 KiB chunks keep each test to a few seconds.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bdn.fileops import chunk_digests as file_digests
from bdn.fileops import read_header, save_raw
from bdn.proto import hrw
from bdn.proto.keys import SwarmKeys, derive_keys, sign_request
from bdn.proto.manifest import MANIFEST_NAME, FileEntry, Manifest
from bdn.publish import publish_delta, publish_full
from bdn.transfer import Outcome
from tests.support.api import raw_request, wait_for
from tests.support.checkpoints import make_state, optimizer_step, write_hf_dir
from tests.support.liar import Liar
from tests.support.swarm import SECRET, Daemon, running
from tests.support.transfer import ask_daemon

CHUNK = 64 << 10
NO_STARTUP = {"BDN_LOAD_STARTUP": "false"}
OTHER_SECRET = "fedcba9876543210fedcba9876543210fedcba9876543210fedcba9876543210"

pytestmark = pytest.mark.timeout(
    300
)  # a deadline for a hang: a liar, 2-3 daemons and their start-ups at load 30+ took over 120 s


# ---- helpers ------------------------------------------------------------------------------------


class Bucket:
    """A ``file://`` bucket under tmp_path, plus the checkpoint directories published into it."""

    def __init__(self, root: Path) -> None:
        self.dir = root / "bucket"
        self.dir.mkdir(parents=True)
        self.url = f"file://{self.dir}"
        self.src = root / "src"

    def full(self, identity: str, state: dict[str, Any], version: int) -> tuple[Manifest, Path]:
        ck = write_hf_dir(self.src / identity, state, version)
        return publish_full(self.url, identity, version, dir=ck, chunk_size=CHUNK), ck

    def delta(self, identity: str, state: dict[str, Any], version: int, base: str, **kw: Any) -> tuple[Manifest, Path]:
        ck = write_hf_dir(self.src / identity, state, version)
        m = publish_delta(self.url, identity, version, base, dir=ck, base_dir=self.src / base, chunk_size=CHUNK, **kw)
        return m, ck

    def manifest_path(self, identity: str) -> Path:
        return self.dir / identity / MANIFEST_NAME


@pytest.fixture
def bucket(tmp_path: Path) -> Bucket:
    return Bucket(tmp_path)


@pytest.fixture
def daemon(tmp_path: Path, bucket: Bucket) -> Iterator[Daemon]:
    with running(Daemon(tmp_path / "work", "node0", bucket.url, extra_env=NO_STARTUP)) as d:
        yield d


@pytest.fixture(scope="module")
def idle_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One daemon over an empty bucket, shared by tests that must leave it without any snapshot."""
    root = tmp_path_factory.mktemp("idle")
    with running(Daemon(root / "work", "node0", Bucket(root).url, extra_env=NO_STARTUP)) as d:
        yield d


def settle(d: Daemon, identity: str, timeout: float = 120.0) -> dict[str, Any]:
    """Wait until ``identity`` is ready or failed on ``d``; return its snapshot description."""
    status, body = wait_for(
        lambda: d.request("GET", f"/v1/snapshots/{identity}/wait?state=ready&timeout=5"),
        timeout,
        f"{identity} ready or failed on {d.node_id}",
        0,  # the daemon holds each request up to 5 s
        until=lambda answer: answer[0] in (200, 409),
        meanwhile=lambda answer: answer[0] == 202,
        detail=d.log,
    )
    return body if status == 200 else body["snapshot"]


def tree_digests(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root``, by relative path."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def assert_same_files(ready_dir: Path, ck: Path) -> None:
    """Every checkpoint file is in ``ready_dir`` byte for byte (plus READY, nothing else)."""
    got = tree_digests(ready_dir)
    want = tree_digests(ck)
    assert set(got) == set(want) | {"READY"}
    for name, digest in want.items():
        assert got[name] == digest, name


def ready_dir(d: Daemon, identity: str) -> Path:
    return d.shm_dir / derive_keys(SECRET).swarm_id / identity


# ---- 1. strangers get 401 and nothing else -------------------------------------------------------


def test_wrong_secret_swarm_id_unsigned_replayed_and_skewed_requests_get_401_and_no_bytes(
    bucket: Bucket, daemon: Daemon
) -> None:
    """Chunks: only over the transfer wire, to a member that proves the partition secret (another
    partition's handshake fails, nothing is sent). The swarm's HTTP endpoints: 401 and an empty
    body for every request not signed right for this daemon."""
    m, ck = bucket.full("step000001", make_state(0, scale=2), 1)
    assert daemon.prefetch("step000001")[0] == 202
    daemon.wait_ready("step000001", 120)

    keys = derive_keys(SECRET)
    other = derive_keys(OTHER_SECRET)
    shard = m.file("model-00001-of-00002.safetensors")
    assert len(shard.chunks) >= 3
    want = (ck / shard.path).read_bytes()[CHUNK : 2 * CHUNK]
    address = keys.address(shard.chunks[1])

    def ask(k: SwarmKeys, addr: str = address) -> tuple[Outcome, bytes]:
        return ask_daemon(k, daemon.node_id, daemon.transfer_port, addr, CHUNK)

    # The right secret is served the exact bytes: the refusals below are about auth, not the chunk.
    assert ask(keys) == (Outcome.OK, want)
    for k, addr in ((other, address), (other, other.address(shard.chunks[1]))):
        outcome, body = ask(k, addr)
        assert outcome is Outcome.FAILED and body == bytes(CHUNK), (outcome, body[:16])

    path = f"/bdn/v1/{keys.swarm_id}/snapshots/step000001/have"

    def get(p: str, auth: str | None) -> tuple[int, bytes]:
        return raw_request(daemon.peer_url, "GET", p, {"Authorization": auth} if auth is not None else {})

    good = sign_request(keys, "GET", path, "tester", to=daemon.node_id)
    status, body = get(path, good)
    assert status == 200 and body, (status, body)

    other_path = f"/bdn/v1/{other.swarm_id}/snapshots/step000001/have"
    another_path = f"/bdn/v1/{keys.swarm_id}/snapshots/step000002/have"
    refused = {
        "signed with another partition's keys": (path, sign_request(other, "GET", path, "tester", to=daemon.node_id)),
        "right keys, another swarm id in the path": (
            other_path,
            sign_request(keys, "GET", other_path, "tester", to=daemon.node_id),
        ),
        "another partition, its own swarm id": (
            other_path,
            sign_request(other, "GET", other_path, "tester", to=daemon.node_id),
        ),
        "unsigned": (path, None),
        "empty Authorization": (path, ""),
        "a replayed Authorization header": (path, good),
        "signature for another path": (
            another_path,
            sign_request(keys, "GET", path, "tester", to=daemon.node_id),
        ),
        "clock skew of 120 s": (
            path,
            sign_request(keys, "GET", path, "tester", to=daemon.node_id, now=time.time() - 120),
        ),
        "wrong scheme": (path, good.replace("BDN-HMAC", "Bearer", 1)),
    }
    for what, (p, auth) in refused.items():
        status, body = get(p, auth)
        assert (status, body) == (401, b""), what
    # Other endpoints hold the same line: a stranger cannot learn what the partition has.
    p = f"/bdn/v1/{keys.swarm_id}/members"
    status, body = raw_request(
        daemon.peer_url, "POST", p, {"Authorization": sign_request(other, "POST", p, "tester", to=daemon.node_id)}
    )
    assert (status, body) == (401, b""), p

    # Still serving the swarm afterwards, and nothing was counted as sent to the strangers.
    assert ask(keys) == (Outcome.OK, want)
    # (counted when the server's thread has sent the last byte, which can be after the asker has it)
    sent = wait_for(
        lambda: daemon.status()["counters"]["peer_chunks_out"], 60, "two chunks counted", until=lambda n: n >= 2
    )
    assert sent == 2


# ---- 2. hostile identities on the local API ------------------------------------------------------


@pytest.mark.parametrize(
    "raw, rule",
    [
        ("a%2Fb", "one path segment"),
        ("%2F", "one path segment"),
        ("..%2Fetc", "one path segment"),
        ("a%5Cb", "one path segment"),
        ("..", "reserved"),
        ("%2E%2E", "reserved"),
        (".", "reserved"),
        ("latest", "reserved"),
        ("STARTUP_SNAPSHOT", "reserved"),
        ("-leading-dash", "does not match"),
        ("a%00b", "does not match"),
        ("x" * 129, "does not match"),
    ],
)
def test_bad_identity_on_prefetch_is_400_naming_the_rule(idle_daemon: Daemon, raw: str, rule: str) -> None:
    daemon = idle_daemon
    status, body = raw_request(daemon.url, "POST", f"/v1/snapshots/{raw}/prefetch")
    assert status == 400, (raw, status, body)
    err = json.loads(body)["error"]
    assert "identity" in err and rule in err, err
    # The same rule guards the other per-snapshot endpoints; nothing reached the node.
    status, _ = raw_request(daemon.url, "GET", f"/v1/snapshots/{raw}")
    assert status == 400
    assert daemon.get("/v1/snapshots") == {"snapshots": []}
    assert daemon.get("/v1/health")["status"] == "ok"


def test_unencoded_slash_in_identity_does_not_route(idle_daemon: Daemon) -> None:
    daemon = idle_daemon
    # A literal '/' splits the path: aiohttp finds no route, so it never becomes an identity (a
    # lone '..' segment does match the route and is refused as reserved: see the test above).
    for path in ("/v1/snapshots/a/b/prefetch", "/v1/snapshots/../../prefetch"):
        status, _ = raw_request(daemon.url, "POST", path)
        assert status == 404, path
    status, body = raw_request(daemon.url, "POST", "/v1/snapshots/%2E%2E%2F%2E%2E/prefetch")
    assert status == 400 and "one path segment" in json.loads(body)["error"]
    assert daemon.get("/v1/snapshots") == {"snapshots": []}


# ---- 3. manifests that do not parse or that escape the snapshot ----------------------------------


def test_bad_manifests_fail_the_snapshot_and_the_daemon_keeps_serving(bucket: Bucket, daemon: Daemon) -> None:
    m, ck = bucket.full("good", make_state(0), 1)
    good = json.loads(bucket.manifest_path("good").read_bytes())

    def put(identity: str, data: bytes) -> None:
        (bucket.dir / identity).mkdir()
        (bucket.dir / identity / MANIFEST_NAME).write_bytes(data)

    put("garbage", b"\x89PNG\r\n\x1a\n" + bytes(range(256)) + b"{not json")
    dotdot = dict(
        good, identity="dotdot", files=[dict(good["files"][0], path="../good/config.json"), *good["files"][1:]]
    )
    put("dotdot", json.dumps(dotdot).encode())
    absolute = dict(good, identity="absolute", files=[dict(good["files"][0], path="/etc/passwd")])
    put("absolute", json.dumps(absolute).encode())
    put("elsewhere", json.dumps(good).encode())  # valid, but names another identity

    expect = {
        "garbage": "not valid JSON",
        "dotdot": "'..'",
        "absolute": "absolute",
        "elsewhere": "'good'",
    }
    for ident in expect:
        assert daemon.prefetch(ident)[0] == 202
    for ident, words in expect.items():
        snap = settle(daemon, ident)
        assert snap["state"] == "failed", snap
        assert "manifest" in snap["reason"] and words in snap["reason"], snap["reason"]
        status, body = daemon.request("GET", f"/v1/snapshots/{ident}")
        assert status == 200 and body["state"] == "failed" and body["reason"] == snap["reason"]
        assert not ready_dir(daemon, ident).exists()
    # Nothing was written outside the snapshot directories.
    assert not (daemon.shm_dir / derive_keys(SECRET).swarm_id / "good").exists()
    assert not (daemon.shm_dir / "good").exists()

    assert daemon.get("/v1/health")["status"] == "ok"
    assert daemon.prefetch("good")[0] == 202
    snap = daemon.wait_ready("good", 120)
    assert_same_files(Path(snap["path"]), ck)


# ---- 4. a diff whose Adler-32 does not match ------------------------------------------------------


def test_delta_with_wrong_adler32_fails_naming_the_tensor_and_leaves_the_base_intact(
    bucket: Bucket, daemon: Daemon
) -> None:
    s1 = make_state(0, scale=2)
    _, ck1 = bucket.full("step000001", s1, 1)
    m2, _ = bucket.delta("step000002", optimizer_step(s1, 0.02, 1), 2, "step000001")

    # Corrupt one tensor's Adler-32 in the diff file's __metadata__, keep its frames, and re-chunk
    # the manifest so every stored chunk verifies: only the Adler check can catch it.
    victim_file, victim = "model-00001-of-00002.safetensors", "layers.0.mlp.up.weight"
    diff_path = bucket.dir / "step000002" / victim_file
    h = read_header(diff_path)
    raw = diff_path.read_bytes()
    frames = {n: ("U8", (t.end - t.start,), raw[t.start : t.end]) for n, t in h.tensors.items()}
    meta = dict(h.metadata)
    meta[victim] = str((int(meta[victim]) + 1) % (1 << 32))
    save_raw(diff_path, frames, meta)
    files = tuple(
        FileEntry(f.path, diff_path.stat().st_size, tuple(file_digests(diff_path, m2.chunk_size)), f.result)
        if f.path == victim_file
        else f
        for f in m2.files
    )
    m2 = Manifest(
        identity=m2.identity,
        kind=m2.kind,
        policy_version=m2.policy_version,
        chunk_size=m2.chunk_size,
        files=files,
        created_at=m2.created_at,
        base_identity=m2.base_identity,
        compression_format=m2.compression_format,
        checksum_format=m2.checksum_format,
    )
    bucket.manifest_path("step000002").write_bytes(m2.to_json())

    assert daemon.prefetch("step000001")[0] == 202
    base = Path(daemon.wait_ready("step000001", 120)["path"])
    assert_same_files(base, ck1)
    before = tree_digests(base)

    assert daemon.prefetch("step000002")[0] == 202
    snap = settle(daemon, "step000002")
    assert snap["state"] == "failed", snap
    assert "adler32" in snap["reason"] and repr(victim) in snap["reason"], snap["reason"]
    assert not ready_dir(daemon, "step000002").exists()
    assert list(daemon.shm_dir.rglob("step000002/READY")) == []
    assert daemon.get("/v1/snapshots/step000001")["state"] == "ready"
    assert tree_digests(base) == before
    assert daemon.request("GET", "/v1/snapshots/step000002/files")[0] == 409


# ---- 5. a peer that sends wrong bytes -------------------------------------------------------------


def test_lying_peer_is_caught_and_every_chunk_comes_from_elsewhere(tmp_path: Path, bucket: Bucket) -> None:
    s1 = make_state(0, scale=2)
    s2 = optimizer_step(s1, 0.02, 1)
    m1, ck1 = bucket.full("step000001", s1, 1)
    bucket.delta("step000002", s2, 2, "step000001")
    _, ck3 = bucket.delta("step000003", optimizer_step(s2, 0.02, 2), 3, "step000002")
    nodes = ["node0", "node1", "liar"]
    # HRW is deterministic: the liar owns some of the anchor's chunks, so each daemon asks it first.
    assert any(hrw.owner(nodes, d) == "liar" for f in m1.files for d in f.chunks)

    liar = Liar(tmp_path / "work", bucket.url, SECRET).start()
    # A short penalty, so the liar keeps being asked again during the whole download.
    env = dict(NO_STARTUP, BDN_PENALTY_S="0.5")
    honest = [Daemon(tmp_path / "work", n, bucket.url, extra_env=env) for n in nodes[:2]]
    peers = [d.peer_url for d in honest] + [liar.url]

    def lies() -> dict[str, int]:
        return {d.node_id: d.status()["verify_failures_by_peer"].get("liar", 0) for d in honest}

    try:
        for d in honest:
            d.start(peers)
        for d in honest:
            d.wait_healthy()
        for d in honest:
            wait_for(
                lambda d=d: {p["node_id"] for p in d.status()["peers"] if p["alive"]},
                120,
                f"{d.node_id} to see every other node alive",
                0.1,
                until=lambda alive, d=d: alive == set(nodes) - {d.node_id},
            )

        # The anchor: the liar is the HRW owner of some chunks and claims all of them.
        for d in honest:
            assert d.prefetch("step000001")[0] == 202
        for d in honest:
            assert_same_files(Path(d.wait_ready("step000001", 120)["path"]), ck1)
        after_anchor = lies()
        assert sum(after_anchor.values()) > 0, after_anchor

        # A delta whose base (step000002) neither daemon has: the liar claims every reconstructed
        # chunk, the daemons catch it and walk the chain instead. First let its penalty lapse.
        for d in honest:
            wait_for(
                lambda d=d: d.status()["peers"],
                120,
                f"{d.node_id} to see the liar alive and unpenalised",
                0.1,
                until=lambda peers: (
                    not any(p["node_id"] == "liar" and (p["penalised"] or not p["alive"]) for p in peers)
                ),
            )
        for d in honest:
            assert d.prefetch("step000003")[0] == 202
        for d in honest:
            assert_same_files(Path(d.wait_ready("step000003", 120)["path"]), ck3)
        after_delta = lies()
        assert sum(after_delta.values()) > sum(after_anchor.values()), (after_anchor, after_delta)

        for d in honest:
            st = d.status()
            assert st["counters"]["chunk_verify_failures"] >= st["verify_failures_by_peer"].get("liar", 0)
            assert set(st["verify_failures_by_peer"]) <= {"liar"}, st["verify_failures_by_peer"]
        assert any(v > 0 for v in after_delta.values())
        keys = derive_keys(SECRET)
        p = f"/bdn/v1/{keys.swarm_id}/liar/stats"
        status, body = raw_request(
            liar.url, "GET", p, {"Authorization": sign_request(keys, "GET", p, "tester", to="liar")}
        )
        assert status == 200 and json.loads(body)["chunks_lied"] >= sum(after_delta.values())
        assert json.loads(body)["wire_lied"] > 0  # the daemons asked it over the transfer wire
    finally:
        for d in honest:
            d.stop()
        liar.stop()
    for d in honest:  # abandoned chunk fetches were stopped, not left to die unobserved
        assert "never retrieved" not in d.log_path.read_text(), d.log()


# ---- 6. an unknown delta format -----------------------------------------------------------------


def test_unknown_compression_format_fails_listing_the_supported_ones(bucket: Bucket, daemon: Daemon) -> None:
    s1 = make_state(0)
    bucket.full("step000001", s1, 1)
    bucket.delta("step000002", optimizer_step(s1, 0.02, 1), 2, "step000001")
    obj = json.loads(bucket.manifest_path("step000002").read_bytes())
    obj["compression_format"] = "arc_v3"
    bucket.manifest_path("step000002").write_text(json.dumps(obj))

    assert daemon.prefetch("step000002")[0] == 202
    snap = settle(daemon, "step000002")
    assert snap["state"] == "failed", snap
    for word in ("arc_v3", "arc_v1", "arc_v2"):
        assert word in snap["reason"], snap["reason"]
    # Refused before any work: the base was never asked for.
    assert daemon.request("GET", "/v1/snapshots/step000001")[0] == 404
    assert not ready_dir(daemon, "step000002").exists()


# ---- 7. a snapshot whose manifest is not written yet ---------------------------------------------


def test_snapshot_without_manifest_waits_and_loads_once_it_appears(
    tmp_path: Path, bucket: Bucket, daemon: Daemon
) -> None:
    _, ck = bucket.full("step000001", make_state(3), 1)
    held = tmp_path / "held-manifest.json"
    os.replace(bucket.manifest_path("step000001"), held)  # the upload is "still running"

    assert daemon.prefetch("step000001")[0] == 202
    wait_for(
        lambda: daemon.get("/v1/snapshots/step000001"),
        120,
        "the load to wait for its manifest",
        until=lambda snap: snap["reason"].startswith("waiting for manifest"),
        meanwhile=lambda snap: snap["state"] == "queued",
    )

    # Several manifest polls pass (counted by the daemon in the reason, not timed here); it must
    # keep waiting, loading nothing.
    def still_waiting() -> int:
        snap = daemon.get("/v1/snapshots/step000001")
        assert snap["state"] == "queued" and snap["reason"].startswith("waiting for manifest"), snap
        assert snap["bytes_done"] == 0
        assert not ready_dir(daemon, "step000001").exists()
        looked = re.search(r"\(looked (\d+) times?\)", snap["reason"])
        assert looked, snap["reason"]
        return int(looked.group(1))

    wait_for(still_waiting, 120, "5 manifest polls", until=lambda looked: looked >= 5)
    assert daemon.request("GET", "/v1/snapshots/step000001/files")[0] == 409
    assert daemon.status()["bucket"]["get_bytes"] == 0  # not one byte of the half upload read

    os.replace(held, bucket.manifest_path("step000001"))
    snap = daemon.wait_ready("step000001", 120)
    assert_same_files(Path(snap["path"]), ck)


def test_a_penalty_redirects_the_requests_queued_for_the_lying_peer(tmp_path: Path, bucket: Bucket) -> None:
    """Issue 12, item 8: once the liar's first bad chunk is caught, the requests queued for it
    and in flight to it go elsewhere at once; the victim takes at most ``max_per_peer`` chunks
    from it (a peer's slot is held until its chunk is verified), not its share of the snapshot."""
    m1, ck1 = bucket.full("step000001", make_state(0, scale=6), 1)
    n_chunks = sum(len(f.chunks) for f in m1.files)
    assert n_chunks >= 60
    liar = Liar(tmp_path / "work", bucket.url, SECRET).start()
    env = dict(NO_STARTUP, BDN_PENALTY_S="600", BDN_MAX_PER_PEER="2")
    seed = Daemon(tmp_path / "work", "seed", bucket.url, extra_env=env)
    victim = Daemon(tmp_path / "work", "victim", bucket.url, extra_env=env)
    try:
        seed.start([])
        seed.wait_healthy()
        assert seed.prefetch("step000001")[0] == 202
        seed.wait_ready("step000001", 120)
        victim.start([seed.peer_url, liar.url])
        victim.wait_healthy()
        wait_for(
            lambda: {p["node_id"] for p in victim.status()["peers"] if p["alive"]},
            120,
            "the victim to see the seed and the liar alive",
            0.1,
            until=lambda alive: alive == {"seed", "liar"},
        )
        assert victim.prefetch("step000001")[0] == 202
        assert_same_files(Path(victim.wait_ready("step000001", 120)["path"]), ck1)
        st = victim.status()
        lies = st["verify_failures_by_peer"].get("liar", 0)
        assert 1 <= lies <= 2, (lies, n_chunks)
        assert st["counters"]["peer_chunks_in"] >= n_chunks - lies - st["counters"]["bucket_chunks_fallback"]
        bad_lines = [ln for ln in victim.log_path.read_text().splitlines() if "sent bad bytes" in ln]
        assert len(bad_lines) <= 2, bad_lines  # one line, then one summary line per interval
    finally:
        victim.stop()
        seed.stop()
        liar.stop()
