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


def pytest_configure(config: pytest.Config) -> None:
    """On the xdist controller (or a plain run), before any worker starts: compile the sparse
    kernel (bdn.proto.sparse_kernel, numba ``cache=True``) into numba's on-disk cache once. On a
    fresh clone each daemon that applied a delta first otherwise compiled it for itself, several
    at once (8.7 s CPU each; loading it cached is ~1 s)."""
    if hasattr(config, "workerinput"):
        return
    from bdn.proto import sparse_kernel

    sparse_kernel.warm()


# `make test` runs files on four xdist workers (-n 4), a file at a time (--dist loadfile), in the order
# the collection gives them (--no-loadscope-reorder; xdist's default order, most tests first, put
# the single-test files that take minutes last, where one worker ran them on while the others
# had nothing left). The slowest files go first, the longest first (largest-first scheduling),
# so the short ones fill in at the end; every other file keeps its place after them. The list is
# the files of 30 s or more in the slowest 60 tests of a `pytest -n 3 --dist loadfile
# --durations=60` run at load ~12 on 2 cores (summed per file, largest first); a stale entry
# only costs balance, never a result (tests/test_suite_order.py checks the files exist).
SLOW_FILES_FIRST = (
    "tests/test_adversarial_seed.py",
    "tests/test_foreign_daemon.py",
    "tests/test_soak_short.py",
    "tests/test_engines_hf.py",
    "tests/test_adversarial_cut_through.py",
    "tests/test_faults.py",
    "tests/test_swarm_take_attack.py",
    "tests/test_publish_sharded.py",
    "tests/test_cli.py",
    "tests/test_engine.py",
    "tests/test_huge_inputs.py",
    "tests/test_memory_bounds.py",
    "tests/test_trl.py",
    "tests/test_fetch_bad_sources.py",
    "tests/test_adversarial_catch_up.py",
    "tests/test_adversarial_bucket.py",
    "tests/test_sparse_apply.py",
    "tests/test_bad_input.py",
    "tests/test_wire_daemon.py",
    "tests/test_adversarial_slow_readers.py",
    "tests/test_swarm_steal.py",
    "tests/test_integrity.py",
    "tests/test_control_plane.py",
    "tests/test_index.py",
    "tests/test_soak_objprobe.py",
    "tests/test_adversarial_publish.py",
    "tests/test_adversarial_repair.py",
    "tests/test_engine_stale.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put the tests of ``SLOW_FILES_FIRST`` first, in its order; the sort is stable, so the tests
    of a file keep their order and the other files theirs."""
    first = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: first.get(item.nodeid.split("::", 1)[0], len(first)))
