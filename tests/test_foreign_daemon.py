"""Snapshots without bdn.manifest.json, loaded by real bdnd processes (``require_manifest =
false``; issue 11): an anchor and two deltas written by ``fireworks-delta-compression`` and
uploaded with plain boto3 (multipart for the large shard) to a real S3 API (moto), or copied into
a file:// bucket, loaded by a three-daemon swarm through the hot-load API; files bit-identical to
the trainer's and READY carrying their real xxh3-128 digests, their chunks shared over the
transfer wire like any snapshot's. Plus: a lying peer, an object
overwritten mid-download, the idempotent re-POST, the delta chain cap, a config.json mismatch,
prefetch of nothing, cancel.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import pytest
from aiohttp import web

from bdn import fileops
from bdn.proto.keys import derive_keys, sign_request
from support.api import http, raw_request, wait_fleet, wait_for
from support.foreign_run import (  # a test dependency
    BIG,
    MiB,
    Run,
    boto,
    copy_to,
    make_run,
    replace_file,
    stored_run,
    upload,
)
from support.liar import Liar
from support.s3server import S3Proxy, create_bucket
from support.swarm import SECRET, Daemon, Swarm, running

CHUNK = MiB
HOT = "/hot_load/v1/models/hot_load"
FOREIGN = {
    "BDN_REQUIRE_MANIFEST": "false",
    "BDN_FOREIGN_CHUNK_SIZE": str(CHUNK),
    "BDN_LOAD_STARTUP": "false",
    "BDN_STARTUP_SETTLE_S": "1",
}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return make_run(tmp_path_factory.mktemp("trainer"))


@dataclass
class Where:
    url: str  # the bucket URL the daemons read
    env: dict[str, str]  # extra daemon environment (the S3 endpoint)
    replace: Any  # (identity/path key, bytes) -> None: the trainer overwrites an object


@pytest.fixture(params=["s3", "file"])
def where(request: pytest.FixtureRequest, run: Run, tmp_path: Path) -> Iterator[Where]:
    endpoint = request.getfixturevalue("moto_endpoint") if request.param == "s3" else None
    with stored_run(request.param, run, tmp_path, endpoint) as stored:
        yield Where(stored.url, {"BDN_ENDPOINT_URL": endpoint} if endpoint else {}, stored.replace)


def assert_same_files(path: Path, trainer: Path) -> None:
    got = sorted(p.name for p in path.iterdir() if p.name != "READY")
    assert got == sorted(p.name for p in trainer.iterdir()), got
    for f in trainer.iterdir():
        assert (path / f.name).read_bytes() == f.read_bytes(), f.name


def assert_ready_digests(path: Path) -> None:
    """READY carries the files' real xxh3-128 digests (what ``bdnctl verify`` re-hashes), not ids."""
    ready = json.loads((path / "READY").read_text())
    for f in ready["files"]:
        assert f["chunks"] == fileops.chunk_digests(path / f["path"], ready["chunk_size"]), f["path"]


def post(d: Daemon, identity: str, meta: dict[str, str] | None = None) -> tuple[int, dict]:
    body: dict[str, Any] = {"identity": identity}
    if meta is not None:
        body["incremental_snapshot_metadata"] = meta
    return http("POST", d.url + HOT, body)


def test_three_daemons_load_fireworks_anchor_and_two_deltas(where: Where, run: Run, tmp_path: Path) -> None:
    with Swarm(tmp_path / "nodes", 3, where.url, extra_env={**FOREIGN, **where.env}) as swarm:
        a, b = swarm.daemons[0], swarm.daemons[1]
        from_peers = 0

        def check(ident: str) -> None:
            # each step on every node as soon as the fleet is done with it (GC may collect a
            # step the replicas have left once a later one is served: keep_ready)
            nonlocal from_peers
            for d in swarm.daemons:
                snap = d.get(f"/v1/snapshots/{ident}")
                assert snap["state"] == "ready", snap
                assert_same_files(Path(snap["path"]), run.trainer[ident])
                assert_ready_digests(Path(snap["path"]))
                from_peers += snap["bytes_from_peers"]

        st, ans = post(a, "step000001")
        assert st == 200 and ans["manifest_written"] is False, ans
        wait_fleet(a.url, "step000001", timeout=120)
        check("step000001")
        # compression_format omitted; checksum_format in both spellings
        st, ans2 = post(b, "step000002", {"previous_snapshot_identity": "step000001", "checksum_format": "adler32"})
        assert st == 200, ans2
        # the same request again: 200 with the same request id, not 409
        st, again = post(b, "step000002", {"previous_snapshot_identity": "step000001", "checksum_format": "adler32"})
        assert st == 200 and again["request_id"] == ans2["request_id"], (ans2, again)
        wait_fleet(a.url, "step000002", timeout=120)
        check("step000002")
        st, ans3 = post(a, "step000003", {"previous_snapshot_identity": "step000002", "checksum_format": "alder32"})
        assert st == 200, ans3
        wait_fleet(b.url, "step000003", timeout=120)
        check("step000003")
        for d in swarm.daemons:
            assert sum(d.status()["verify_failures_by_peer"].values()) == 0
            c = d.status()["counters"]
            # one chunk path: what came from peers came over the transfer wire (issue 27)
            assert c["peer_wire_bytes_in"] == c["peer_bytes_in"], (d.node_id, c)
        if where.url.startswith("s3://"):
            assert from_peers > 0  # the swarm shared what the bucket vouches for, over the wire
        snap = a.get("/v1/snapshots/step000003")
        assert snap["kind"] == "delta" and snap["base_identity"] == "step000002" and snap["policy_version"] == 3


def test_lying_peer_gets_no_wrong_bytes_into_ready(
    run: Run, moto_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = create_bucket(moto_endpoint)
    client = boto(moto_endpoint)
    upload(client, name, "run-1", run, only=["step000001"])
    url = f"s3://{name}/run-1"
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)  # the liar's bucket client
    liar = Liar(tmp_path / "work", url, SECRET, foreign_chunk_size=CHUNK).start()
    env = {**FOREIGN, "BDN_ENDPOINT_URL": moto_endpoint, "BDN_PENALTY_S": "0.5"}
    honest = [Daemon(tmp_path / "work", n, url, extra_env=env) for n in ("node0", "node1")]
    peers = [d.peer_url for d in honest] + [liar.url]
    try:
        for d in honest:
            d.start(peers)
        for d in honest:
            d.wait_healthy()
        for d in honest:  # generous: membership settles in seconds even on a busy machine
            wait_for(
                lambda d=d: {p["node_id"] for p in d.status()["peers"] if p["alive"]},
                120,
                f"{d.node_id} to see the others alive",
                0.1,
                until=lambda alive, d=d: alive == {"node0", "node1", "liar"} - {d.node_id},
            )
        for d in honest:
            assert d.prefetch("step000001")[0] == 202
        for d in honest:
            path = Path(d.wait_ready("step000001", 120)["path"])
            assert_same_files(path, run.trainer["step000001"])
            assert_ready_digests(path)
        blamed = {d.node_id: d.status()["verify_failures_by_peer"] for d in honest}
        assert all(set(v) <= {"liar"} for v in blamed.values()), blamed
        assert sum(v.get("liar", 0) for v in blamed.values()) > 0, blamed
        keys = derive_keys(SECRET)
        p = f"/bdn/v1/{keys.swarm_id}/liar/stats"
        status, body = raw_request(
            liar.url, "GET", p, {"Authorization": sign_request(keys, "GET", p, "tester", to="liar")}
        )
        lied = json.loads(body)
        assert status == 200 and lied["wire_lied"] == lied["chunks_lied"] > 0, lied  # over the wire
    finally:
        for d in honest:
            d.stop()
        liar.stop()
        client.close()


def _wait_bytes(d: Daemon, identity: str, n: int) -> None:
    """Until ``identity`` has at least ``n`` bytes on ``d`` (generous deadline, states checked)."""
    wait_for(
        lambda: d.get(f"/v1/snapshots/{identity}"),
        120,
        f"{n} bytes of {identity}",
        until=lambda snap: snap["bytes_done"] >= n,
        meanwhile=lambda snap: snap["state"] in ("queued", "downloading"),
    )


def _flipped(run: Run) -> bytes:
    big = (run.trainer["step000001"] / BIG).read_bytes()
    return big[:-1] + bytes([big[-1] ^ 1])  # the trainer re-uploads it, one bit different


def _replace(file_url: str, key: str, data: bytes) -> None:
    """The trainer overwrites ``key`` in a file:// bucket (a new file renamed over it)."""
    replace_file(Path(file_url.removeprefix("file://")), key, data)


SLOW = {"BDN_BUCKET_MBIT": "16", "BDN_BUCKET_CONCURRENCY": "1"}


def test_object_overwritten_mid_download_restarts_on_a_fresh_listing(where: Where, run: Run, tmp_path: Path) -> None:
    with running(Daemon(tmp_path / "work", "node0", where.url, extra_env={**FOREIGN, **where.env, **SLOW})) as d:
        assert d.prefetch("step000001")[0] == 202
        _wait_bytes(d, "step000001", CHUNK)
        new = _flipped(run)
        where.replace(f"step000001/{BIG}", new)
        got = Path(d.wait_ready("step000001")["path"])
        assert (got / BIG).read_bytes() == new  # the new version whole, never a mix
        for f in run.trainer["step000001"].iterdir():
            if f.name != BIG:
                assert (got / f.name).read_bytes() == f.read_bytes(), f.name
        assert_ready_digests(got)
        assert "starting again on a fresh listing (restart 1 of 3)" in d.log()


def test_object_overwritten_past_the_restarts_fails_naming_it(file_run: str, run: Run, tmp_path: Path) -> None:
    env = {**FOREIGN, **SLOW, "BDN_FOREIGN_RESTARTS": "0"}
    with running(Daemon(tmp_path / "work", "node0", file_run, extra_env=env)) as d:
        assert d.prefetch("step000001")[0] == 202
        _wait_bytes(d, "step000001", CHUNK)
        _replace(file_run, f"step000001/{BIG}", _flipped(run))
        status, body = d.request("GET", "/v1/snapshots/step000001/wait?state=ready&timeout=120", timeout=150)
        assert status == 409, body
        assert "replaced during the download" in body["error"] and f"step000001/{BIG}" in body["error"], body
        assert not list(d.shm_dir.glob("*/step000001"))


class RedirectChunkReads(S3Proxy):
    """Answers the next ``n`` chunk reads of ``key`` (ranged GETs at a non-zero multiple of the
    512 KiB bucket part: no header read starts there) with a 307 to a port nothing listens on:
    a redirect the bucket client does not follow (``BucketUnavailable``)."""

    def __init__(self, upstream: str, key: str, n: int) -> None:
        super().__init__(upstream)
        self.key, self.left, self.hit = key, n, 0

    async def _answer(self, request, record, finished):  # type: ignore[no-untyped-def]
        start = (record.range or "").removeprefix("bytes=").partition("-")[0]
        if request.method == "GET" and record.key.endswith(self.key) and start.isdigit():
            if int(start) and not int(start) % (512 << 10):
                with self._lock:
                    fault, self.left = self.left > 0, self.left - 1
                    self.hit += fault
                if fault:
                    record.injected, record.status = True, 307
                    return web.Response(status=307, headers={"Location": "http://127.0.0.1:1" + request.raw_path})
        return await super()._answer(request, record, finished)


def test_chunk_reads_are_pinned_to_the_etag_and_read_again_after_a_transient_failure(
    run: Run, moto_endpoint: str, tmp_path: Path
) -> None:
    """A foreign chunk is read from the bucket on the same path as any chunk (the wire's
    ``from_bucket``), every request at the ETag the listing gave (``If-Match``: one snapshot
    never mixes two versions of an object); a read that fails transiently is read again, not
    the end of the snapshot."""
    with stored_run("s3", run, tmp_path, moto_endpoint) as stored:
        proxy = RedirectChunkReads(moto_endpoint, BIG, 2).start()
        try:
            env = {**FOREIGN, "BDN_ENDPOINT_URL": proxy.url}
            with running(Daemon(tmp_path / "work", "node0", stored.url, extra_env=env)) as d:
                assert d.prefetch("step000001")[0] == 202
                got = Path(d.wait_ready("step000001")["path"])
                assert_same_files(got, run.trainer["step000001"])
                assert "Traceback" not in d.log(), d.log()
        finally:
            proxy.stop()
    assert proxy.hit == 2
    reads = [r for r in proxy.requests("GET", f"run-1/step000001/{BIG}") if r.range]
    assert len({r.headers.get("if-match") for r in reads}) == 1 and reads[0].headers.get("if-match"), reads


def _kill_mid_download(d: Daemon, identity: str) -> None:
    """SIGKILL ``d`` once ``identity`` has saved progress with some chunks and is still downloading."""
    _wait_bytes(d, identity, 3 * CHUNK)
    progress = next(d.shm_dir.glob(f"*/.progress/{identity}"))
    wait_for(lambda: any(msgpack.unpackb(progress.read_bytes(), raw=False)["s"]), 120, "saved progress with a chunk")
    assert d.get(f"/v1/snapshots/{identity}")["state"] == "downloading"
    d.kill()
    d.env["BDN_BUCKET_MBIT"] = "0"  # the restarted daemon reads at full speed


def test_sigkill_mid_download_resumes_when_every_etag_is_unchanged(where: Where, run: Run, tmp_path: Path) -> None:
    env = {**FOREIGN, **where.env, **SLOW, "BDN_PROGRESS_INTERVAL_S": "0.1"}
    with running(Daemon(tmp_path / "work", "node0", where.url, extra_env=env)) as d:
        assert d.prefetch("step000001")[0] == 202
        _kill_mid_download(d, "step000001")
        d.start([])
        d.wait_healthy()
        got = Path(d.wait_ready("step000001")["path"])
        assert_same_files(got, run.trainer["step000001"])
        assert_ready_digests(got)
        resumed = re.search(r"resumed with (\d+) of (\d+) stored chunks", d.log())
        assert resumed and int(resumed.group(1)) > 0, d.log()


def test_sigkill_then_an_object_replaced_starts_over(file_run: str, run: Run, tmp_path: Path) -> None:
    env = {**FOREIGN, **SLOW, "BDN_PROGRESS_INTERVAL_S": "0.1"}
    with running(Daemon(tmp_path / "work", "node0", file_run, extra_env=env)) as d:
        assert d.prefetch("step000001")[0] == 202
        _kill_mid_download(d, "step000001")
        new = _flipped(run)
        _replace(file_run, f"step000001/{BIG}", new)
        d.start([])
        d.wait_healthy()
        got = Path(d.wait_ready("step000001")["path"])
        assert (got / BIG).read_bytes() == new
        log = d.log()
        assert f"the bucket changed since the interrupted download ({BIG}); starting over" in log, log
        assert "resumed with" not in log.split("starting over")[-1]


@pytest.fixture
def file_run(run: Run, tmp_path: Path) -> str:
    root = tmp_path / "bucket"
    copy_to(root, run)
    return f"file://{root}"


def test_delta_chain_cap_requires_a_full_snapshot(file_run: str, tmp_path: Path) -> None:
    with running(Daemon(tmp_path / "work", "node0", file_run, extra_env={**FOREIGN, "BDN_MAX_DELTA_CHAIN": "1"})) as d:
        assert post(d, "step000001")[0] == 200
        wait_fleet(d.url, "step000001", timeout=120)
        assert post(d, "step000002", {"previous_snapshot_identity": "step000001"})[0] == 200
        wait_fleet(d.url, "step000002", timeout=120)
        st, body = post(d, "step000003", {"previous_snapshot_identity": "step000002"})
        assert st == 409 and "full snapshot is required" in body["error"] and "max_delta_chain" in body["error"], body


def test_config_mismatch_fails_naming_the_field(tmp_path: Path) -> None:
    r = make_run(tmp_path / "trainer", steps=2)
    root = tmp_path / "bucket"
    copy_to(root, r)
    # delta_compress_dirs copies the *base's* other files; the trainer uploads its own config.json
    changed = {"architectures": ["TinyForCausalLM"], "model_type": "tiny", "hidden_size": 4096}
    (root / "step000002" / "config.json").write_text(json.dumps(changed))
    with running(Daemon(tmp_path / "work", "node0", f"file://{root}", extra_env=FOREIGN)) as d:
        assert post(d, "step000001")[0] == 200
        wait_fleet(d.url, "step000001", timeout=120)
        assert post(d, "step000002", {"previous_snapshot_identity": "step000001"})[0] == 200
        rep = wait_for(
            lambda: http("GET", d.url + HOT)[1]["replicas"][0],
            120,
            "the replica to report an error",
            0.1,
            until=lambda rep: rep["loading_state"]["stage"] == "error",
        )
        assert "Config value mismatch for hidden_size" in rep["loading_state"]["reason"], rep
        assert rep["current_snapshot_identity"] == "step000001"  # still serving the base


def bdnctl(d: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    """``bdnctl --url <d> ARGS`` in this process (its exit code and output; the command as a
    process is tested in tests/test_cli.py and tests/test_client.py)."""
    from bdn.cli import bdnctl as cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["--url", d.url, *args])
    return subprocess.CompletedProcess(["bdnctl", *args], code, out.getvalue(), err.getvalue())


def test_prefetch_of_nothing_fails_at_once_unless_asked_to_wait_and_cancel(file_run: str, tmp_path: Path) -> None:
    for env in (FOREIGN, {"BDN_LOAD_STARTUP": "false"}):  # without and with require_manifest
        with running(Daemon(tmp_path / "work", f"node{len(env)}", file_run, extra_env=env)) as d:
            assert d.prefetch("step000099")[0] == 202
            status, body = d.request("GET", "/v1/snapshots/step000099/wait?state=ready&timeout=120", timeout=150)
            assert status == 409 and "nothing is published under step000099/" in body["error"], body
            # asked to wait for publication: it waits, with the reason shown by bdnctl
            status, body = d.request("POST", "/v1/snapshots/step000098/prefetch?wait_publish=1")
            assert status == 202, body
            snap = wait_for(
                lambda: d.get("/v1/snapshots/step000098"),
                120,
                "a reason for step000098",
                until=lambda snap: snap["reason"],
                meanwhile=lambda snap: snap["state"] == "queued",
            )
            out = bdnctl(d, "snapshots")
            assert out.returncode == 0 and "step000098" in out.stdout and snap["reason"][:30] in out.stdout, out
            out = bdnctl(d, "prefetch", "step000098")  # already known: its state and reason
            assert out.returncode == 0 and snap["reason"][:30] in out.stdout, out
            # cancelled
            out = bdnctl(d, "cancel", "step000098")
            assert out.returncode == 0 and "cancelled by the operator" in out.stdout, out
            # a cancelled load is failed and forgotten (failed records stayed for good: new-user report)
            assert d.request("GET", "/v1/snapshots/step000098")[0] == 404
            assert "step000098" not in bdnctl(d, "snapshots").stdout
            assert bdnctl(d, "cancel", "step000097").returncode == 1


# ---- the pieces, without a daemon ------------------------------------------------------------


def test_foreign_state_trust_rules(file_run: str, tmp_path: Path) -> None:
    """Chunks of an object without a bucket checksum are read from the bucket unless accepted;
    chunks received from a peer are served on only once their object verified (the job's events)."""
    from bdn.bucket import open_bucket
    from bdn.daemon.snapshots.events import ForeignAttached, ForeignReceived, ForeignVerified, ManifestAttached
    from bdn.daemon.snapshots.foreign_state import ForeignState
    from bdn.daemon.snapshots.snapshot import SnapshotJob
    from bdn.daemon.store.store import Store
    from bdn.foreign import read_checksums, read_foreign_table

    bucket = open_bucket(file_run)
    try:
        table = read_foreign_table(bucket, "step000001", chunk_size=CHUNK, policy_version=1)
        checksums = read_checksums(bucket, table)
    finally:
        bucket.close()
    refs = list(table.manifest.stored_chunks())
    strict, lenient = ForeignState(table, checksums, False), ForeignState(table, checksums, True)
    assert strict.unverifiable == set(range(len(table.objects)))  # file:// vouches for nothing
    assert all(strict.bucket_only(r) for r in refs) and not any(lenient.bucket_only(r) for r in refs)
    job = SnapshotJob("step000001", Store(tmp_path / "shm", "swarm"))
    job.apply(ForeignAttached(lenient))
    job.apply(ManifestAttached.of(table.manifest, table.table_id, derived=True))
    a, b = refs[0], refs[1]
    job.apply(ForeignReceived(a, "http://peer", "peer"))
    assert not job.servable(a) and job.servable(b)  # b was read from the bucket here
    job.apply(ForeignVerified())
    assert job.servable(a)
    assert lenient.etag(a) == table.objects[a.file_index].etag


def test_ready_manifest_has_real_digests(file_run: str, tmp_path: Path) -> None:
    from bdn.bucket import open_bucket
    from bdn.daemon.snapshots.foreign_source import ready_manifest
    from bdn.foreign import read_foreign_table

    root = Path(file_run.removeprefix("file://")) / "step000001"
    bucket = open_bucket(file_run)
    try:
        m = read_foreign_table(bucket, "step000001", chunk_size=CHUNK, policy_version=1).manifest
    finally:
        bucket.close()
    real = ready_manifest(m, root)
    assert [f.path for f in real.files] == [f.path for f in m.files]
    for f in real.files:
        assert list(f.result_chunks) == fileops.chunk_digests(root / f.path, CHUNK)
        assert f.result_chunks != m.file(f.path).result_chunks  # ids are not digests
    assert real.file(BIG).size == m.file(BIG).size
