"""Shared fixtures: a real moto S3 server for the session, fresh buckets, a tmpfs directory."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
os.environ.pop("AWS_PROFILE", None)


# The files whose tests take longest (the suite's --durations on an idle 2-core machine), longest
# first. `make test` runs pytest-xdist with --dist loadfile, which hands files out in collection
# order: a long file collected last (they are late in the alphabet) leaves the other worker idle
# for its whole length at the end. Collected first, they overlap with everything else.
SLOW_FIRST = (
    "test_swarm_take_attack.py",
    "test_soak_short.py",
    "test_fetch_bad_sources.py",
    "test_wire_daemon.py",
    "test_adversarial_bucket.py",
    "test_huge_inputs.py",
    "test_adversarial_cut_through.py",
    "test_readiness_problems.py",
    "test_control_plane.py",
    "test_publish_sharded.py",
    "test_engines_hf.py",
    "test_adversarial_localapi.py",
    "test_adversarial_http.py",
    "test_swarm_steal.py",
    "test_trl.py",
    "test_memory_bounds.py",
    "test_engine_stale.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Put the tests of :data:`SLOW_FIRST` first, in its order; the rest keep theirs (stable sort)."""
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(scope="session")
def moto_endpoint():
    """A real S3 API server process (moto) on a loopback port, for the whole session."""
    from support.s3server import start_moto_server, stop_moto_server

    proc, url = start_moto_server()
    yield url
    stop_moto_server(proc)


@pytest.fixture
def s3_bucket(moto_endpoint):
    """A fresh bucket on the moto server: returns ``(s3_url_with_prefix, endpoint_url)``."""
    from support.s3server import create_bucket

    name = create_bucket(moto_endpoint)
    return f"s3://{name}/run1", moto_endpoint


@pytest.fixture
def shm():
    """A fresh directory on tmpfs (/dev/shm, else the temp dir), removed after the test."""
    from support.transfer import shm_tmpdir

    d = shm_tmpdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


# Hypothesis times each example (a 200 ms deadline) and fails a test whose inputs are slow to
# generate: wall-clock windows that failed test_proto_identity at load 35 (341 ms for one
# example, 9 inputs in 1.5 s). The properties are about results, not speed: no deadline, no
# too_slow health check, the same examples.
try:
    from hypothesis import HealthCheck, settings

    settings.register_profile("bdn", deadline=None, suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile("bdn")
except ImportError:  # hypothesis is in the test extra; without it the property tests skip
    pass
