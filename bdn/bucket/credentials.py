"""Reader credentials file: the hosted hot-load flow's ``reader.json``.

Format (JSON object; other fields are ignored)::

    {"aws_access_key_id": "...", "aws_secret_access_key": "...", "aws_region": "us-east-1"}

For ``s3://`` these are IAM access keys and the bucket's region; for ``gs://`` they are a GCS
HMAC key's access id and secret, and the region is ``us-east-1`` (GCS's S3-compatible API signs
with it). Source: Baseten "Deploy RL Rollouts", section "Create deployment secrets".
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from bdn.bucket.base import BucketError

REQUIRED_FIELDS = ("aws_access_key_id", "aws_secret_access_key", "aws_region")

#: A reader.json is a few hundred bytes; refuse anything absurd before parsing it.
_MAX_FILE_BYTES = 64 << 10


@dataclass(frozen=True)
class ReaderCredentials:
    """Static keys from a credentials file. ``repr`` hides the secret."""

    access_key_id: str
    secret_access_key: str
    region: str

    def __repr__(self) -> str:
        return (
            f"ReaderCredentials(access_key_id={self.access_key_id!r}, secret_access_key='***', region={self.region!r})"
        )


def load_credentials_file(path: str | os.PathLike[str]) -> ReaderCredentials:
    """Read and check a ``reader.json``.

    Raises :class:`BucketError` naming the file when it cannot be read, is not a JSON object, or
    lacks one of :data:`REQUIRED_FIELDS` (or has it empty or not a string); the message names the
    field and never contains a secret.
    """
    name = os.fspath(path)
    try:
        with open(name, "rb") as f:
            raw = f.read(_MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise BucketError(f"cannot read credentials file {name!r}: {exc.strerror or type(exc).__name__}") from None
    if len(raw) > _MAX_FILE_BYTES:
        raise BucketError(f"credentials file {name!r} is larger than {_MAX_FILE_BYTES} bytes")
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        # The parser's message may quote the file's text (a secret): give only the position.
        where = f" at line {exc.lineno} column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else ""
        raise BucketError(f"credentials file {name!r} is not valid JSON{where}") from None
    if not isinstance(doc, dict):
        raise BucketError(f"credentials file {name!r} must hold a JSON object")
    values: dict[str, str] = {}
    for field in REQUIRED_FIELDS:
        if field not in doc:
            raise BucketError(f"credentials file {name!r} lacks the field {field!r}")
        value = doc[field]
        if not isinstance(value, str) or not value.strip():
            raise BucketError(f"credentials file {name!r}: field {field!r} must be a non-empty string")
        values[field] = value.strip()
    return ReaderCredentials(
        access_key_id=values["aws_access_key_id"],
        secret_access_key=values["aws_secret_access_key"],
        region=values["aws_region"],
    )
