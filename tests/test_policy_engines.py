"""Pure rules of the daemon's engine side: liveness (engine_stale_s, engine_ttl_s), swap reports, hot-load options,
and the changed tensors of an offer (bdn/daemon/replica/engines.py, options.py, changes.py)."""

from __future__ import annotations

import asyncio
import json
import math
import os
from pathlib import Path

import pytest

from bdn.daemon.errors import Invalid
from bdn.daemon.process.clock import FakeClock
from bdn.daemon.replica import engines as rules
from bdn.daemon.replica.changes import Layout, Span, changed_tensors
from bdn.daemon.replica.hotload import parse_request
from bdn.daemon.replica.options import options_from_wire, parse_options
from bdn.daemon.replica.target import Target
from bdn.daemon.replica.view import ReplicaView

# ---- liveness --------------------------------------------------------------------------------


class _E:
    def __init__(self, engine_id: str, last_seen: float, stale: bool = False) -> None:
        self.engine_id, self.last_seen, self.stale, self.name = engine_id, last_seen, stale, f"name-{engine_id}"


def test_an_engine_expires_only_after_the_ttl() -> None:
    es = [_E("a", 100.0), _E("b", 130.0)]
    assert rules.expired(es, 130.0, 30.0) == []
    assert rules.expired(es, 130.001, 30.0) == ["a"]
    assert rules.expired(es, 1e9, 0.0) == []  # 0 disables expiry


def test_a_held_poll_marks_its_engine_well_inside_the_ttl() -> None:
    assert rules.poll_step(30.0) == 5.0
    assert rules.poll_step(3.0) == pytest.approx(1.0)
    assert rules.poll_step(0.01) == 0.05


def test_an_engine_is_stale_after_the_stale_timeout_and_live_again_when_heard_from() -> None:
    es = [_E("a", 100.0), _E("b", 105.0), _E("c", 90.0, stale=True), _E("d", 109.0, stale=True)]
    went, back = rules.stale_changes(es, 110.0, 10.0)
    assert went == [] and back == ["d"]  # "a" is silent for exactly 10 s: not yet; "c" stays stale
    went, back = rules.stale_changes(es, 110.5, 10.0)
    assert went == ["a"] and back == ["d"]
    assert rules.stale_changes(es, 1e9, 0.0) == ([], ["c", "d"])  # 0: staleness off, nobody stale


def test_the_stale_reason_names_the_silent_engines_and_both_timeouts() -> None:
    es = [_E(f"e{i}", 100.0 - i, stale=True) for i in range(5)]
    why = rules.stale_reason(es, 112.0, 10.0, 30.0)
    assert why.startswith("engine e4 (name-e4) not seen for 16.0 s; e3 (name-e3) not seen for 15.0 s")
    assert why.endswith("and 2 more (stale after 10 s, dropped after 30 s)")
    assert rules.stale_reason(es[:1], 112.0, 10.0, 0.0).endswith("(stale after 10 s)")


def test_polls_and_heartbeats_come_well_inside_the_shorter_timeout() -> None:
    assert rules.poll_step(30.0, 10.0) == pytest.approx(10.0 / 3)
    assert rules.poll_step(30.0, 0.0) == 5.0 and rules.poll_step(0.0, 3.0) == pytest.approx(1.0)
    assert rules.poll_step(0.0, 0.0) == 5.0  # both off: the tick does nothing, its pace does not matter
    assert rules.keepalive_s(30.0, 10.0) == pytest.approx(10.0 / 3) and rules.keepalive_s(30.0) == 10.0
    assert rules.keepalive_s(0.0, 0.0) is None


class _Snap:
    def __init__(self, identity: str) -> None:
        self.identity, self.state, self.reason, self.kind = identity, "ready", "", "full"
        self.policy_version, self.bytes_done, self.bytes_total = int(identity[-1]), 1, 1
        self.ready_count = 1


class _Snapshots:
    def __init__(self, root: Path, idents: list[str]) -> None:
        self.root, self.jobs = root, {i: _Snap(i) for i in idents}

    def get(self, identity: str):
        return self.jobs.get(identity)

    def prefetch(self, identity: str, requested_by: str = "local", wait_publish: bool = True):
        return self.jobs[identity]

    def ready_dir(self, identity: str) -> Path:
        return self.root / identity


def test_a_silent_engine_is_dropped_and_the_replica_is_done_with_the_rest(tmp_path: Path) -> None:
    """Two engines serve s1; the fleet moves to s2; one engine acks, the other went silent. After
    engine_ttl_s the silent one is dropped (leases released) and the replica serves s2."""
    clock = FakeClock()
    moved: list[str] = []
    view = ReplicaView("n0", _Snapshots(tmp_path, ["s1", "s2"]), clock, engine_ttl_s=30.0, on_current=moved.append)

    async def run() -> None:
        await view.adopt(Target("s1", 1, "o", "r1"), "test")
        live, dead = view.register_engine("live"), view.register_engine("dead")
        for e in (live, dead):
            offer = await view.next_for(e, None, 0)
            assert offer is not None and offer["identity"] == "s1" and "changed_tensors" not in offer
            await view.ack(e, "s1", 1.0, None)
        assert view.current == "s1" and moved == ["s1"]
        await view.adopt(Target("s2", 2, "o", "r2"), "test")
        offer = await view.next_for(live, "s1", 0)
        assert offer is not None and offer["prompt_cache_policy"] == "RESET_ALL" and offer["engine_ttl_s"] == 30.0
        await view.ack(live, "s2", 2.0, None, {"mode": "partial", "nested": {"x": 1}}, "RESET_ALL", "wait")
        assert view.replica()["loading_state"]["stage"] != "done"  # "dead" has not taken s2
        clock.advance(20.0)
        await view.next_for(live, "s2", 0)  # "live" keeps polling
        clock.advance(11.0)
        assert await view.expire_engines() == [dead.engine_id]
        rep = view.replica()
        assert rep["engines"] == 1 and rep["loading_state"]["stage"] == "done"
        assert rep["current_snapshot_identity"] == "s2" and moved == ["s1", "s2"]
        assert rep["last_swap"] == {"mode": "partial", "engine_id": live.engine_id}
        assert {ident for ident, _ in view.leases.values()} == {"s2"}  # the dead one's s1 lease is gone
        (desc,) = view.describe_engines()
        assert desc["serving"] == "s2" and desc["inflight_policy"] == "wait" and desc["expires_in_s"] == 19.0

    asyncio.run(run())


def test_without_engines_the_replica_is_done_only_once_it_serves_the_target(tmp_path: Path) -> None:
    """A target whose job reads ready before its change event reached the view (the runner
    notifies after work on the disk threads) is ``ready``, not ``done``, while ``current`` still
    names the old snapshot (the soak saw rows "done s2, current s1": issue 31)."""
    snaps = _Snapshots(tmp_path, ["s1", "s2"])
    snaps.jobs["s2"].state = "downloading"
    view = ReplicaView("n0", snaps, FakeClock())

    async def run() -> None:
        await view.adopt(Target("s1", 1, "o", "r1"), "test")
        assert view.current == "s1" and view.replica()["loading_state"]["stage"] == "done"
        await view.adopt(Target("s2", 2, "o", "r2"), "test")
        assert view.replica()["loading_state"]["stage"] == "downloading"
        snaps.jobs["s2"].state = "ready"  # set by the runner; its notify has not come yet
        rep = view.replica()
        assert rep["current_snapshot_identity"] == "s1"
        assert (rep["loading_state"]["stage"], rep["loading_state"]["identity"]) == ("ready", "s2")
        await view.on_job_changed(snaps.jobs["s2"])  # the notify
        rep = view.replica()
        assert rep["current_snapshot_identity"] == "s2" and rep["loading_state"]["stage"] == "done"

    asyncio.run(run())


def test_a_crashed_engine_goes_stale_then_is_dropped_and_the_replica_says_why(tmp_path: Path) -> None:
    """Engines "old" and "new" serve s1; "old" crashes (no more polls). The fleet moves to s2 and
    "new" acks it: the replica waits for "old" until engine_stale_s, then is done with "new" alone
    and names "old" in its reason; engine_ttl_s later "old" is dropped. With only a stale engine
    left the replica is in error saying why, and live again when that engine is heard from."""
    clock = FakeClock()
    view = ReplicaView("n0", _Snapshots(tmp_path, ["s1", "s2", "s3"]), clock, engine_ttl_s=30.0, engine_stale_s=10.0)

    async def run() -> None:
        await view.adopt(Target("s1", 1, "o", "r1"), "test")
        old, new = view.register_engine("old"), view.register_engine("new")
        for e in (old, new):
            assert await view.next_for(e, None, 0) is not None
            await view.ack(e, "s1", 1.0, None)
        await view.adopt(Target("s2", 2, "o", "r2"), "test")
        offer = await view.next_for(new, "s1", 0)
        assert offer is not None and offer["engine_stale_s"] == 10.0
        await view.ack(new, "s2", 2.0, None)
        clock.advance(9.0)
        assert await view.expire_engines() == []
        rep = view.replica()
        assert rep["loading_state"]["stage"] == "loading" and rep["engines"] == 2 and view.current == "s1"
        clock.advance(1.5)  # "old" silent for 10.5 s, "new" acked 10.5 s ago: both stale
        await view.next_for(new, "s2", 0)  # "new" polls again: live
        assert await view.expire_engines() == []
        rep = view.replica()
        assert old.stale and not new.stale
        assert rep["loading_state"]["stage"] == "done" and rep["engines"] == 1 and view.current == "s2"
        assert rep["loading_state"]["reason"].startswith(
            f"not counted: engine {old.engine_id} (old) not seen for 10.5 s"
        )
        assert [d["stale"] for d in view.describe_engines()] == [True, False]
        clock.advance(20.0)
        await view.next_for(new, "s2", 0)
        assert await view.expire_engines() == [old.engine_id]
        rep = view.replica()
        assert rep["loading_state"] == {**rep["loading_state"], "stage": "done", "reason": ""}
        # the last engine stops polling: the replica reports an error naming it, not "done"
        await view.adopt(Target("s3", 3, "o", "r3"), "test")
        clock.advance(10.5)
        await view.expire_engines()
        rep = view.replica()
        assert rep["loading_state"]["stage"] == "error" and rep["engines"] == 0 and view.current == "s2"
        assert rep["loading_state"]["reason"].startswith(f"every engine stopped polling: engine {new.engine_id} (new)")
        await view.heartbeat(new)  # it was only slow: live again at once (not at the next tick), offered s3
        assert not new.stale and view.replica()["loading_state"]["stage"] == "ready"
        await view.expire_engines()
        assert not new.stale and view.replica()["loading_state"]["stage"] == "ready"
        assert (await view.next_for(new, "s2", 0) or {}).get("identity") == "s3"

    asyncio.run(run())


def test_a_poll_on_a_closed_connection_ends_and_stops_refreshing(tmp_path: Path) -> None:
    clock = FakeClock()
    view = ReplicaView("n0", _Snapshots(tmp_path, ["s1"]), clock, engine_ttl_s=30.0)

    async def run() -> None:
        e = view.register_engine("x")
        clock.advance(5.0)
        assert await view.next_for(e, None, 10.0, connected=lambda: False) is None
        assert e.last_seen == clock.now - 5.0

    asyncio.run(run())


# ---- swap reports ----------------------------------------------------------------------------


def test_swap_reports_are_bounded_scalars() -> None:
    rep = rules.sanitize_report(
        {
            "mode": "partial",
            "pause_ms": 4.5,
            "n": 3,
            "ok": True,
            "none": None,
            "nan": math.nan,
            "big": 2**70,
            "list": [1],
            "obj": {},
            "s": "x" * 500 + "\nmore",
            **{f"k{i}": i for i in range(100)},
        }
    )
    assert rep is not None and len(rep) == rules.MAX_REPORT_KEYS
    assert rep["mode"] == "partial" and rep["pause_ms"] == 4.5 and rep["ok"] is True and rep["none"] is None
    assert rep["nan"] is None and rep["big"] is None and "list" not in rep and "obj" not in rep
    assert rep["s"] == "x" * 200
    assert rules.sanitize_report([1, 2]) is None and rules.sanitize_report(None) is None


# ---- hot-load options ------------------------------------------------------------------------


def test_options_default_and_parse_case_insensitively() -> None:
    o = parse_options({})
    assert (o.prompt_cache_policy, o.inflight_policy, o.inflight_wait_s) == ("RESET_ALL", "wait", 30.0)
    o = parse_options({"prompt_cache_policy": "preserve", "inflight_policy": "KEEP", "inflight_wait_s": 5})
    assert (o.prompt_cache_policy, o.inflight_policy, o.inflight_wait_s) == ("PRESERVE", "keep", 5)


@pytest.mark.parametrize(
    "body,field",
    [
        ({"prompt_cache_policy": "SOME"}, "prompt_cache_policy"),
        ({"prompt_cache_policy": 1}, "prompt_cache_policy"),
        ({"inflight_policy": "drain"}, "inflight_policy"),
        ({"inflight_wait_s": -1}, "inflight_wait_s"),
        ({"inflight_wait_s": 1e9}, "inflight_wait_s"),
        ({"inflight_wait_s": True}, "inflight_wait_s"),
        ({"inflight_wait_s": "3"}, "inflight_wait_s"),
    ],
)
def test_bad_options_are_one_line_naming_the_field(body: dict, field: str) -> None:
    with pytest.raises(Invalid, match=field) as ei:
        parse_options(body)
    assert "\n" not in str(ei.value) and "offer" not in str(ei.value)


def test_the_request_accepts_the_options_at_its_top_level() -> None:
    ident, meta = parse_request(
        json.dumps(
            {"identity": "s2", "prompt_cache_policy": "PRESERVE", "inflight_policy": "abort", "inflight_wait_s": 1}
        ).encode()
    )
    assert ident == "s2" and meta is None
    with pytest.raises(Invalid, match="unknown request field"):
        parse_request(b'{"identity": "s2", "prompt_cache": "PRESERVE"}')


def test_targets_carry_the_options_over_the_wire() -> None:
    t = Target("s2", 5, "n0", "r", options=parse_options({"inflight_policy": "keep"}))
    back = Target.from_wire(t.wire(), 10)
    assert back is not None and back.options.inflight_policy == "keep"
    old_peer = {k: v for k, v in t.wire().items() if k != "options"}
    assert Target.from_wire(old_peer, 10).options.inflight_policy == "wait"  # type: ignore[union-attr]
    assert Target.from_wire({**t.wire(), "options": {"inflight_policy": "x"}}, 10) is None
    assert options_from_wire("nope") is None


# ---- changed tensors -------------------------------------------------------------------------

CS = 16


def _layout(ident: str, data: bytes, tensors: dict[str, tuple[int, int]], chunk_size: int = CS) -> Layout:
    import xxhash

    digests = tuple(xxhash.xxh3_128_hexdigest(data[i : i + chunk_size]) for i in range(0, len(data), chunk_size))
    return Layout(
        ident,
        chunk_size,
        {"m.safetensors": digests},
        {n: Span("m.safetensors", a, b, "U8", (b - a,)) for n, (a, b) in tensors.items()},
    )


def _same(base: bytes, target: bytes, calls: list[int]):
    def same(bf: str, bo: int, tf: str, to: int, n: int) -> bool:
        calls.append(n)
        return base[bo : bo + n] == target[to : to + n]

    return same


def test_changed_tensors_from_digests_and_edge_chunks() -> None:
    # a: bytes 0-24 (chunk 0 and half of 1), b: 24-40 (shares chunk 1, ends in chunk 2), c: 40-64.
    spans = {"a": (0, 24), "b": (24, 40), "c": (40, 64)}
    base = bytes(range(64))
    tgt = bytearray(base)
    tgt[45] ^= 1  # only c changes; chunk 2 (32-48) is shared by b and c
    t = bytes(tgt)
    calls: list[int] = []
    got = changed_tensors(_layout("s1", base, spans), _layout("s2", t, spans), _same(base, t, calls))
    assert got == ["c"]
    assert calls == [8, 8]  # b's part of chunk 2, then c's: never a whole tensor
    tgt[3] ^= 1  # a's own chunk 0 changes: no read needed for a
    t = bytes(tgt)
    calls.clear()
    assert changed_tensors(_layout("s1", base, spans), _layout("s2", t, spans), _same(base, t, calls)) == ["a", "c"]
    # nothing changed: digests alone settle it
    calls.clear()
    assert changed_tensors(_layout("s1", base, spans), _layout("s2", base, spans), _same(base, base, calls)) == []
    assert calls == []


def test_new_reshaped_moved_and_removed_tensors() -> None:
    base = bytes(64)
    spans = {"a": (0, 32), "b": (32, 64)}
    b_lay = _layout("s1", base, spans)
    # a new tensor is changed; a removed one means no list at all
    grown = _layout("s2", base + bytes(16), {**spans, "new": (64, 80)})
    assert changed_tensors(b_lay, grown, _same(base, base + bytes(16), [])) == ["new"]
    assert changed_tensors(b_lay, _layout("s2", base, {"a": (0, 32)}), _same(base, base, [])) is None
    # another shape is changed without reading
    reshaped = Layout("s2", CS, b_lay.chunks, {**b_lay.tensors, "a": Span("m.safetensors", 0, 32, "U8", (4, 8))})
    assert changed_tensors(b_lay, reshaped, _same(base, base, [])) == ["a"]
    # a tensor at another offset is compared byte for byte
    moved_data = bytes(16) + base
    moved = _layout("s2", moved_data, {"a": (16, 48), "b": (48, 80)})
    calls: list[int] = []
    assert changed_tensors(b_lay, moved, _same(base, moved_data, calls)) == [] and calls == [32, 32]


# ---- the current link ------------------------------------------------------------------------


def test_the_current_link_is_relative_and_replaced_in_place(tmp_path: Path) -> None:
    from bdn.daemon.store.current import CurrentLink

    for ident in ("s1", "s2"):
        (tmp_path / ident).mkdir()
        (tmp_path / ident / "READY").write_text(ident)
    link = CurrentLink(tmp_path)
    assert link.target() is None
    link.point("s1")
    assert os.readlink(tmp_path / "current") == "s1" and (tmp_path / "current" / "READY").read_text() == "s1"
    link.point("s2")
    assert link.target() == "s2" and (tmp_path / "current" / "READY").read_text() == "s2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["current", "s1", "s2"]  # no temporary left


def test_the_engine_table_is_bounded(tmp_path: Path) -> None:
    """The local API has no authentication: a loop of registrations gets 409 past MAX_ENGINES
    (breakit found it unbounded), and a slot frees when an engine leaves."""
    from bdn.daemon.errors import Conflict
    from bdn.daemon.replica.view import MAX_ENGINES

    view = ReplicaView("n0", _Snapshots(tmp_path, ["s1"]), FakeClock(), engine_ttl_s=30.0)
    engines = [view.register_engine(f"e{i}") for i in range(MAX_ENGINES)]
    with pytest.raises(Conflict, match=f"{MAX_ENGINES} engines are registered"):
        view.register_engine("one too many")
    assert view.unregister_engine(engines[0].engine_id)
    assert view.register_engine("fits again").engine_id in view.engines
