"""Baseline (b): what a user does without bdn, on one node.

Downloads the snapshot's files from the bucket with boto3's transfer manager (parallel ranged GETs
across and within files, as ``aws s3 cp --recursive`` does), then verifies every 16 MiB chunk
against the known xxh3-128 digests. Prints one JSON line: start/end wall-clock times and bytes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config as BotoConfig
from s3transfer.manager import TransferManager

from bench.swarm.snapshot import CHUNK, chunk_digests


def fetch(endpoint: str, bucket: str, prefix: str, names: list[str], out: Path, concurrency: int) -> int:
    """Download ``prefix/name`` for every name into ``out``; return the bytes received."""
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        config=BotoConfig(max_pool_connections=concurrency + 4, retries={"max_attempts": 10}),
    )
    cfg = TransferConfig(
        multipart_threshold=CHUNK, multipart_chunksize=CHUNK, max_concurrency=concurrency, use_threads=True
    )
    out.mkdir(parents=True, exist_ok=True)
    with TransferManager(client, cfg) as tm:
        futs = [tm.download(bucket, f"{prefix}/{n}", str(out / n)) for n in names]
        for f in futs:
            f.result()
    return sum((out / n).stat().st_size for n in names)


def verify(out: Path, digests: dict[str, list[str]]) -> None:
    for name, want in digests.items():
        got = chunk_digests(out / name)
        if got != want:
            raise SystemExit(f"s3get: {name}: chunk digests differ from the snapshot's")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--bucket", required=True)
    ap.add_argument("--prefix", required=True)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--digests", required=True, type=Path, help="JSON {name: [xxh3 hex per chunk]}")
    ap.add_argument("--concurrency", type=int, default=10)
    ap.add_argument("--no-verify", action="store_true")
    a = ap.parse_args()
    digests = json.loads(a.digests.read_text())
    t0 = time.time()
    n = fetch(a.endpoint, a.bucket, a.prefix, list(digests), a.out, a.concurrency)
    t1 = time.time()
    if not a.no_verify:
        verify(a.out, digests)
    t2 = time.time()
    print(json.dumps({"start": t0, "fetched": t1, "done": t2, "bytes": n}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
