"""bdn.foreign.checksum and bdn.foreign.ready without a bucket server: the checksum math (S3 MD5,
multipart composite, GCS CRC-32C), certified part lists, and the check before READY; plus a
file:// repair. tests/test_foreign_bucket.py runs the same against moto with real uploads."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import google_crc32c
import numpy as np
import pytest

from bdn.bucket import ObjectChecksum, open_bucket
from bdn.bucket.base import SdkChecksum
from bdn.bucket.checksums import object_checksum, sdk_checksum
from bdn.fileops import save
from bdn.foreign import read_checksums, read_foreign_table
from bdn.foreign.checksum import (
    Part,
    certify_part_md5s,
    crc32c,
    part_ranges,
    verify_object,
)
from bdn.foreign.ready import check_header, check_ready
from bdn.foreign.repair import repair_from_bucket
from bdn.proto.errors import ChecksumError
from bdn.proto.foreign import ForeignSnapshotError

PART = 64 << 10


def multipart_checksum(data: bytes, part: int) -> ObjectChecksum:
    parts = [data[i : i + part] for i in range(0, len(data), part)]
    composite = hashlib.md5(b"".join(hashlib.md5(p).digest() for p in parts)).hexdigest()
    return ObjectChecksum(
        key="s/m",
        etag=f"{composite}-{len(parts)}",
        size=len(data),
        parts=len(parts),
        part_size=part,
        composite_md5=composite,
    )


def test_part_ranges() -> None:
    assert part_ranges(10, 4, 3) == (Part(0, 0, 4), Part(1, 4, 4), Part(2, 8, 2))
    assert part_ranges(8, 4, 2)[-1] == Part(1, 4, 4)
    with pytest.raises(ChecksumError, match="has 3 equal parts, but its ETag names 2: its parts have several sizes"):
        part_ranges(10, 4, 2)
    with pytest.raises(ChecksumError):
        part_ranges(10, 0, 1)


def test_multipart_verdicts_and_certified_lists() -> None:
    data = os.urandom(3 * PART + 100)
    cs = multipart_checksum(data, PART)
    good = verify_object(data, cs, workers=3)
    assert good.ok and good.method == "multipart-md5" and len(good.part_md5s) == 4
    assert certify_part_md5s(good.part_md5s, cs)
    assert not certify_part_md5s(good.part_md5s[:3], cs)
    assert not certify_part_md5s(["zz"] * 4, cs)
    bad = bytearray(data)
    bad[3 * PART + 5] ^= 1
    v = verify_object(bad, cs)
    assert v.status == "bad" and v.bad_parts is None
    v = verify_object(bad, cs, certified_parts=good.part_md5s)
    assert v.bad_parts == (3,) and f"part 4 (bytes {3 * PART}-{3 * PART + 99})" in v.reason
    with pytest.raises(ValueError, match="buffer has"):
        verify_object(data[:-1], cs)
    # A numpy buffer (what the daemon maps) works the same.
    assert verify_object(np.frombuffer(data, dtype=np.uint8), cs).ok


def test_single_part_md5_and_crc32c_and_nothing() -> None:
    data = os.urandom(100_000)
    md5 = ObjectChecksum(key="k", etag="e", size=len(data), md5=hashlib.md5(data).hexdigest())
    assert verify_object(data, md5).ok
    crc = ObjectChecksum(key="k", etag="e", size=len(data), crc32c=google_crc32c.value(data))
    assert crc32c(data) == crc.crc32c
    assert verify_object(bytearray(data), crc).method == "crc32c" and verify_object(data, crc).ok
    flipped = bytearray(data)
    flipped[0] ^= 4
    assert verify_object(flipped, md5).bad_parts == (0,)
    v = verify_object(flipped, crc)
    assert v.status == "bad" and "CRC-32C" in v.reason
    none = ObjectChecksum(key="k", etag="e", size=len(data))
    v = verify_object(data, none)
    assert (v.status, v.method, v.ok) == ("unverifiable", "none", False)


def test_multipart_additional_checksum_comes_from_the_object_head() -> None:
    """S3 answers a HEAD with PartNumber with that *part's* checksum: the object's own additional
    checksum is read from a HEAD without one (the suite's first failure on moto 5.2.6, where a
    good multipart object was called bad because part 1's CRC32 was taken for the object's)."""
    import base64
    import zlib

    data = os.urandom(3 * PART + 100)
    parts = [data[i : i + PART] for i in range(0, len(data), PART)]
    crcs = [zlib.crc32(p).to_bytes(4, "big") for p in parts]
    composite = base64.b64encode(zlib.crc32(b"".join(crcs)).to_bytes(4, "big")).decode()
    md5 = multipart_checksum(data, PART).composite_md5
    asked: list[tuple[int | None, bool]] = []

    def head(part: int | None, checksums: bool) -> tuple[int, dict[str, str]]:
        asked.append((part, checksums))
        if part is None:
            return len(data), {"x-amz-checksum-crc32": composite, "x-amz-mp-parts-count": "4"}
        part_crc = base64.b64encode(crcs[part - 1]).decode()
        return len(parts[part - 1]), {
            "x-amz-checksum-crc32": part_crc,
            "x-amz-checksum-type": "COMPOSITE",
            "x-amz-mp-parts-count": "4",
        }

    from bdn.bucket.base import ObjectInfo

    info = ObjectInfo(key="s/m", size=len(data), etag=f"{md5}-4")
    cs = object_checksum("s/m", f"{md5}-4", head=head, stat=lambda: info, gcs=False, where="s/m")
    assert (None, True) in asked and (1, True) not in asked
    assert cs.sdk_checksum == SdkChecksum("crc32", base64.b64decode(composite), composite=True, typed=False)
    import dataclasses

    v = verify_object(data, dataclasses.replace(cs, composite_md5=None))
    assert v.ok and v.method == "crc32-composite"


def test_untyped_multipart_checksum_is_tried_whole_too_and_never_calls_a_good_object_bad() -> None:
    """A store that leaves ``x-amz-checksum-type`` out of a multipart object's HEAD: composite is
    S3's default, but a full-object checksum (FULL_OBJECT uploads) must verify as well."""
    import base64
    import zlib

    data = os.urandom(2 * PART + 7)
    whole = base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()
    untyped = sdk_checksum({"x-amz-checksum-crc32": whole}, True)
    typed = sdk_checksum({"x-amz-checksum-crc32": whole, "x-amz-checksum-type": "COMPOSITE"}, True)
    assert untyped is not None and untyped.composite and not untyped.typed
    assert typed is not None and typed.composite and typed.typed
    base = ObjectChecksum(key="k", etag="e-3", size=len(data), parts=3, part_size=PART)
    import dataclasses

    assert verify_object(data, dataclasses.replace(base, sdk_checksum=untyped)).ok
    flipped = bytearray(data)
    flipped[PART + 1] ^= 1
    assert verify_object(flipped, dataclasses.replace(base, sdk_checksum=untyped)).status == "bad"
    # Typed COMPOSITE: the full-object value is not a composite one, and that is reported bad.
    assert verify_object(data, dataclasses.replace(base, sdk_checksum=typed)).status == "bad"


def test_file_bucket_table_has_no_checksums_and_repairs_by_rereading(tmp_path: Path) -> None:
    root = tmp_path / "bucket"
    (root / "s1").mkdir(parents=True)
    save(root / "s1" / "model.safetensors", {"w": np.arange(50_000, dtype=np.float32)}, {"format": "pt"})
    (root / "s1" / "config.json").write_text("{}")
    bucket = open_bucket(f"file://{root}")
    table = read_foreign_table(bucket, "s1", chunk_size=4096, policy_version=1)
    checksums = read_checksums(bucket, table)
    assert set(checksums) == {"config.json", "model.safetensors"}
    assert not any(c.verifiable for c in checksums.values())
    # Given a checksum from elsewhere (say, the trainer's), a bad copy is repaired from file://.
    data = (root / "s1" / "model.safetensors").read_bytes()
    cs = ObjectChecksum(
        key="s1/model.safetensors",
        etag=table.object("model.safetensors").etag,
        size=len(data),
        md5=hashlib.md5(data).hexdigest(),
    )
    copy = bytearray(data)
    copy[10_000] ^= 0xFF
    fixed = repair_from_bucket(bucket, cs, copy, verify_object(copy, cs), chunk_size=4096)
    assert fixed.bad_ranges == ((8192, 4096),) and bytes(copy) == data


def test_check_header(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save(path, {"w": np.zeros(4, dtype=np.float32)})
    check_header(path)  # bdn's parser, then the safetensors library's safe_open
    path.write_bytes(path.read_bytes() + b"\0")  # a byte no tensor covers
    with pytest.raises(ForeignSnapshotError, match="m.safetensors: safetensors tensors end at byte"):
        check_header(path)
    path.write_bytes(b"\xff" * 8 + b"{}")
    with pytest.raises(ForeignSnapshotError, match="over the 100000000-byte limit"):
        check_header(path)


def test_check_ready_needs_a_verdict_for_every_object(tmp_path: Path) -> None:
    root = tmp_path / "bucket"
    (root / "s1").mkdir(parents=True)
    (root / "s1" / "a.txt").write_text("hello")
    bucket = open_bucket(f"file://{root}")
    table = read_foreign_table(bucket, "s1", chunk_size=4096, policy_version=1)
    staged = tmp_path / "staged"
    staged.mkdir()
    (staged / "a.txt").write_text("hello")
    cs = read_checksums(bucket, table)["a.txt"]
    verdicts = {"a.txt": verify_object(b"hello", cs)}
    with pytest.raises(
        ForeignSnapshotError,
        match="the bucket keeps no checksum of this object, and unverifiable objects are not accepted",
    ):
        check_ready(table, staged, verdicts)
    check_ready(table, staged, verdicts, allow_unverifiable=True)
    (staged / "a.txt").unlink()
    with pytest.raises(ForeignSnapshotError, match="a.txt is missing from the staged snapshot"):
        check_ready(table, staged, verdicts, allow_unverifiable=True)


def test_verify_or_repair_and_bad_chunks(tmp_path: Path) -> None:
    from bdn.foreign.repair import bad_chunks, verify_or_repair

    root = tmp_path / "bucket"
    (root / "s1").mkdir(parents=True)
    data = os.urandom(5 * PART + 7)
    (root / "s1" / "blob").write_bytes(data)
    bucket = open_bucket(f"file://{root}")
    table = read_foreign_table(bucket, "s1", chunk_size=4096, policy_version=1)
    cs = multipart_checksum(data, PART)
    cs = ObjectChecksum(
        key="s1/blob",
        etag=table.object("blob").etag,
        size=cs.size,
        parts=cs.parts,
        part_size=cs.part_size,
        composite_md5=cs.composite_md5,
    )
    verdict, repair = verify_or_repair(bucket, cs, bytearray(data), chunk_size=4096)
    assert verdict.ok and repair is None
    copy = bytearray(data)
    copy[PART + 1] ^= 1
    copy[4 * PART + 4096 * 3] ^= 1
    verdict, repair = verify_or_repair(bucket, cs, copy, chunk_size=4096)
    assert verdict.status == "bad" and repair is not None and bytes(copy) == data
    assert bad_chunks(repair.bad_ranges, 4096) == [PART // 4096, 4 * PART // 4096 + 3]
    assert bad_chunks([(4095, 2)], 4096) == [0, 1]
