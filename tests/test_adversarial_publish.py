"""Publishers of one step racing, killed, or meeting a broken claim: real publisher processes
(``tests/support/racer.py``), file:// and a real moto S3 server (the races on file:// only: see
``racing``). Whatever happens, a published
snapshot's objects are the bytes its manifest names (nothing half-visible, no loser's file under
the winner's manifest), the refused publisher gets one clear error, and a later step publishes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bdn.bucket import Bucket, BucketError, ObjectNotFound, open_bucket
from bdn.proto.chunks import buffer_digests
from bdn.proto.manifest import MANIFEST_NAME, Manifest
from bdn.publish import PublishError, publish_full, publish_part
from bdn.publish.commit import claim_key
from support.api import wait_for
from support.ranks import CHUNK, model, owned
from tests.support.s3server import create_bucket

RACER = Path(__file__).resolve().parent / "support" / "racer.py"


@pytest.fixture(params=["file", "s3"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str | None]:
    """``(bucket url, endpoint url or None)``: a fresh file:// bucket, or a fresh bucket on moto."""
    if request.param == "file":
        (tmp_path / "bucket").mkdir()
        return f"file://{tmp_path / 'bucket'}", None
    endpoint = request.getfixturevalue("moto_endpoint")
    return f"s3://{create_bucket(endpoint)}/run1", endpoint


@pytest.fixture
def racing(tmp_path: Path) -> tuple[str, str | None]:
    """A file:// bucket for the races: ``link(2)`` decides them atomically. (moto's PutObject checks
    If-None-Match with a lookup and stores later, without a lock (moto/s3/responses.py), so two
    conditional PUTs racing there can both succeed (seen once here: two take-overs both won), which
    S3 itself never lets happen; bdn's S3 conditional write is tested in tests/test_bucket.py.)"""
    (tmp_path / "bucket").mkdir()
    return f"file://{tmp_path / 'bucket'}", None


def _start(spec: dict[str, object]) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [sys.executable, str(RACER), json.dumps(spec)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert p.stdout is not None
    line = p.stdout.readline()  # blocks until the racer has imported bdn and opened the bucket
    assert json.loads(line)["ready"], line
    return p


def _go(p: subprocess.Popen[str]) -> None:
    """Send a ready racer its start line."""
    assert p.stdin is not None
    p.stdin.write("go\n")
    p.stdin.flush()


def _race(specs: list[dict[str, object]]) -> list[dict[str, object]]:
    """Start every racer, let them go at once, and return their result lines (in ``specs`` order)."""
    procs = [_start(s) for s in specs]
    for p in procs:
        _go(p)
    out = []
    for p in procs:
        text, _ = p.communicate(timeout=600)
        assert p.returncode == 0, text
        out.append(json.loads(text.strip().splitlines()[-1]))
    return out


def _verify(b: Bucket, identity: str) -> Manifest:
    """The published manifest of ``identity``, after checking every object against its digests."""
    m = Manifest.from_json(b.read(f"{identity}/{MANIFEST_NAME}"), expect_identity=identity)
    for f in m.files:
        data = b.read(f"{identity}/{f.path}")
        assert len(data) == f.size and list(buffer_digests(data, m.chunk_size)) == list(f.chunks), (
            f"{identity}/{f.path}: the stored object is not the one the manifest names"
        )
    return m


def test_two_publishers_of_one_step_racing_leave_one_consistent_snapshot(
    racing: tuple[str, str | None], tmp_path: Path
) -> None:
    """A fast and a slow publisher of the same identity with different bytes start at once: the
    slow one's copy of a shared path must not land under the fast one's manifest."""
    url, endpoint = racing
    rng = np.random.default_rng(1)
    fast, slow = tmp_path / "fast", tmp_path / "slow"
    fast.mkdir()
    slow.mkdir()
    (fast / "z.json").write_bytes(b'{"from": "fast"}')
    (slow / "a.bin").write_bytes(rng.bytes(24 << 20))  # stored first (sorted, one worker): a head start
    (slow / "z.json").write_bytes(b'{"from": "slow"}')
    for round_ in range(2):
        ident = f"race{round_:06d}"
        base = {"url": url, "endpoint": endpoint, "identity": ident, "op": "full"}
        res = _race([{**base, "dir": str(fast)}, {**base, "dir": str(slow)}])
        assert sum(bool(r["ok"]) for r in res) == 1, res
        loser = next(r for r in res if not r["ok"])
        assert str(loser["error"]).startswith("PublishError: "), loser
        with open_bucket(url, endpoint_url=endpoint) as b:
            _verify(b, ident)
    publish_full(url if endpoint is None else open_bucket(url, endpoint_url=endpoint), "later000001", 2, dir=fast)


def test_two_commits_taking_over_one_dead_claim_publish_once(racing: tuple[str, str | None], tmp_path: Path) -> None:
    """A commit died on this host (its claim names a pid that no longer runs); two retries start
    at once: only one may take the claim over, the other is refused before it writes a file."""
    url, endpoint = racing
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for round_ in range(6):
        ident = f"step{round_:06d}"
        with open_bucket(url, endpoint_url=endpoint) as b:
            publish_part(b, ident, owned(model(1), 0, 1), rank=0, world_size=1, chunk_size=CHUNK)
            claim = {"host": socket.gethostname(), "pid": dead.pid, "started": "2026-12-07T04:00:00Z"}
            b.write(claim_key(ident), json.dumps(claim).encode())
        base = {"url": url, "endpoint": endpoint, "identity": ident, "op": "commit"}
        res = _race([{**base, "config": '{"from": "A"}'}, {**base, "config": '{"from": "B"}'}])
        assert sum(bool(r["ok"]) for r in res) == 1, res
        loser = next(r for r in res if not r["ok"])
        assert str(loser["error"]).startswith("PublishError: "), loser
        winner = "A" if res[0]["ok"] else "B"
        with open_bucket(url, endpoint_url=endpoint) as b:
            _verify(b, ident)
            assert json.loads(b.read(f"{ident}/config.json")) == {"from": winner}


def test_a_publisher_killed_mid_upload_leaves_nothing_visible_and_a_retry_publishes(
    target: tuple[str, str | None], tmp_path: Path
) -> None:
    """kill -9 of a publish between its first object and its manifest: the step is not published,
    its claim names a dead process of this host, and the retry takes the claim over."""
    url, endpoint = target
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(np.random.default_rng(2).bytes(24 << 20))
    (src / "z.json").write_bytes(b"{}")
    p = _start({"url": url, "endpoint": endpoint, "identity": "step000001", "op": "full", "dir": str(src)})
    with open_bucket(url, endpoint_url=endpoint) as b:
        _go(p)
        wait_for(lambda: _exists(b, claim_key("step000001")), 120, "the publisher's claim", 0.001)
        os.kill(p.pid, signal.SIGKILL)
        p.communicate(timeout=60)
        with pytest.raises(ObjectNotFound):
            b.stat(f"step000001/{MANIFEST_NAME}")
        assert json.loads(b.read(claim_key("step000001")))["pid"] == p.pid
        publish_full(b, "step000001", 1, dir=src, chunk_size=1 << 20)
        _verify(b, "step000001")
        publish_full(b, "step000002", 2, dir=src, chunk_size=1 << 20)
        _verify(b, "step000002")


def _exists(b: Bucket, key: str) -> bool:
    try:
        b.stat(key)
    except ObjectNotFound:
        return False
    return True


def test_a_broken_or_foreign_claim_is_one_clear_error_and_overwrite_publishes(
    target: tuple[str, str | None], tmp_path: Path
) -> None:
    """Garbage at the claim's key (not JSON, a JSON list, 8 MiB) is refused in one line without
    reading it whole or writing an object; a claim naming a live process of this host whose start
    tick differs (its pid was reused after the publisher died) is taken over; overwrite=True
    publishes over garbage; a manifest already there is 'already published'."""
    url, endpoint = target
    src = tmp_path / "src"
    src.mkdir()
    (src / "z.json").write_bytes(b"{}")
    with open_bucket(url, endpoint_url=endpoint) as b:
        for i, garbage in enumerate([b"{not json", b"[1, 2]", b'{"host": 1}', b" " * (8 << 20)]):
            ident = f"bad{i:06d}"
            b.write(claim_key(ident), garbage)
            size = len(garbage) if len(garbage) < 4096 else "more than 4096"
            with pytest.raises(PublishError, match=rf"{ident}.*is not a bdn claim \({size} bytes"):
                publish_full(b, ident, 1, dir=src)
            assert [o.key for o in b.list(f"{ident}/")] == []
            publish_full(b, ident, 1, dir=src, overwrite=True)
            _verify(b, ident)
        other = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
        try:
            claim = {"host": socket.gethostname(), "pid": other.pid, "proc": "not-this-boot:1", "started": "?"}
            b.write(claim_key("reused000001"), json.dumps(claim).encode())
            publish_full(b, "reused000001", 1, dir=src)
            _verify(b, "reused000001")
            claim["proc"] = json.loads(b.read(claim_key("reused000001")))["proc"].split(":")[0] + ":" + _tick(other.pid)
            b.write(claim_key("live000001"), json.dumps(claim).encode())
            with pytest.raises(PublishError, match=rf"being committed by another publisher \(.* pid {other.pid}"):
                publish_full(b, "live000001", 1, dir=src)
            assert [o.key for o in b.list("live000001/")] == []
        finally:
            other.communicate(b"", timeout=60)
        with pytest.raises(PublishError, match="already published"):
            publish_full(b, "reused000001", 1, dir=src)


def _tick(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19]


def test_a_failed_publish_releases_its_claim_for_a_retry_from_anywhere(tmp_path: Path) -> None:
    """A publish that fails cleanly (the bucket refuses an object: a directory stands at its key)
    marks its claim released: a retry, even one another host would make, is not refused."""
    import shutil

    root = tmp_path / "bucket"
    (root / "step000001" / "z.bin").mkdir(parents=True)
    url = f"file://{root}"
    src = tmp_path / "src"
    src.mkdir()
    (src / "z.bin").write_bytes(b"x" * 100)
    with open_bucket(url) as b:
        with pytest.raises(BucketError):
            publish_full(b, "step000001", 1, dir=src)
        held = json.loads(b.read(claim_key("step000001")))
        assert "released" in held, held
        shutil.rmtree(root / "step000001")
        publish_full(b, "step000001", 1, dir=src)
        _verify(b, "step000001")
