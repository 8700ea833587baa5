"""Two daemons of one swarm with the same node id (it defaults to the host name, so two daemons on
one host share it unless told otherwise): each ignores the other, and says so in its log instead
of running alone without a word (new-user report). A static peer URL that is the daemon itself
is not such a clash."""

from __future__ import annotations

from pathlib import Path

from support.api import wait_for
from support.swarm import Daemon


def test_a_peer_with_this_daemons_node_id_is_named_in_a_warning(tmp_path: Path) -> None:
    bucket = f"file://{tmp_path}/bucket"
    (tmp_path / "bucket").mkdir()
    a = Daemon(tmp_path / "a", "twin", bucket)
    b = Daemon(tmp_path / "b", "twin", bucket)
    urls = [a.peer_url, b.peer_url]  # each lists itself too, as a fleet-wide list does
    try:
        for d in (a, b):
            d.start(urls)
        for d in (a, b):
            d.wait_healthy()
        for d, other in ((a, b), (b, a)):
            wait_for(
                lambda d=d, other=other: (
                    f"peer {other.peer_url} has this daemon's node id 'twin'" in d.log_path.read_text()
                ),
                120,
                f"{d.peer_url} to warn about {other.peer_url}",
            )
            text = d.log_path.read_text()
            assert f"peer {d.peer_url} has this daemon's node id" not in text  # its own URL is itself
            assert text.count("has this daemon's node id") == 1  # once per peer URL, not per round
    finally:
        for d in (a, b):
            d.stop()
