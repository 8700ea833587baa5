"""An engine that heartbeats irregularly against a real bdnd (engine_stale_s, engine_ttl_s): silent
past engine_stale_s it is stale; the heartbeat that ends the silence makes it live in that same
answer (not at the next liveness tick, while the replica would report every engine stopped);
silent past engine_ttl_s it is dropped and its heartbeat is a 404."""

from __future__ import annotations

from pathlib import Path

from bdn.publish import publish_full, publish_startup
from support.api import http, wait_for
from support.swarm import Daemon


def _engine(d: Daemon, engine_id: str) -> dict[str, object] | None:
    status, ans = http("GET", f"{d.url}/v1/engines")
    assert status == 200, ans
    return next((e for e in ans["engines"] if e["engine_id"] == engine_id), None)


def test_an_engine_heard_from_again_is_live_at_once_and_dropped_after_the_ttl(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_bytes(b"{}")
    url = f"file://{tmp_path / 'bucket'}"
    publish_full(url, "step000001", 1, dir=src)
    publish_startup(url, "step000001")
    # stale after 3 s (the check right after a heartbeat is far inside it); dropped after 12 s,
    # far past the moment each silence below is ended
    env = {"BDN_ENGINE_STALE_S": "3", "BDN_ENGINE_TTL_S": "12"}
    d = Daemon(tmp_path / "n0", "n0", url, extra_env=env)
    d.start([])
    try:
        d.wait_healthy()
        d.wait_ready("step000001", timeout=180)
        status, ans = http("POST", f"{d.url}/v1/engines", {"name": "irregular"})
        assert status == 201, ans
        eid = ans["engine_id"]
        beat = f"{d.url}/v1/engines/{eid}/heartbeat"
        for gap in range(2):  # silences past engine_stale_s, each ended by one heartbeat
            wait_for(
                lambda: _engine(d, eid), 120, f"engine stale (silence {gap})", 0.1, until=lambda e: e and e["stale"]
            )
            assert http("POST", beat, {})[0] == 200
            assert _engine(d, eid)["stale"] is False  # type: ignore[index]
            status, reps = http("GET", f"{d.url}/hot_load/v1/models/hot_load")
            assert status == 200 and "every engine stopped polling" not in str(reps), reps
        wait_for(lambda: _engine(d, eid), 180, "engine dropped after engine_ttl_s", 0.2, until=lambda e: e is None)
        assert http("POST", beat, {})[0] == 404
        assert d.log().count("heard from again: live") == 2
    finally:
        d.stop()
