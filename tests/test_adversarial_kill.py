"""kill -9 of a real bdnd in the middle of a local pull by an engine and of serving chunks to a
peer (the other phases: tests/test_faults.py kills an owner mid-transfer and restarts a daemon
mid-download, tests/test_adversarial_fold.py kills a fold, tests/test_adversarial_cut_through.py
an owner streaming growing chunks).

What must hold: the engine's read ends short or with an error, never as a complete answer of
wrong bytes; the restarted daemon serves the READY snapshot again at once, byte-identical; the
peer that was fetching finishes with the trainer's bytes; nothing without READY is under an
identity.
"""

from __future__ import annotations

import http.client
import threading
from pathlib import Path

import pytest

from bdn.publish import publish_full
from support.checkpoints import make_state, write_hf_dir
from support.swarm import Swarm

pytestmark = pytest.mark.timeout(300)
IDENT = "step000001"
BIG = "model-00001-of-00002.safetensors"


def _pull_slowly(port: int, path: str, out: dict) -> None:
    """Read ``path`` from the local API 4 KiB at a time (an engine that is slow to take bytes);
    ``out``: ``status``, ``body`` (None when the answer ended short or broke)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        out["status"] = r.status
        out["started"].set()
        got = b""
        while True:
            piece = r.read(4096)
            if not piece:
                break
            got += piece
        out["body"] = got if r.length in (None, 0) and len(got) == int(r.getheader("Content-Length", -1)) else None
    except (OSError, http.client.HTTPException):
        out["body"] = None
    finally:
        out["started"].set()
        conn.close()


def test_kill_9_while_an_engine_pulls_and_a_peer_fetches(tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    ck = write_hf_dir(tmp_path / "trainer", make_state(0, scale=8), 1)  # ~10 MB
    publish_full(f"file://{bucket}", IDENT, 1, dir=ck, chunk_size=64 << 10)
    env = {"BDN_LOAD_STARTUP": "false", "BDN_PEER_DOWNLOAD_MBIT": "8"}  # node1 fetches for ~10 s
    with Swarm(tmp_path / "nodes", 2, f"file://{bucket}", extra_env=env) as s:
        node0, node1 = s.daemons
        assert node0.prefetch(IDENT)[0] == 202
        node0.wait_ready(IDENT)
        want = (ck / BIG).read_bytes()
        out: dict = {"started": threading.Event()}
        reader = threading.Thread(
            target=_pull_slowly, args=(node0.local_port, f"/v1/snapshots/{IDENT}/files/{BIG}", out)
        )
        reader.start()
        assert out["started"].wait(120)
        assert node1.prefetch(IDENT)[0] == 202
        node1.get(f"/v1/snapshots/{IDENT}")  # node1 has started (it asks node0 for about half the chunks)
        node0.kill()
        reader.join(120)
        assert out["status"] == 200, out
        assert out["body"] is None or out["body"] == want, "a complete answer of wrong bytes"
        got = Path(node1.wait_ready(IDENT)["path"])  # the survivor finishes (bucket, for node0's share)
        for f in ck.iterdir():
            assert (got / f.name).read_bytes() == f.read_bytes(), f.name
        for p in node0.store.iterdir():  # nothing without READY under an identity
            if p.is_dir() and not p.name.startswith("."):
                assert (p / "READY").is_file(), p
        node0.start(s.peer_urls)
        node0.wait_healthy()
        rec = node0.wait_ready(IDENT)  # served again from its READY marker
        assert rec["bytes_from_bucket"] + rec["bytes_from_peers"] == 0, rec
        conn = http.client.HTTPConnection("127.0.0.1", node0.local_port, timeout=120)
        conn.request("GET", f"/v1/snapshots/{IDENT}/files/{BIG}")
        assert conn.getresponse().read() == want
        conn.close()
        assert "Traceback" not in node0.log() and "Traceback" not in node1.log()
