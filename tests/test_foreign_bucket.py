"""Foreign snapshots end to end at the bucket: an anchor and two deltas written by
``fireworks-delta-compression`` (the hosted services' own library) and uploaded with plain boto3
(multipart for the large shard, so its ETag is not an MD5) to a real S3 API (moto), or copied
into a file:// bucket; tables derived by bdn, identically on two calls; every object assembled
chunk by chunk, verified against the bucket's checksum, the deltas applied, and the rebuilt files
compared with the trainer's. Plus an object replaced mid-download and a flipped byte.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

try:
    from support.foreign_run import BIG, PART, SMALL, Run, boto, make_run, stored_run, upload
except ImportError as exc:  # .ci/run installs it (after a CPU torch); elsewhere say why
    pytest.skip(f"fireworks-delta-compression is not importable: {exc}", allow_module_level=True)

from bdn.bucket import Bucket, ObjectChanged, ObjectChecksum, open_bucket
from bdn.foreign import object_checksum, read_chunk, read_foreign_table
from bdn.foreign.checksum import verify_object
from bdn.foreign.ready import check_ready
from bdn.foreign.repair import repair_from_bucket
from bdn.proto.arc import apply_diff, read_diff_header
from bdn.proto.errors import ChecksumError
from bdn.proto.foreign import ForeignSnapshotError, ForeignTable
from bdn.proto.safetensors_fmt import parse_header

try:
    from support.s3server import create_bucket
except ImportError:  # collected with tests/ as a package
    from tests.support.s3server import create_bucket

MiB = 1 << 20
CHUNK = 1 * MiB  # divides PART: a bad part is whole chunks


# the trainer (tests/support/foreign_run.py): an anchor and two RL steps, as a Fireworks user
# writes them; the deltas arc_v2 then arc_v1


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return make_run(tmp_path_factory.mktemp("trainer"), steps=3)


# ---------------------------------------------------------------------------------------------
# buckets


@pytest.fixture(autouse=True)
def aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@dataclass
class Where:
    kind: str
    bucket: Bucket
    replace: object  # (identity/path key, bytes) -> None: the trainer overwrites an object


@pytest.fixture(params=["s3", "file"])
def where(request: pytest.FixtureRequest, run: Run, tmp_path: Path) -> Iterator[Where]:
    endpoint = request.getfixturevalue("moto_endpoint") if request.param == "s3" else None
    with stored_run(request.param, run, tmp_path, endpoint) as stored:
        bucket = open_bucket(stored.url, endpoint_url=endpoint) if endpoint else open_bucket(stored.url)
        try:
            yield Where(stored.kind, bucket, stored.replace)
        finally:
            bucket.close()


# ---------------------------------------------------------------------------------------------
# what a daemon does, without the swarm: fetch, verify, rebuild


def _assemble(bucket: Bucket, table: ForeignTable, path: str) -> bytearray:
    """The object's bytes gathered chunk by chunk (as owners fetch them and peers pass them on)."""
    entry = table.manifest.file(path)
    buf = bytearray(entry.size)
    view = memoryview(buf)
    fi = [f.path for f in table.manifest.files].index(path)
    for ref in table.manifest.stored_chunks():
        if ref.file_index == fi:
            read_chunk(bucket, table, ref, view[ref.offset : ref.offset + ref.length])
    return buf


def _tables(bucket: Bucket) -> list[ForeignTable]:
    t1 = read_foreign_table(bucket, "step000001", chunk_size=CHUNK, policy_version=1)
    t2 = read_foreign_table(
        bucket, "step000002", chunk_size=CHUNK, policy_version=2, base_identity="step000001", base=t1.manifest
    )
    t3 = read_foreign_table(
        bucket,
        "step000003",
        chunk_size=CHUNK,
        policy_version=3,
        base_identity="step000002",
        base=t2.manifest,
        compression_format="arc_v1",
    )
    return [t1, t2, t3]


def test_anchor_and_two_fireworks_deltas_load_bit_identical(where: Where, run: Run, tmp_path: Path) -> None:
    bucket = where.bucket
    tables = _tables(bucket)
    assert _tables(bucket) == tables  # a second daemon derives the same tables
    assert [t.table_id for t in _tables(bucket)] == [t.table_id for t in tables]
    t1, t2, t3 = tables
    files = ["config.json", BIG, SMALL, "model.safetensors.index.json"]
    assert [f.path for f in t1.manifest.files] == files
    assert (t1.manifest.kind, t2.manifest.kind, t3.manifest.kind) == ("full", "delta", "delta")
    assert (t2.manifest.base_identity, t2.manifest.compression_format) == ("step000001", "arc_v2")
    assert (t3.manifest.base_identity, t3.manifest.compression_format) == ("step000002", "arc_v1")
    assert t2.manifest.file(BIG).result_size == (run.trainer["step000002"] / BIG).stat().st_size
    assert t2.manifest.file(BIG).size < t2.manifest.file(BIG).result_size / 2  # a compressed diff
    listed = {i.key: i.etag for i in bucket.list()}
    assert all(listed[o.key] == o.etag for t in tables for o in t.objects)
    if where.kind == "s3":
        assert t1.object(BIG).etag.endswith("-3")  # 12 MiB in 5 MiB parts: not a plain MD5

    staged: dict[str, Path] = {}
    base_dir: Path | None = None
    for table in tables:
        ident = table.manifest.identity
        out = tmp_path / "shm" / ident
        out.mkdir(parents=True)
        verdicts = {}
        for entry in table.manifest.files:
            stored = _assemble(bucket, table, entry.path)
            verdict = verify_object(stored, object_checksum(bucket, table, entry.path), workers=2)
            verdicts[entry.path] = verdict
            if where.kind == "s3":
                assert verdict.ok, verdict.reason
                want = "multipart-md5" if table.object(entry.path).etag.endswith("-3") else "md5"
                assert verdict.method == want
            else:
                assert verdict.status == "unverifiable" and verdict.method == "none"
            if entry.is_diff:
                assert base_dir is not None
                base = np.fromfile(base_dir / entry.path, dtype=np.uint8)
                base_header = parse_header(base, base.size)
                diff = np.frombuffer(stored, dtype=np.uint8)
                diff_header = read_diff_header(diff, diff.size)
                rebuilt = np.empty(entry.result_size, dtype=np.uint8)
                apply_diff(base, base_header, diff, diff_header, rebuilt, table.manifest.compression_format)
                rebuilt.tofile(out / entry.path)
            else:
                (out / entry.path).write_bytes(stored)
        check_ready(table, out, verdicts, allow_unverifiable=where.kind == "file")
        staged[ident] = out
        base_dir = out
    for ident, out in staged.items():
        for name in files:
            assert (out / name).read_bytes() == (run.trainer[ident] / name).read_bytes(), (ident, name)


def test_object_replaced_mid_download_is_object_changed(where: Where, run: Run) -> None:
    bucket = where.bucket
    t1 = read_foreign_table(bucket, "step000001", chunk_size=CHUNK, policy_version=1)
    refs = [r for r in t1.manifest.stored_chunks() if r.path == BIG]
    buf = bytearray(refs[0].length)
    read_chunk(bucket, t1, refs[0], memoryview(buf))
    # The trainer re-uploads the shard while the fleet is fetching it.
    where.replace(f"step000001/{BIG}", (run.trainer["step000002"] / BIG).read_bytes())
    with pytest.raises(ObjectChanged, match=f"step000001/{BIG}") as err:
        read_chunk(bucket, t1, refs[1], memoryview(bytearray(refs[1].length)))
    assert err.value.key == f"step000001/{BIG}"
    with pytest.raises(ObjectChanged):
        object_checksum(bucket, t1, BIG)
    # A new listing gives a new table, with new chunk ids for that object only.
    t1b = read_foreign_table(bucket, "step000001", chunk_size=CHUNK, policy_version=1)
    assert t1b.table_id != t1.table_id
    assert t1b.manifest.file(BIG).chunks != t1.manifest.file(BIG).chunks
    assert t1b.manifest.file(SMALL).chunks == t1.manifest.file(SMALL).chunks


@pytest.fixture
def s3(run: Run, moto_endpoint: str) -> Iterator[Bucket]:
    name = create_bucket(moto_endpoint)
    client = boto(moto_endpoint)
    upload(client, name, "run-1", run)
    client.close()
    bucket = open_bucket(f"s3://{name}/run-1", endpoint_url=moto_endpoint)
    yield bucket
    bucket.close()


def test_flipped_byte_from_a_peer_is_caught_and_its_part_named(s3: Bucket) -> None:
    t1 = read_foreign_table(s3, "step000001", chunk_size=CHUNK, policy_version=1)
    checksum = object_checksum(s3, t1, BIG)
    assert (checksum.parts, checksum.part_size) == (3, PART)
    honest = _assemble(s3, t1, BIG)
    good = verify_object(honest, checksum)
    assert good.ok and len(good.part_md5s) == 3
    flip_at = PART + 2 * CHUNK + 123  # in part 2, chunk 7
    lied = bytearray(honest)
    lied[flip_at] ^= 0x01

    # Alone, the daemon knows the object is wrong, not where.
    bad = verify_object(lied, checksum)
    assert bad.status == "bad" and bad.bad_parts is None
    assert "the MD5 of its 3 part MD5s is not the ETag's" in bad.reason
    # With an honest peer's part list (self-certifying: checked against the ETag) it names the part.
    named = verify_object(lied, checksum, certified_parts=good.part_md5s)
    assert named.bad_parts == (1,)
    assert f"part 2 (bytes {PART}-{2 * PART - 1}) differ" in named.reason
    # A lying peer's list is not believed.
    forged = list(good.part_md5s)
    forged[0] = "0" * 32
    assert verify_object(lied, checksum, certified_parts=forged).bad_parts is None

    # Re-read only that part from the bucket: the differing chunk is found and fixed.
    fixed = repair_from_bucket(s3, checksum, lied, named, chunk_size=CHUNK, certified_parts=good.part_md5s)
    assert fixed.parts == (1,) and fixed.bytes_read == PART
    assert fixed.bad_ranges == ((PART + 2 * CHUNK, CHUNK),)
    assert fixed.verdict.ok and lied == honest
    # Without a list, every part is re-read, and still only the bad chunk differs.
    lied[flip_at] ^= 0x01
    fixed = repair_from_bucket(s3, checksum, lied, verify_object(lied, checksum), chunk_size=CHUNK)
    assert fixed.parts == (0, 1, 2) and fixed.bad_ranges == ((PART + 2 * CHUNK, CHUNK),)
    assert lied == honest


def test_flipped_byte_in_a_single_part_object(s3: Bucket) -> None:
    t1 = read_foreign_table(s3, "step000001", chunk_size=CHUNK, policy_version=1)
    checksum = object_checksum(s3, t1, SMALL)
    assert checksum.md5 is not None and checksum.parts is None
    buf = _assemble(s3, t1, SMALL)
    honest = bytes(buf)
    buf[-1] ^= 0x80
    verdict = verify_object(buf, checksum)
    assert verdict.status == "bad" and verdict.bad_parts == (0,) and "is not the bucket's" in verdict.reason
    fixed = repair_from_bucket(s3, checksum, buf, verdict, chunk_size=4096)
    last = (len(honest) - 1) // 4096 * 4096  # the flipped byte is in the last 4096-byte chunk
    assert fixed.bad_ranges == ((last, len(honest) - last),)
    assert bytes(buf) == honest


def test_a_bucket_whose_bytes_miss_its_own_checksum_is_refused(s3: Bucket) -> None:
    """SSE-KMS ETags, or a faulty bucket: even the bucket's bytes fail, and nothing vouches."""
    t1 = read_foreign_table(s3, "step000001", chunk_size=CHUNK, policy_version=1)
    real = object_checksum(s3, t1, SMALL)
    wrong = ObjectChecksum(key=real.key, etag=real.etag, size=real.size, md5="0" * 32)
    buf = _assemble(s3, t1, SMALL)
    with pytest.raises(ChecksumError, match="the bucket's own bytes do not match its md5 checksum"):
        repair_from_bucket(s3, wrong, buf, verify_object(buf, wrong), chunk_size=CHUNK)


def test_check_ready_refuses_unverified_and_broken_files(s3: Bucket, tmp_path: Path) -> None:
    t1 = read_foreign_table(s3, "step000001", chunk_size=CHUNK, policy_version=1)
    verdicts = {}
    for entry in t1.manifest.files:
        data = _assemble(s3, t1, entry.path)
        (tmp_path / entry.path).write_bytes(data)
        verdicts[entry.path] = verify_object(data, object_checksum(s3, t1, entry.path))
    check_ready(t1, tmp_path, verdicts)
    with pytest.raises(ForeignSnapshotError, match=f"step000001/{SMALL} was not verified"):
        check_ready(t1, tmp_path, {k: v for k, v in verdicts.items() if k != SMALL})
    # A header that breaks the format (here: a tensor running past the data) fails READY.
    data = bytearray((tmp_path / SMALL).read_bytes())
    data[8:9] = b"["
    (tmp_path / SMALL).write_bytes(data)
    with pytest.raises(ForeignSnapshotError, match=f"{SMALL}: safetensors header does not start with"):
        check_ready(t1, tmp_path, verdicts)
    (tmp_path / SMALL).write_bytes(data[:-1])
    with pytest.raises(ForeignSnapshotError, match="bytes in the staged snapshot, the table says"):
        check_ready(t1, tmp_path, verdicts)
