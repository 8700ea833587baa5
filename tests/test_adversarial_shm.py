"""Attacks on a ready snapshot's files in the shm_dir, changed behind the daemon's back (an engine's
bug, an operator's mistake, a hostile local process): a READY file truncated, deleted, or replaced
by a symlink to a file outside the store. On real bdnd processes.

What must hold: the local API never hands out bytes that are not the snapshot's (a truncated file
is no complete answer, a symlink's target is never served), every such answer is a status and one
line, a peer fetching from the damaged daemon still ends with the right bytes, the daemon keeps
serving the rest, and a repair brings the files back without writing through a symlink.
"""

from __future__ import annotations

import http.client
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from bdn.publish import publish_full
from support.api import wait_for
from support.checkpoints import make_state, write_hf_dir
from support.swarm import Daemon, Swarm, running

pytestmark = pytest.mark.timeout(300)
IDENT = "step000001"
CHUNK = 64 << 10
BIG = "model-00001-of-00002.safetensors"
SMALL = "model-00002-of-00002.safetensors"


@pytest.fixture()
def published(tmp_path: Path) -> tuple[str, Path]:
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    ck = write_hf_dir(tmp_path / "trainer", make_state(0, scale=4), 1)
    publish_full(f"file://{bucket}", IDENT, 1, dir=ck, chunk_size=CHUNK)
    return f"file://{bucket}", ck


@pytest.fixture()
def ready(tmp_path: Path, published: tuple[str, Path]) -> Iterator[tuple[Daemon, Path]]:
    url, ck = published
    with running(Daemon(tmp_path / "nodes", "node0", url, extra_env={"BDN_LOAD_STARTUP": "false"})) as d:
        assert d.prefetch(IDENT)[0] == 202
        d.wait_ready(IDENT)
        yield d, ck


def pull(d: Daemon, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes | None]:
    """``(status, body)``; body None when the daemon cut the answer short (a short body must
    never look complete)."""
    conn = http.client.HTTPConnection("127.0.0.1", d.local_port, timeout=60)
    try:
        conn.request("GET", path, headers=headers or {})
        r = conn.getresponse()
        try:
            return r.status, r.read()
        except http.client.IncompleteRead:
            return r.status, None
    except (ConnectionError, http.client.RemoteDisconnected):
        return 0, None
    finally:
        conn.close()


def writable(p: Path) -> None:
    os.chmod(p, 0o644)  # ready files are 0444; as root this is no obstacle anyway


def assert_still_serves(d: Daemon, ck: Path, name: str) -> None:
    assert d.get("/v1/health")["status"] == "ok"
    st, body = pull(d, f"/v1/snapshots/{IDENT}/files/{name}")
    assert st == 200 and body == (ck / name).read_bytes(), (name, st)


def test_a_truncated_ready_file_is_never_served_as_complete(ready: tuple[Daemon, Path]) -> None:
    """Truncated to half: the whole file and a range past the cut. Before the fix the daemon
    answered 200 with the half file (Content-Length from the file on disk, not the manifest):
    an engine got a short checkpoint that looked complete."""
    d, ck = ready
    f = d.store / IDENT / BIG
    want = (ck / BIG).read_bytes()
    writable(f)
    os.truncate(f, len(want) // 2)
    for headers in ({}, {"Range": f"bytes={len(want) // 2 - 10}-{len(want) // 2 + 10}"}, {"Range": "bytes=-100"}):
        st, body = pull(d, f"/v1/snapshots/{IDENT}/files/{BIG}", headers)
        assert body is None or st >= 400, (headers, st, len(body or b""))
        if st >= 400:
            assert b"\n" not in (body or b"").strip() and b"Traceback" not in (body or b""), body
    # a tensor wholly past the cut: never a body that looks whole
    st, body = pull(d, f"/v1/snapshots/{IDENT}/tensors/layers.0.mlp.down.weight")
    assert body is None or st >= 400, (st, len(body or b""))
    assert_still_serves(d, ck, SMALL)
    # a repair puts the missing half back (before the fix of bdn/daemon/fetch/targets.py and
    # Store.unpublish it wrote into a stale mapping, or past the end of the shorter file)
    status, rep = d.request("POST", f"/v1/snapshots/{IDENT}/repair")
    assert status == 200 and rep["corrupted"], rep
    d.wait_ready(IDENT)
    assert_still_serves(d, ck, BIG)
    assert "Traceback" not in d.log(), d.log()


def test_a_ready_file_replaced_by_a_symlink_is_not_followed(ready: tuple[Daemon, Path], tmp_path: Path) -> None:
    """The shard replaced by a symlink to a file outside the store (``/etc/passwd`` in the attack
    idea; a decoy of the same size here, so no size check alone saves the day). Before the fix the
    local API served the decoy's bytes as the shard."""
    d, ck = ready
    want = (ck / SMALL).read_bytes()
    decoy = tmp_path / "decoy"
    decoy.write_bytes(b"S" * len(want))
    f = d.store / IDENT / SMALL
    f.unlink()
    f.symlink_to(decoy)
    st, body = pull(d, f"/v1/snapshots/{IDENT}/files/{SMALL}")
    assert body is None or (st >= 400 and b"S" * 64 not in body), (st, (body or b"")[:200])
    st, body = pull(d, f"/v1/snapshots/{IDENT}/tensors/position_ids")
    assert body is None or (st >= 400 and b"S" * 64 not in body), (st, (body or b"")[:200])
    assert_still_serves(d, ck, BIG)
    # a repair finds the chunks bad and fetches them again: never through the symlink
    status, rep = d.request("POST", f"/v1/snapshots/{IDENT}/repair")
    assert status == 200, rep
    d.wait_ready(IDENT)
    assert decoy.read_bytes() == b"S" * len(want), "the repair wrote through the symlink"
    assert not f.is_symlink() and f.read_bytes() == want
    assert_still_serves(d, ck, SMALL)


def test_a_deleted_ready_file_is_404_and_the_rest_is_served(ready: tuple[Daemon, Path]) -> None:
    d, ck = ready
    (d.store / IDENT / SMALL).unlink()
    st, body = pull(d, f"/v1/snapshots/{IDENT}/files/{SMALL}")
    assert st == 404 and body is not None and b"Traceback" not in body, (st, body)
    assert_still_serves(d, ck, BIG)
    status, rep = d.request("POST", f"/v1/snapshots/{IDENT}/repair")
    assert status == 200 and rep["corrupted"], rep
    d.wait_ready(IDENT)
    assert_still_serves(d, ck, SMALL)


def test_a_peer_fetching_from_a_daemon_whose_files_were_damaged_gets_the_right_bytes(
    tmp_path: Path, published: tuple[str, Path]
) -> None:
    """node0 holds the snapshot ready, then its big shard is truncated and its small one replaced
    by a symlink to a decoy of the same size; node1 then loads the snapshot (node0 owns about
    half of the chunks, and its have-bitfield lists them all): node1's files are the trainer's."""
    url, ck = published
    decoy = tmp_path / "decoy"
    decoy.write_bytes(b"S" * (ck / SMALL).stat().st_size)
    with Swarm(tmp_path / "nodes", 2, url, extra_env={"BDN_LOAD_STARTUP": "false", "BDN_PENALTY_S": "5"}) as s:
        node0, node1 = s.daemons
        assert node0.prefetch(IDENT)[0] == 202
        node0.wait_ready(IDENT)
        big = node0.store / IDENT / BIG
        writable(big)
        os.truncate(big, big.stat().st_size // 3)
        small = node0.store / IDENT / SMALL
        small.unlink()
        small.symlink_to(decoy)
        assert node1.prefetch(IDENT)[0] == 202
        got = Path(node1.wait_ready(IDENT)["path"])
        for name in (BIG, SMALL):
            assert (got / name).read_bytes() == (ck / name).read_bytes(), name
        assert node0.get("/v1/health")["status"] == "ok"
        assert decoy.read_bytes() == b"S" * len(decoy.read_bytes())


def test_shm_filled_to_enospc_while_downloading(tmp_path: Path, published: tuple[str, Path]) -> None:
    """The tmpfs under shm_dir filled by another process (a file written until ENOSPC) once the
    download started. The snapshot's space was reserved up front, so it must still end ready and
    identical, or failed with one line; never a READY snapshot with wrong bytes, and the daemon
    keeps answering. Once the filler is gone a new prefetch (if it failed) loads it."""
    from support.faults import small_tmpfs

    url, ck = published
    with small_tmpfs(tmp_path / "tmpfs", 8 << 20) as mnt:
        env = {
            "BDN_LOAD_STARTUP": "false",
            "BDN_SHM_DIR": str(mnt),
            "BDN_BUCKET_MBIT": "4",
            "BDN_PROGRESS_INTERVAL_S": "0.2",
        }
        d = Daemon(tmp_path / "nodes", "node0", url, extra_env=env)
        d.shm_dir = mnt
        with running(d):
            assert d.prefetch(IDENT)[0] == 202
            wait_for(
                lambda: (r := d.get(f"/v1/snapshots/{IDENT}"))["state"] != "queued" and r.get("bytes_total"),
                120,
                "the download to start",
            )
            filler = mnt / "filler"
            with open(filler, "wb") as fh:
                try:
                    while True:
                        fh.write(b"F" * (64 << 10))
                        fh.flush()
                except OSError:
                    pass
            rec = d.wait_settled(IDENT, 120)
            assert d.get("/v1/health")["status"] == "ok"
            if rec["state"] == "ready":
                got = Path(rec["path"])
                for f in ck.iterdir():
                    assert (got / f.name).read_bytes() == f.read_bytes(), f.name
            else:
                assert rec["reason"] and "\n" not in rec["reason"], rec
                assert not (d.store / IDENT).exists()
                filler.unlink()
                assert d.prefetch(IDENT)[0] == 202
                got = Path(d.wait_ready(IDENT)["path"])
                for f in ck.iterdir():
                    assert (got / f.name).read_bytes() == f.read_bytes(), f.name
            assert "Traceback" not in d.log(), d.log()
