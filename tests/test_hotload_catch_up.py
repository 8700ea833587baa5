"""A daemon asks members for the fleet's hot-load target before it accepts a POST
(``HotLoad.catch_up``, bdn/daemon/replica/hotload.py), so that the new target's ``gen`` is above the
fleet's even where gossip has not reached it yet.

Found by the one-hour soak: a daemon back from a liar's round heard nothing from its peers for
70 s; POSTs it accepted meanwhile made ``gen`` from its stale target, lost to the fleet's older
target everywhere and were answered 200 all the same (docs/decisions/0014-hotload-target-order.md).
The decisions run on a real ``ReplicaView`` with an injected clock; the members' answers come
from a recorder of the signed GETs (the route itself is exercised between real daemons in
tests/test_hotload.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from bdn.daemon.config import Config
from bdn.daemon.observe.stats import Stats
from bdn.daemon.process.clock import FakeClock
from bdn.daemon.replica.hotload import PULL_PEERS, HotLoad
from bdn.daemon.replica.target import Target
from bdn.daemon.replica.view import ReplicaView
from bdn.daemon.swarm.membership import Membership
from test_policy_engines import _Snapshots


class Members:
    """Signed GETs of ``hot_load`` as a member answers them: ``answers[url]`` (an exception raises)."""

    def __init__(self, answers: dict[str, object]) -> None:
        self.answers = answers
        self.asked: list[str] = []

    async def get_json(self, url: str, path: str, timeout: float = 5.0):  # noqa: ANN201
        assert path == "hot_load"
        self.asked.append(url)
        a = self.answers[url]
        if isinstance(a, BaseException):
            raise a
        return a


def _daemon(tmp_path: Path, clock: FakeClock, answers: dict[str, object], live: int) -> tuple[HotLoad, Members]:
    ms = Membership("n0", "http://10.0.0.1:7080", [u for u in answers], clock)
    for i, u in enumerate(answers):
        if i < live:
            ms.mark_ok(u, f"n{i + 1}")
    view = ReplicaView("n0", _Snapshots(tmp_path, ["s1", "s2", "s3"]), clock, engine_ttl_s=30.0)
    peers = Members(answers)
    hl = HotLoad("n0", view, view.snapshots, None, peers, ms, Stats(), clock, Config(node_id="n0"))  # type: ignore[arg-type]
    return hl, peers


def test_a_stale_daemon_adopts_the_fleets_target_before_it_makes_a_gen(tmp_path: Path) -> None:
    clock = FakeClock(1_800_000_000.0)
    fleet = Target("s1", 5, "n1", "r-rollback", gen=7, policy_version=1)
    urls = [f"http://10.0.1.{i}:7080" for i in range(5)]
    answers: dict[str, object] = {
        urls[0]: (200, {"target": fleet.wire()}),
        urls[1]: OSError("connection refused"),
        urls[2]: (200, {"target": {"identity": "../x"}}),  # malformed: ignored
        urls[3]: (200, {"target": None}),
        urls[4]: (401, None),
    }
    hl, peers = _daemon(tmp_path, clock, answers, live=2)

    async def run() -> None:
        await hl.view.adopt(Target("s2", 1, "n0", "r-old", gen=2, policy_version=2), "before the restart")
        answered = await hl.catch_up()
        assert len(peers.asked) == PULL_PEERS and set(urls[:2]) <= set(peers.asked)  # the live ones first
        assert answered >= 1
        # the fleet's target (gen 7) replaced the stale one: a POST here now makes gen 8
        assert hl.view.target is not None and hl.view.target.request_id == "r-rollback" and hl.view.target.gen == 7

    asyncio.run(run())
    assert hl.stats.control["sent"]["hot_load_pull"] == PULL_PEERS


def test_an_older_or_garbled_answer_changes_nothing(tmp_path: Path) -> None:
    clock = FakeClock(1_800_000_000.0)
    urls = [f"http://10.0.1.{i}:7080" for i in range(3)]
    older = Target("s1", 5, "n1", "r1", gen=1, policy_version=1)
    answers: dict[str, object] = {
        urls[0]: (200, {"target": older.wire()}),
        urls[1]: (200, ["not", "a", "map"]),
        urls[2]: (200, {"target": {**older.wire(), "gen": 2**60}}),
    }
    hl, _ = _daemon(tmp_path, clock, answers, live=3)

    async def run() -> None:
        mine = Target("s3", 9, "n0", "r-mine", gen=4, policy_version=3)
        await hl.view.adopt(mine, "request")
        await hl.catch_up()
        assert hl.view.target == mine

    asyncio.run(run())
