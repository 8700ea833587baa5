"""The origin object store ("bucket") behind one small interface: file://, s3:// and gs://.

Use :func:`open_bucket`; every backend raises only the errors exported here (and
:class:`bdn.proto.errors.PathError` for a bad key).
"""

from bdn.bucket.base import (
    AccessDenied,
    Bucket,
    BucketError,
    BucketStats,
    BucketUnavailable,
    ObjectChanged,
    ObjectChecksum,
    ObjectInfo,
    ObjectNotFound,
    SdkChecksum,
    validate_key,
    validate_prefix,
)
from bdn.bucket.credentials import ReaderCredentials, load_credentials_file
from bdn.bucket.urls import open_bucket

__all__ = [
    "AccessDenied",
    "Bucket",
    "BucketError",
    "BucketStats",
    "BucketUnavailable",
    "ObjectChanged",
    "ObjectChecksum",
    "ObjectInfo",
    "ObjectNotFound",
    "ReaderCredentials",
    "SdkChecksum",
    "load_credentials_file",
    "open_bucket",
    "validate_key",
    "validate_prefix",
]
