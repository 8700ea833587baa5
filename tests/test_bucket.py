"""bdn.bucket: one behaviour suite over file://, s3:// (moto server) and gs:// (moto as the GCS
endpoint), plus what only the S3 API has: retries, credentials files, multipart, GCS quirks.

Remote buckets are reached through :class:`S3Proxy`, so tests count the requests the bucket
really saw and inject throttling and broken bodies.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import threading
import tracemalloc
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from bdn.bucket import (
    AccessDenied,
    Bucket,
    BucketError,
    BucketUnavailable,
    ObjectChanged,
    ObjectInfo,
    ObjectNotFound,
    load_credentials_file,
    open_bucket,
)
from bdn.bucket.file import file_etag
from bdn.proto.errors import BdnError, PathError

try:
    from support.s3server import (
        S3Proxy,
        create_bucket,
        free_port,
    )
except ImportError:  # collected with tests/ as a package
    from tests.support.s3server import (
        S3Proxy,
        create_bucket,
        free_port,
    )

MiB = 1 << 20
# s3transfer never cuts parts below S3's 5 MiB minimum, so this is the smallest real part size.
PART = 5 * MiB

# ---------------------------------------------------------------------------------------------
# fixtures (the lead will lift these into conftest.py)


@pytest.fixture(autouse=True)
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Credentials moto accepts, and nothing from the developer's own AWS setup."""
    home = tmp_path_factory.mktemp("aws-home")
    for name in (
        "AWS_SESSION_TOKEN",
        "AWS_SECURITY_TOKEN",
        "AWS_PROFILE",
        "AWS_DEFAULT_PROFILE",
        "AWS_ENDPOINT_URL",
        "AWS_ENDPOINT_URL_S3",
        "AWS_REGION",
        "BDN_GCS_ENDPOINT_URL",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(home / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(home / "credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.fixture(scope="session")
def session_proxy(moto_endpoint: str) -> Iterator[S3Proxy]:
    proxy = S3Proxy(moto_endpoint).start()
    try:
        yield proxy
    finally:
        proxy.stop()


@pytest.fixture
def proxy(session_proxy: S3Proxy) -> Iterator[S3Proxy]:
    session_proxy.clear()
    yield session_proxy
    session_proxy.clear()


@pytest.fixture
def bucket_name(moto_endpoint: str) -> str:
    """A fresh bucket on the moto server for each test."""
    return create_bucket(moto_endpoint)


@dataclass
class Ctx:
    kind: str  # "file" | "s3" | "gs"
    bucket: Bucket
    proxy: S3Proxy | None
    url: str
    root_key: str  # the bucket-side key prefix of our root ("" for file)

    @property
    def remote(self) -> bool:
        return self.proxy is not None


def _open_remote(kind: str, name: str, proxy: S3Proxy, monkeypatch: pytest.MonkeyPatch, **options: object) -> Bucket:
    url = f"{kind}://{name}/run-1"
    kwargs: dict[str, object] = dict(
        multipart_threshold=PART,
        multipart_chunksize=PART,
        retry_backoff_scale=0.001,
        max_attempts=4,
    )
    kwargs.update(options)
    if kind == "gs" and "endpoint_url" not in kwargs:
        # GCS is reached through the env override, as a deployment pointing at a fake would.
        monkeypatch.setenv("BDN_GCS_ENDPOINT_URL", proxy.url)
    elif kind == "s3" and "endpoint_url" not in kwargs:
        kwargs["endpoint_url"] = proxy.url
    return open_bucket(url, **kwargs)  # type: ignore[arg-type]


@pytest.fixture(params=["file", "s3", "gs"])
def ctx(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Ctx]:
    kind = request.param
    if kind == "file":
        url = f"file://{tmp_path}/bucket root"
        bucket = open_bucket(url)
        c = Ctx(kind, bucket, None, url, "")
    else:
        proxy = request.getfixturevalue("proxy")
        name = request.getfixturevalue("bucket_name")
        bucket = _open_remote(kind, name, proxy, monkeypatch)
        c = Ctx(kind, bucket, proxy, f"{kind}://{name}/run-1", "run-1/")
    try:
        yield c
    finally:
        c.bucket.close()


@pytest.fixture(params=["s3", "gs"])
def rctx(
    request: pytest.FixtureRequest, proxy: S3Proxy, bucket_name: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Ctx]:
    kind = request.param
    bucket = _open_remote(kind, bucket_name, proxy, monkeypatch)
    try:
        yield Ctx(kind, bucket, proxy, f"{kind}://{bucket_name}/run-1", "run-1/")
    finally:
        bucket.close()


def pattern(n: int, seed: int = 0) -> bytes:
    """Deterministic bytes where every offset differs from its neighbours' (catches shifts)."""
    return bytes((i * 131 + seed + (i >> 8) * 7) & 0xFF for i in range(n))


def big_random(n: int) -> bytes:
    return os.urandom(n)


# ---------------------------------------------------------------------------------------------
# the shared behaviour suite


def test_write_read_stat_list(ctx: Ctx) -> None:
    b = ctx.bucket
    assert b.url == ctx.url
    files = {
        "STARTUP_SNAPSHOT": b"step000001\n",
        "step000001/config.json": b'{"a": 1}',
        "step000001/model-00001-of-00002.safetensors": pattern(3000),
        "step000001/sub/dir/tokenizer.json": b"{}",
        "step0000010/config.json": b"x",
        "empty": b"",
    }
    for key, data in files.items():
        b.write(key, data)
    for key, data in files.items():
        assert b.read(key) == data
        info = b.stat(key)
        assert isinstance(info, ObjectInfo)
        assert (info.key, info.size) == (key, len(data))
        assert info.etag

    everything = b.list()
    assert [i.key for i in everything] == sorted(files)
    assert {i.key: i.size for i in everything} == {k: len(v) for k, v in files.items()}
    assert {i.key: i.etag for i in everything} == {k: b.stat(k).etag for k in files}

    in_dir = b.list("step000001/")
    assert [i.key for i in in_dir] == sorted(k for k in files if k.startswith("step000001/"))
    assert [i.key for i in b.list("step00000")] == sorted(k for k in files if k.startswith("step0"))
    assert b.list("nothing-here/") == []

    # Overwrite: a reader sees the new object, and its etag changes.
    before = b.stat("step000001/config.json").etag
    b.write("step000001/config.json", memoryview(b'{"a": 22}'))
    assert b.read("step000001/config.json") == b'{"a": 22}'
    assert b.stat("step000001/config.json").etag != before

    stats = b.stats.snapshot()
    assert stats["put_requests"] == len(files) + 1
    assert stats["put_bytes"] == sum(map(len, files.values())) + 9
    assert stats["list_requests"] >= 4
    if ctx.remote:
        assert stats["get_requests"] == len(ctx.proxy.requests("GET", forwarded=True)) - stats["list_requests"]


def test_write_new_lets_exactly_one_of_racing_writers_create_the_object(ctx: Ctx) -> None:
    """The conditional write a commit relies on: of 6 writers racing for one key, one gets True
    and its bytes are the object's; a later write_new of an existing key changes nothing.

    The race itself runs on file:// (``link(2)`` decides it). moto's PutObject checks
    ``If-None-Match: *`` and then stores, not as one step, so two racers can both win there (seen
    in CI); S3 itself decides it atomically. On s3:// the writers go one after the other: what
    is checked there is that bdn sends the condition and reads moto's 412 as "exists"."""
    import threading

    key = "s1/claim.json"
    racing = ctx.kind == "file"
    start = threading.Barrier(6 if racing else 1)
    won: dict[int, bool] = {}

    def writer(i: int) -> None:
        start.wait()
        won[i] = ctx.bucket.write_new(key, f"writer {i}".encode())

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
        if not racing:
            t.join(120)
    for t in threads:
        t.join(120)
    winners = [i for i, ok in won.items() if ok]
    assert len(won) == 6 and len(winners) == 1, won
    assert ctx.bucket.read(key) == f"writer {winners[0]}".encode()
    assert ctx.bucket.write_new(key, b"late") is False
    assert ctx.bucket.read(key) == f"writer {winners[0]}".encode()
    if ctx.kind == "file":
        assert [o.key for o in ctx.bucket.list("s1/")] == [key]  # no temporary file left


def test_missing_object_is_object_not_found(ctx: Ctx) -> None:
    b = ctx.bucket
    for call in (
        lambda: b.stat("step000009/bdn.manifest.json"),
        lambda: b.read("step000009/bdn.manifest.json"),
        lambda: b.read_range_into("step000009/bdn.manifest.json", 0, memoryview(bytearray(10))),
    ):
        with pytest.raises(ObjectNotFound) as err:
            call()
        assert str(err.value) == f"object not found: {ctx.url}/step000009/bdn.manifest.json"
        assert isinstance(err.value, BucketError) and isinstance(err.value, BdnError)


def test_ranged_reads_into_memoryview(ctx: Ctx) -> None:
    b = ctx.bucket
    chunk = 256
    data = pattern(1000)  # chunks of 256, 256, 256, and a short last one of 232
    b.write("obj.bin", data)
    # One shared buffer, as the daemon receives into a file's mapped memory.
    target = bytearray(len(data))
    view = memoryview(target)
    for offset in range(0, len(data), chunk):
        n = min(chunk, len(data) - offset)
        b.read_range_into("obj.bin", offset, view[offset : offset + n])
    assert bytes(target) == data

    middle = bytearray(100)
    b.read_range_into("obj.bin", 437, memoryview(middle))
    assert bytes(middle) == data[437:537]

    # A range that runs past the end is a short read, never silently fewer bytes.
    with pytest.raises(BucketError, match="short read") as err:
        b.read_range_into("obj.bin", 900, memoryview(bytearray(200)))
    assert "\n" not in str(err.value)
    with pytest.raises(BucketError, match="short read"):
        b.read_range_into("obj.bin", 5000, memoryview(bytearray(10)))

    # Typed buffers are filled byte-wise.
    import array

    words = array.array("I", bytes(8))
    b.read_range_into("obj.bin", 4, memoryview(words))
    assert words.tobytes() == data[4:12]

    with pytest.raises(BucketError, match="writable"):
        b.read_range_into("obj.bin", 0, memoryview(b"readonly"))
    b.read_range_into("obj.bin", 10, memoryview(bytearray(0)))  # empty: nothing to do

    if ctx.remote:
        gets = ctx.proxy.requests("GET", key=ctx.root_key + "obj.bin", forwarded=True)
        ranges = [r.range for r in gets if r.range]
        assert ranges[:4] == ["bytes=0-255", "bytes=256-511", "bytes=512-767", "bytes=768-999"]
        assert "bytes=437-536" in ranges


def test_read_refuses_objects_over_max_size(ctx: Ctx) -> None:
    ctx.bucket.write("big.json", b"x" * 100)
    with pytest.raises(BucketError, match="over the 50-byte limit"):
        ctx.bucket.read("big.json", max_size=50)
    assert ctx.bucket.read("big.json", max_size=100) == b"x" * 100


def test_multipart_write_file(ctx: Ctx, tmp_path: Path) -> None:
    data = big_random(2 * PART + 12345)  # three parts
    src = tmp_path / "model.safetensors"
    src.write_bytes(data)
    ctx.bucket.write_file("step000001/model.safetensors", src)
    info = ctx.bucket.stat("step000001/model.safetensors")
    assert info.size == len(data)

    got = bytearray(len(data))
    view = memoryview(got)
    step = 4 * MiB
    for offset in range(0, len(data), step):
        ctx.bucket.read_range_into("step000001/model.safetensors", offset, view[offset : offset + step])
    assert got == data
    assert ctx.bucket.stats.snapshot()["put_bytes"] == len(data)

    if ctx.remote:
        key = ctx.root_key + "step000001/model.safetensors"
        puts = ctx.proxy.requests("PUT", key=key, forwarded=True)
        parts = sorted(r.query for r in puts if "partNumber=" in r.query)
        assert len(parts) == 3, parts
        posts = [r.query for r in ctx.proxy.requests("POST", key=key)]
        assert any(q.startswith("uploads") for q in posts)  # CreateMultipartUpload
        assert any(q.startswith("uploadId=") for q in posts)  # CompleteMultipartUpload
        assert info.etag.endswith("-3")  # S3's multipart ETag: md5-of-md5s "-" part count


def test_small_write_file_is_one_put(ctx: Ctx, tmp_path: Path) -> None:
    src = tmp_path / "config.json"
    src.write_bytes(b'{"hidden_size": 8}')
    ctx.bucket.write_file("step000001/config.json", src)
    assert ctx.bucket.read("step000001/config.json") == b'{"hidden_size": 8}'
    if ctx.remote:
        assert [r.query for r in ctx.proxy.requests("PUT", forwarded=True)] == [""]
    with pytest.raises(BucketError, match="cannot read"):
        ctx.bucket.write_file("x", tmp_path / "does-not-exist")


BAD_KEYS = [
    "",
    "/abs",
    "..",
    "a/../b",
    "../b",
    "a/..",
    ".",
    "a/./b",
    "a//b",
    "a/",
    "a\\b",
    "a\x00b",
    "a\nb",
    "x" * 1100,
]


@pytest.mark.parametrize("key", BAD_KEYS, ids=lambda k: repr(k)[:16])
def test_bad_keys_refused(ctx: Ctx, key: str) -> None:
    b = ctx.bucket
    for call in (
        lambda: b.stat(key),
        lambda: b.read(key),
        lambda: b.read_range_into(key, 0, memoryview(bytearray(4))),
        lambda: b.write(key, b"data"),
    ):
        with pytest.raises(PathError) as err:
            call()
        assert "\n" not in str(err.value)
    with pytest.raises(PathError):
        b.list("../")
    if ctx.remote:
        assert ctx.proxy.requests() == []  # refused before any request


def test_gets_counted_and_no_range_served_twice(ctx: Ctx) -> None:
    """N chunk reads cost exactly N bucket GETs, and no byte is fetched twice."""
    data = pattern(64 * 1024, seed=3)
    ctx.bucket.write("chunks.bin", data)
    if ctx.remote:
        ctx.proxy.clear()
    chunk = 8 * 1024
    out = bytearray(len(data))
    view = memoryview(out)
    errors: list[BaseException] = []

    def fetch(i: int) -> None:
        try:
            ctx.bucket.read_range_into("chunks.bin", i * chunk, view[i * chunk : (i + 1) * chunk])
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=fetch, args=(i,)) for i in range(len(data) // chunk)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert out == data
    stats = ctx.bucket.stats.snapshot()
    assert stats["get_requests"] == 8
    assert stats["get_bytes"] == len(data)
    if ctx.remote:
        gets = ctx.proxy.requests("GET", key=ctx.root_key + "chunks.bin")
        assert len(gets) == 8
        spans = sorted(_span(r.range) for r in gets)
        for (_, a1), (b0, _) in zip(spans, spans[1:]):
            assert a1 < b0, f"byte range served twice: {spans}"
        assert sum(r.response_bytes for r in gets) == len(data)


def _span(header: str | None) -> tuple[int, int]:
    assert header and header.startswith("bytes=")
    first, last = header[len("bytes=") :].split("-")
    return int(first), int(last)


def test_ranged_read_allocates_no_copy_of_the_body(
    ctx: Ctx, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bytes go from the socket (or file) straight into the caller's buffer. A remote bucket is
    read from the S3 server's own process here, not through this process's recording proxy,
    whose buffers tracemalloc would count too (1.3 MB of them under load: a failed run)."""
    size = 8 * MiB
    src = big_random(size)
    ctx.bucket.write("blob", src)
    bucket = ctx.bucket
    if ctx.remote:
        moto = request.getfixturevalue("moto_endpoint")
        if ctx.kind == "gs":
            monkeypatch.setenv("BDN_GCS_ENDPOINT_URL", moto)
            bucket = open_bucket(ctx.url)
        else:
            bucket = open_bucket(ctx.url, endpoint_url=moto)
    out = bytearray(size)
    try:
        bucket.read_range_into("blob", 0, memoryview(out[:1024]))  # warm the connection pool
        tracemalloc.start()
        try:
            bucket.read_range_into("blob", 0, memoryview(out))
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    finally:
        if bucket is not ctx.bucket:
            bucket.close()
    assert out == src
    assert peak < MiB, f"read_range_into allocated {peak} bytes for an {size}-byte range"


def test_conditional_read_refuses_a_replaced_object(ctx: Ctx) -> None:
    """A download pinned to a version token fails with ObjectChanged once the object is replaced,
    at the next chunk read: bytes of two versions never end up in one buffer."""
    b = ctx.bucket
    old = pattern(4000)
    b.write("step000002/model.safetensors", old)
    (info,) = b.list("step000002/")
    out = bytearray(len(old))
    view = memoryview(out)
    b.read_range_into(info.key, 0, view[:1000], if_match=info.etag)  # the first "chunk"
    b.write(info.key, pattern(4000, seed=9))  # the trainer re-uploads mid-download
    with pytest.raises(ObjectChanged, match="object changed while it was read") as err:
        b.read_range_into(info.key, 1000, view[1000:2000], if_match=info.etag)
    assert err.value.key == info.key
    assert info.key in str(err.value) and "\n" not in str(err.value)
    assert isinstance(err.value, BucketError)
    assert bytes(out[:1000]) == old[:1000]
    # The new version reads under its own token.
    new = b.stat(info.key)
    assert new.etag != info.etag
    b.read_range_into(info.key, 1000, view[1000:2000], if_match=new.etag)
    assert bytes(out[1000:2000]) == pattern(4000, seed=9)[1000:2000]
    if ctx.remote:
        gets = ctx.proxy.requests("GET", key=ctx.root_key + info.key)
        assert [r.headers.get("if-match") for r in gets][-3:] == [f'"{info.etag}"', f'"{info.etag}"', f'"{new.etag}"']
        assert [r.status for r in gets][-3:] == [206, 412, 206]


def test_file_rewritten_in_place_is_an_object_change(tmp_path: Path) -> None:
    """file://: a write into the same inode (no rename) changes the token too."""
    b = open_bucket(f"file://{tmp_path}")
    b.write("obj", pattern(1000))
    token = b.stat("obj").etag
    path = tmp_path / "obj"
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.write(b"\xff")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # a coarse-mtime fs still moves
    assert os.stat(path).st_ino == st.st_ino
    with pytest.raises(ObjectChanged, match="obj"):
        b.read_range_into("obj", 0, memoryview(bytearray(10)), if_match=token)


def test_checksum_of_each_backend(ctx: Ctx, tmp_path: Path) -> None:
    """What the bucket vouches for: S3's single-part MD5 and multipart layout; nothing on file://
    (moto as the GCS endpoint sends no x-goog-hash, so gs:// vouches for nothing here either)."""
    import hashlib

    b = ctx.bucket
    small = pattern(1000)
    b.write("small", small)
    big = big_random(2 * PART + 777)
    src = tmp_path / "big"
    src.write_bytes(big)
    b.write_file("big", src)
    infos = {i.key: i for i in b.list()}
    single = b.checksum("small", infos["small"].etag)
    multi = b.checksum("big", infos["big"].etag)
    assert (single.size, multi.size) == (1000, len(big))
    if ctx.kind == "s3":
        assert single.md5 == hashlib.md5(small).hexdigest() and single.parts is None
        assert (multi.md5, multi.parts, multi.part_size) == (None, 3, PART)
        parts = [big[i : i + PART] for i in range(0, len(big), PART)]
        composite = hashlib.md5(b"".join(hashlib.md5(p).digest() for p in parts)).hexdigest()
        assert multi.composite_md5 == composite
        assert single.verifiable and multi.verifiable
        # The additional checksums current SDKs send (boto3: CRC32), the fallback without MD5.
        import dataclasses

        from bdn.foreign.checksum import verify_object

        assert single.sdk_checksum is not None and not single.sdk_checksum.composite
        assert multi.sdk_checksum is not None and multi.sdk_checksum.composite
        no_md5 = dataclasses.replace(single, md5=None)
        no_composite = dataclasses.replace(multi, composite_md5=None)
        assert verify_object(small, no_md5).method == single.sdk_checksum.algorithm
        assert verify_object(small, no_md5).ok
        v = verify_object(big, no_composite, workers=2)
        assert v.ok and v.method == multi.sdk_checksum.algorithm + "-composite"
        flipped = bytearray(big)
        flipped[PART + 7] ^= 1
        assert verify_object(flipped, no_composite).status == "bad"
    else:
        assert not single.verifiable and not multi.verifiable
    b.write("small", pattern(1000, seed=3))
    with pytest.raises(ObjectChanged, match="small"):
        b.checksum("small", infos["small"].etag)


def test_checksum_of_a_multipart_object_with_parts_of_several_sizes(
    proxy: S3Proxy, bucket_name: str, moto_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An uploader that cut parts of 6, 5 and 1 MiB: the first and last parts' sizes show the
    parts differ, so every part's size is asked for, and the object verifies."""
    import boto3

    from bdn.foreign.checksum import verify_object

    b = _open_remote("s3", bucket_name, proxy, monkeypatch)
    client = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1")
    data = big_random(12 * MiB)
    cuts = [(0, 6 * MiB), (6 * MiB, 11 * MiB), (11 * MiB, 12 * MiB)]
    key = "run-1/odd"
    upload = client.create_multipart_upload(Bucket=bucket_name, Key=key)["UploadId"]
    done = []
    for n, (lo, hi) in enumerate(cuts, 1):
        part = client.upload_part(Bucket=bucket_name, Key=key, UploadId=upload, PartNumber=n, Body=data[lo:hi])
        done.append({"PartNumber": n, "ETag": part["ETag"]})
    client.complete_multipart_upload(Bucket=bucket_name, Key=key, UploadId=upload, MultipartUpload={"Parts": done})
    client.close()
    info = b.stat("odd")
    cs = b.checksum("odd", info.etag)
    assert (cs.parts, cs.part_size, cs.part_sizes) == (3, 6 * MiB, (6 * MiB, 5 * MiB, 1 * MiB))
    assert verify_object(data, cs).ok
    flipped = bytearray(data)
    flipped[7 * MiB] ^= 1
    assert not verify_object(flipped, cs).ok
    b.close()


def test_multipart_layout_that_only_looks_uniform(
    proxy: S3Proxy, bucket_name: str, moto_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Parts of 6, 5, 7 and 6 MiB: the first and last fit four 6 MiB parts, so the layout is
    inferred wrongly; the repair asks every part before it blames the bucket, and the copy
    verifies without a byte changed."""
    import boto3

    from bdn.foreign.repair import verify_or_repair

    b = _open_remote("s3", bucket_name, proxy, monkeypatch)
    client = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1")
    data = big_random(24 * MiB)
    sizes = [6 * MiB, 5 * MiB, 7 * MiB, 6 * MiB]
    key = "run-1/odd"
    upload = client.create_multipart_upload(Bucket=bucket_name, Key=key)["UploadId"]
    done, lo = [], 0
    for n, size in enumerate(sizes, 1):
        part = client.upload_part(Bucket=bucket_name, Key=key, UploadId=upload, PartNumber=n, Body=data[lo : lo + size])
        done.append({"PartNumber": n, "ETag": part["ETag"]})
        lo += size
    client.complete_multipart_upload(Bucket=bucket_name, Key=key, UploadId=upload, MultipartUpload={"Parts": done})
    client.close()
    etag = b.stat("odd").etag
    cs = b.checksum("odd", etag)
    assert (cs.part_size, cs.part_sizes) == (6 * MiB, None)  # inferred as four equal parts
    assert b.checksum("odd", etag, exact_parts=True).part_sizes == tuple(sizes)
    verdict, repair = verify_or_repair(b, cs, bytearray(data), chunk_size=MiB)
    assert verdict.status == "bad" and repair is not None
    assert repair.bad_ranges == () and repair.verdict.ok
    b.close()


def test_sse_kms_object_has_no_md5_but_its_sdk_checksum(
    proxy: S3Proxy, bucket_name: str, moto_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import boto3

    from bdn.foreign.checksum import verify_object

    b = _open_remote("s3", bucket_name, proxy, monkeypatch)
    client = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1")
    data = pattern(5000)
    client.put_object(Bucket=bucket_name, Key="run-1/kms", Body=data, ServerSideEncryption="aws:kms")
    client.close()
    cs = b.checksum("kms", b.stat("kms").etag)
    assert cs.md5 is None and cs.sdk_checksum is not None
    assert verify_object(data, cs).ok
    b.close()


def test_parse_etags_and_goog_hash() -> None:
    import base64

    from bdn.bucket.checksums import goog_hash, parse_s3_etag

    assert parse_s3_etag('"0123456789abcdef0123456789ABCDEF"') == ("0123456789abcdef0123456789abcdef", None)
    assert parse_s3_etag("0123456789abcdef0123456789abcdef-12") == ("0123456789abcdef0123456789abcdef", 12)
    for bad in ("", "W/x", "0123-1", "0123456789abcdef0123456789abcdef-0", "0123456789abcdef0123456789abcdef-10001"):
        assert parse_s3_etag(bad) == (None, None)
    md5 = bytes(range(16))
    crc = (0xDEADBEEF).to_bytes(4, "big")
    header = f"crc32c={base64.b64encode(crc).decode()},md5={base64.b64encode(md5).decode()}"
    assert goog_hash(header) == (md5.hex(), 0xDEADBEEF)
    assert goog_hash("crc32c=!!,md5=AAAA") == (None, None)
    assert goog_hash(None) == (None, None)


def test_uniform_parts_is_the_aws_uploaders_layout() -> None:
    from bdn.bucket.checksums import uniform_parts

    assert uniform_parts(8, 3, 4, 27)  # 8 + 8 + 8 + 3
    assert uniform_parts(8, 8, 2, 16)
    assert not uniform_parts(8, 3, 4, 28)  # a middle part of another size
    assert not uniform_parts(8, 9, 2, 17)  # the last part larger than the first


def test_short_206_is_retried_not_taken_as_the_end(rctx: Ctx) -> None:
    """Issue 12 item 7: a 206 whose body and headers agree but stop short of the range asked,
    while its Content-Range says the object goes on, is a broken answer: asked again from there."""
    b, proxy = rctx.bucket, rctx.proxy
    data = big_random(300_000)
    b.write("obj", data)
    proxy.clear()
    proxy.shorten_next(2, to_bytes=1000)
    out = bytearray(200_000)
    b.read_range_into("obj", 5000, memoryview(out))
    assert out == data[5000:205_000]
    gets = proxy.requests("GET", key="run-1/obj")
    assert [r.truncated for r in gets] == [True, True, False]
    assert [_span(r.range)[0] for r in gets] == [5000, 6000, 7000]
    assert b.stats.snapshot()["retries"] == 2


def test_short_206_that_keeps_coming_fails_naming_what_the_bucket_did(rctx: Ctx) -> None:
    rctx.bucket.write("obj", pattern(200_000))
    rctx.proxy.shorten_next(10, to_bytes=1000)
    with pytest.raises(BucketUnavailable, match="4 times with fewer bytes than asked") as err:
        rctx.bucket.read_range_into("obj", 0, memoryview(bytearray(200_000)))
    assert "Content-Range 'bytes 3000-3999/200000'" in str(err.value)
    rctx.proxy.clear()


# ---------------------------------------------------------------------------------------------
# file:// specifics


def test_file_etag_and_no_temp_files_left(tmp_path: Path) -> None:
    b = open_bucket(f"file://{tmp_path}")
    b.write("a/b", b"123")
    st = os.stat(tmp_path / "a" / "b")
    assert b.stat("a/b").etag == file_etag(st) == f"{st.st_size:x}-{st.st_mtime_ns:x}-{st.st_ino:x}"
    assert sorted(os.listdir(tmp_path / "a")) == ["b"]
    (tmp_path / "a" / ".bdn-tmp-leftover").write_bytes(b"half")
    assert [i.key for i in b.list()] == ["a/b"]


def test_file_refuses_to_escape_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    outside = tmp_path / "secret.txt"
    outside.write_bytes(b"do not read")
    (root / "link.txt").symlink_to(outside)
    (root / "linkdir").symlink_to(tmp_path)
    (root / "ok.txt").write_bytes(b"fine")
    b = open_bucket(f"file://{root}")
    with pytest.raises(PathError, match="escapes"):
        b.read("link.txt")
    with pytest.raises(PathError, match="escapes"):
        b.stat("linkdir/secret.txt")
    with pytest.raises(PathError, match="escapes"):
        b.write("linkdir/new.txt", b"x")
    assert not (tmp_path / "new.txt").exists()
    assert [i.key for i in b.list()] == ["ok.txt"]


def test_file_missing_root_reads_as_empty(tmp_path: Path) -> None:
    b = open_bucket(f"file://{tmp_path}/not-yet")
    assert b.list() == []
    with pytest.raises(ObjectNotFound):
        b.stat("STARTUP_SNAPSHOT")
    b.write("STARTUP_SNAPSHOT", b"step000001\n")
    assert b.read("STARTUP_SNAPSHOT") == b"step000001\n"


@pytest.mark.parametrize(
    "url",
    [
        "",
        "http://example.com/x",
        "file://relative/path",
        "file:relative",
        "s3://",
        "s3://Bad_Bucket!/x",
        "s3://bucket/a/../b",
        "gs://bucket/x?versionId=1",
    ],
)
def test_bad_urls_refused(url: str) -> None:
    with pytest.raises(BucketError) as err:
        open_bucket(url)
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------------------------------------
# S3 API specifics: retries, errors, credentials, GCS quirks


@pytest.mark.parametrize(("status", "code"), [(503, "SlowDown"), (500, "InternalError"), (429, "TooManyRequests")])
def test_retries_then_success(rctx: Ctx, status: int, code: str) -> None:
    b, proxy = rctx.bucket, rctx.proxy
    assert proxy is not None
    b.write("step000001/bdn.manifest.json", b'{"format": "bdn.snapshot/1"}')
    proxy.clear()
    proxy.fail_next(3, status=status, code=code)
    assert b.read("step000001/bdn.manifest.json") == b'{"format": "bdn.snapshot/1"}'
    stats = b.stats.snapshot()
    assert stats["retries"] == 3
    assert stats["get_requests"] == 1
    gets = proxy.requests("GET", key="run-1/step000001/bdn.manifest.json")
    assert [(r.status, r.injected) for r in gets] == [(status, True)] * 3 + [(200, False)]


def test_retries_for_ranged_reads(rctx: Ctx) -> None:
    b, proxy = rctx.bucket, rctx.proxy
    data = pattern(4096)
    b.write("c", data)
    proxy.clear()
    proxy.fail_next(3, status=503, code="SlowDown")
    out = bytearray(1000)
    b.read_range_into("c", 1000, memoryview(out))
    assert out == data[1000:2000]
    gets = proxy.requests("GET", key="run-1/c")
    assert len(gets) == 4 and {r.range for r in gets} == {"bytes=1000-1999"}
    assert b.stats.snapshot()["retries"] == 3


def test_retries_exhausted_is_bucket_unavailable(rctx: Ctx) -> None:
    b, proxy = rctx.bucket, rctx.proxy
    b.write("k", b"v")
    proxy.clear()
    proxy.fail_next(100, status=503, code="SlowDown")
    with pytest.raises(BucketUnavailable) as err:
        b.read("k")
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"read {rctx.url}/k: gave up after 4 attempts: SlowDown (503)")
    assert len(proxy.requests("GET", key="run-1/k")) == 4  # max_attempts=4
    assert b.stats.snapshot()["retries"] == 3


def test_unreachable_endpoint_is_bucket_unavailable(bucket_name: str) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    b = open_bucket(f"s3://{bucket_name}", endpoint_url=dead, max_attempts=2, retry_backoff_scale=0.001)
    with pytest.raises(BucketUnavailable) as err:
        b.stat("k")
    assert "\n" not in str(err.value) and "127.0.0.1" in str(err.value)
    assert b.stats.snapshot()["retries"] == 1
    b.close()


def test_access_denied_is_not_retried(rctx: Ctx) -> None:
    rctx.bucket.write("k", b"v")
    rctx.proxy.clear()
    rctx.proxy.fail_next(1, status=403, code="AccessDenied", message="Access Denied")
    with pytest.raises(AccessDenied, match="access denied: AccessDenied"):
        rctx.bucket.read("k")
    assert len(rctx.proxy.requests("GET")) == 1


def test_missing_bucket_is_not_object_not_found(moto_endpoint: str) -> None:
    b = open_bucket("s3://no-such-bucket-bdn/x", endpoint_url=moto_endpoint, max_attempts=1)
    with pytest.raises(BucketError) as err:
        b.read("k")
    assert not isinstance(err.value, ObjectNotFound)
    assert "does not exist" in str(err.value)


def test_broken_body_is_resumed_without_refetching(rctx: Ctx) -> None:
    b, proxy = rctx.bucket, rctx.proxy
    data = big_random(3 * MiB)
    b.write("obj", data)
    proxy.clear()
    proxy.truncate_next(2, after_bytes=100_000)
    out = bytearray(2 * MiB)
    b.read_range_into("obj", 12345, memoryview(out))
    assert out == data[12345 : 12345 + 2 * MiB]
    gets = proxy.requests("GET", key="run-1/obj")
    assert [r.truncated for r in gets] == [True, True, False]
    assert [_span(r.range)[0] for r in gets] == [12345, 112345, 212345]
    etag = '"' + b.stat("obj").etag + '"'
    assert [r.headers.get("if-match") for r in gets] == [None, etag, etag]
    assert sum(r.response_bytes for r in gets) == 2 * MiB  # nothing served twice
    assert b.stats.snapshot()["retries"] == 2
    # A whole-object read resumes the same way.
    proxy.truncate_next(1, after_bytes=5000)
    assert b.read("obj") == data


def test_body_that_keeps_breaking_gives_up(rctx: Ctx) -> None:
    rctx.bucket.write("obj", pattern(200_000))
    rctx.proxy.truncate_next(10, after_bytes=1000)
    with pytest.raises(BucketUnavailable, match="broke off 4 times"):
        rctx.bucket.read_range_into("obj", 0, memoryview(bytearray(200_000)))


def test_concurrency_is_bounded(proxy: S3Proxy, bucket_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    b = _open_remote("s3", bucket_name, proxy, monkeypatch, max_concurrency=3)
    data = big_random(2 * MiB)
    b.write("obj", data)
    proxy.clear()
    out = bytearray(len(data))
    view = memoryview(out)
    piece = 64 * 1024
    threads = [
        threading.Thread(target=b.read_range_into, args=("obj", i, view[i : i + piece]))
        for i in range(0, len(data), piece)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == data
    assert len(proxy.requests("GET")) == 32
    assert 1 <= proxy.max_in_flight() <= 3
    b.close()


def _write_creds(path: Path, **fields: object) -> Path:
    path.write_text(json.dumps(fields))
    return path


def test_credentials_file_is_used(rctx: Ctx, tmp_path: Path, bucket_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    creds = _write_creds(
        tmp_path / "reader.json",
        aws_access_key_id="READERKEYID",
        aws_secret_access_key="reader-secret",
        aws_region="us-east-1",
    )
    b = _open_remote(rctx.kind, bucket_name, rctx.proxy, monkeypatch, credentials_file=str(creds))
    b.write("k", b"v")
    assert b.read("k") == b"v"
    assert {r.access_key for r in rctx.proxy.requests()} == {"READERKEYID"}
    b.close()


def test_credentials_file_errors(tmp_path: Path) -> None:
    complete = dict(aws_access_key_id="AK", aws_secret_access_key="s3cr3t-value", aws_region="us-east-1")
    for missing in complete:
        fields = {k: v for k, v in complete.items() if k != missing}
        path = _write_creds(tmp_path / f"no-{missing}.json", **fields)
        with pytest.raises(BucketError) as err:
            open_bucket("s3://bucket/x", credentials_file=str(path))
        assert str(path) in str(err.value) and missing in str(err.value)
        assert "s3cr3t-value" not in str(err.value)

    cases = {
        "absent": tmp_path / "absent.json",
        "directory": tmp_path,
        "not json": tmp_path / "bad.json",
        "not an object": tmp_path / "list.json",
        "empty value": tmp_path / "empty.json",
    }
    cases["not json"].write_text('{"aws_secret_access_key": "s3cr3t-value",')
    cases["not an object"].write_text('["a"]')
    _write_creds(cases["empty value"], **{**complete, "aws_access_key_id": ""})
    for why, path in cases.items():
        with pytest.raises(BucketError) as err:
            open_bucket("gs://bucket/x", credentials_file=str(path))
        message = str(err.value)
        assert str(path) in message, why
        assert "\n" not in message and "s3cr3t-value" not in message, why

    loaded = load_credentials_file(_write_creds(tmp_path / "ok.json", **complete))
    assert (loaded.access_key_id, loaded.region) == ("AK", "us-east-1")
    assert "s3cr3t-value" not in repr(loaded)


def test_gcs_quirks(proxy: S3Proxy, bucket_name: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """gs:// signs for us-east-1, sends no session token and no flexible-checksum headers."""
    monkeypatch.setenv("AWS_SESSION_TOKEN", "an-aws-session-token")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-3")
    b = _open_remote("gs", bucket_name, proxy, monkeypatch, endpoint_url=proxy.url)
    src = tmp_path / "f"
    src.write_bytes(big_random(PART + 10))
    b.write("small", b"data")
    b.write_file("large", src)
    assert b.read("small") == b"data"
    assert b.stat("large").size == PART + 10
    seen = proxy.requests()
    assert seen
    for r in seen:
        assert "x-amz-security-token" not in r.headers
        assert "/us-east-1/s3/aws4_request" in r.headers["authorization"]
        assert not any(h.startswith("x-amz-checksum-") for h in r.headers), r.headers
        assert "x-amz-trailer" not in r.headers
        assert "x-amz-checksum-mode" not in r.headers
    b.close()


def test_gcs_needs_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(BucketError, match="no credentials for gs://bucket/x"):
        open_bucket("gs://bucket/x", endpoint_url="http://127.0.0.1:9")


def test_aws_endpoint_url_env_is_honoured(proxy: S3Proxy, bucket_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    b = open_bucket(f"s3://{bucket_name}")
    b.write("k", b"v")
    assert b.list() == [ObjectInfo("k", 1, b.stat("k").etag)]
    assert proxy.requests("PUT", key="k")
    b.close()


def test_list_pages_and_skips_unusable_keys(
    proxy: S3Proxy, moto_endpoint: str, bucket_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import boto3

    raw = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1")
    keys = [f"run-1/many/{i:04d}" for i in range(1003)]  # over one ListObjectsV2 page of 1000
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda key: raw.put_object(Bucket=bucket_name, Key=key, Body=b""), keys))
    raw.put_object(Bucket=bucket_name, Key="run-1/many/", Body=b"")  # a console "folder"
    raw.put_object(Bucket=bucket_name, Key="run-1/many/../escape", Body=b"x")
    raw.put_object(Bucket=bucket_name, Key="run-10/other", Body=b"x")  # beside our root
    raw.close()
    b = _open_remote("s3", bucket_name, proxy, monkeypatch)
    listed = b.list()
    assert [i.key for i in listed] == [k[len("run-1/") :] for k in keys]
    assert b.stats.snapshot()["list_requests"] == 2
    assert len(proxy.requests("GET")) == 2
    b.close()
