"""The last step of a publish: the snapshot's manifest, written once every object is stored (its
presence is what publishes the snapshot), and the refusal to publish an identity twice.

Two publishers of one identity at once (two ``commit_step`` calls of a sharded step, two
``publish_full`` of one step, a retry while the first still runs) are told apart by the bucket's
conditional write (:meth:`bdn.bucket.Bucket.write_new`): the manifest is created only if absent,
and a publish first creates its claim ``.bdn-parts/<identity>/commit.json`` (:func:`claimed`),
so only the claim's holder writes the snapshot's objects and manifest: a loser's bytes never
land under the winner's manifest.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bdn.bucket import Bucket, ObjectNotFound
from bdn.proto.chunks import digest
from bdn.proto.manifest import MANIFEST_NAME, FileEntry, Manifest
from bdn.proto.parts import PARTS_DIR
from bdn.publish.errors import PublishError

#: The checksum format of every delta bdn writes, spelled as the hosted hot-load APIs spell it.
CHECKSUM_FORMAT = "alder32"


def now() -> str:
    """The current UTC time as RFC 3339 with seconds (``2026-12-01T14:22:25Z``), the manifest's ``published_at``."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def refuse_published(b: Bucket, identity: str, overwrite: bool) -> None:
    """Raise PublishError if ``identity``'s manifest is already in bucket ``b``, unless ``overwrite``."""
    if overwrite:
        return
    try:
        b.stat(f"{identity}/{MANIFEST_NAME}")
    except ObjectNotFound:
        return
    raise PublishError(
        f"snapshot {identity!r} is already published ({identity}/{MANIFEST_NAME} exists); "
        "choose a new identity, or overwrite it (--overwrite, overwrite=True)"
    )


def commit(
    b: Bucket,
    identity: str,
    policy_version: int,
    chunk_size: int,
    entries: list[FileEntry],
    overwrite: bool,
    *,
    delta_of: tuple[str, str] | None = None,
) -> Manifest:
    """Build the snapshot's manifest and write it: the last object, whose presence publishes it.

    ``delta_of`` is ``(base identity, compression format)`` for a delta, None for a full
    snapshot; ``chunk_size`` in bytes, the one ``entries`` were cut with. Returns the manifest
    written. Raises PublishError if ``identity`` is already published (unless ``overwrite``),
    ManifestError if the manifest breaks a rule of ``bdn.snapshot/1``, BucketError from the write.
    """
    base, fmt = delta_of if delta_of is not None else (None, None)
    manifest = Manifest(
        identity=identity,
        kind="full" if delta_of is None else "delta",
        policy_version=policy_version,
        chunk_size=chunk_size,
        files=tuple(entries),
        created_at=now(),
        base_identity=base,
        compression_format=fmt,
        checksum_format=None if delta_of is None else CHECKSUM_FORMAT,
    )
    data = manifest.to_json()
    # Re-parse what we are about to publish: daemons will hold it to the same rules.
    Manifest.from_json(data, expect_identity=manifest.identity)
    key = f"{manifest.identity}/{MANIFEST_NAME}"
    if overwrite:
        b.write(key, data)
    elif not b.write_new(key, data):  # another publisher committed the same identity meanwhile
        refuse_published(b, manifest.identity, overwrite)
        raise PublishError(f"snapshot {identity!r} was published by another publisher meanwhile")
    return manifest


def claim_key(identity: str) -> str:
    """The bucket key of a commit's claim on ``identity``."""
    return f"{PARTS_DIR}/{identity}/commit.json"


#: A claim is a few hundred bytes; a bigger object at the claim's key is not one (read no further).
MAX_CLAIM_BYTES = 4096
#: Tokens of the claims this process holds now (a claim naming this process but no token here is
#: one its earlier, failed publish left).
_ACTIVE: set[str] = set()
_ACTIVE_LOCK = threading.Lock()


@contextlib.contextmanager
def claimed(b: Bucket, identity: str, overwrite: bool) -> Iterator[None]:
    """Hold the claim on ``identity`` (:func:`claim_commit`) for the ``with`` body, the publish's
    writes. A body that raises marks the claim released, so that a retry from any host takes it
    over; a process killed meanwhile leaves it (taken over from the same host, see
    :func:`claim_commit`)."""
    token = claim_commit(b, identity, overwrite)
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):  # the bucket may be what failed: the claim then stays
            held = _parse_claim(_read_claim(b, claim_key(identity)) or b"")
            if held is not None and held.get("token") == token:  # not one an overwrite took since
                b.write(claim_key(identity), json.dumps({"released": token}).encode())
        raise
    finally:
        with _ACTIVE_LOCK:
            _ACTIVE.discard(token)


def claim_commit(b: Bucket, identity: str, overwrite: bool) -> str:
    """Become the one publisher of ``identity``: create its claim ``.bdn-parts/<identity>/commit.json``
    (JSON: host, pid, start time, the process's boot and start tick, a random token) if absent, and
    return the token. With ``overwrite`` the claim is written unconditionally.

    A claim that no commit holds any more is taken over: one released by a publish that failed,
    or one of this host whose process no longer runs (a pid reused by another process does not
    count as the holder: its start tick differs). Of several publishers taking one claim over at
    once exactly one wins: each first creates ``commit.takeover-<digest of the old claim>.json``
    with :meth:`~bdn.bucket.Bucket.write_new`.

    Raises PublishError naming the holder when another commit holds the claim (one that may
    have died on another host: then commit again with ``overwrite=True``), or when the object at
    the claim's key is not a claim (larger than ``MAX_CLAIM_BYTES``, not JSON).
    """
    key = claim_key(identity)
    token = uuid.uuid4().hex
    body = json.dumps(
        {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "proc": _proc_id(os.getpid()),
            "started": now(),
            "token": token,
        }
    ).encode()
    with _ACTIVE_LOCK:
        _ACTIVE.add(token)
    try:
        if overwrite:
            b.write(key, body)
            return token
        if b.write_new(key, body):
            return token
        old = _read_claim(b, key)
        if old is None:  # the holder's claim went away (an overwrite?): try once more
            if b.write_new(key, body):
                return token
            old = _read_claim(b, key) or b""
        held = _parse_claim(old)
        if held is None:
            refuse_published(b, identity, overwrite)
            size = f"more than {MAX_CLAIM_BYTES}" if len(old) > MAX_CLAIM_BYTES else str(len(old))
            raise PublishError(
                f"step {identity!r}: {key} is not a bdn claim ({size} bytes, not a claim's JSON); "
                "if no other publish of it runs, publish again with overwrite=True"
            )
        if not _holder_alive(held):
            refuse_published(b, identity, overwrite)  # a holder that ended may have published it
            takeover = f"{PARTS_DIR}/{identity}/commit.takeover-{digest(old)[:16]}.json"
            if b.write_new(takeover, body):
                b.write(key, body)
                return token
            held = {"host": "?", "pid": 0, "started": f"the take-over {takeover}"}
        refuse_published(b, identity, overwrite)
        raise PublishError(
            f"step {identity!r} is being committed by another publisher ({held.get('host', '?')} pid "
            f"{held.get('pid', 0)}, since {held.get('started', '?')}; claim {key}); "
            "if that commit died, commit again with overwrite=True"
        )
    except BaseException:
        with _ACTIVE_LOCK:
            _ACTIVE.discard(token)
        raise


def _read_claim(b: Bucket, key: str) -> bytes | None:
    """The claim's bytes (None when it is gone); a larger object is returned as its first bytes
    plus one, which no claim parses."""
    try:
        info = b.stat(key)
        if info.size > MAX_CLAIM_BYTES:
            return b"\0" * (MAX_CLAIM_BYTES + 1)
        return b.read(key, MAX_CLAIM_BYTES)
    except ObjectNotFound:
        return None


def _parse_claim(data: bytes) -> dict[str, Any] | None:
    """The claim's fields (``host``, ``pid``, ``proc``, ``started``, ``token``, or ``released``), None when it is not one."""
    try:
        held = json.loads(data)
    except ValueError:
        return None
    if not isinstance(held, dict):
        return None
    if isinstance(held.get("released"), str):
        return held
    if not (
        isinstance(held.get("host"), str) and isinstance(held.get("pid"), int) and not isinstance(held["pid"], bool)
    ):
        return None
    return held


def _holder_alive(held: dict[str, Any]) -> bool:
    """Whether the claim may belong to a commit still running: True unless it was released, or it
    names a process of this host that no longer runs (or a pid now another process's, told by
    its start tick), or this process itself without a commit of it in progress."""
    if "released" in held:
        return False
    if held["host"] != socket.gethostname():
        return True
    pid, proc = held["pid"], held.get("proc")
    if pid <= 0:
        return True  # not a pid of a process: nothing can be told
    if pid == os.getpid() and (proc is None or proc == _proc_id(pid)):
        with _ACTIVE_LOCK:
            return held.get("token") in _ACTIVE
    if not _alive(pid):
        return False
    return proc is None or _proc_id(pid) in (None, proc)


def _proc_id(pid: int) -> str | None:
    """``<boot id>:<start tick>`` of process ``pid`` (proc(5): ``/proc/sys/kernel/random/boot_id``,
    field 22 of ``/proc/<pid>/stat``), which tells it from a later process given the same pid;
    None where /proc does not say."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        stat = Path(f"/proc/{pid}/stat").read_text()
        return f"{boot}:{stat.rpartition(')')[2].split()[19]}"
    except (OSError, IndexError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
