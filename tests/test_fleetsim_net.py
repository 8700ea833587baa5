"""bench/fleetsim's network model: max-min fair rates, local re-fills, flow completion events."""

from __future__ import annotations

import math
import random

import pytest

simpy = pytest.importorskip("simpy")

from bench.fleetsim.net import Flow, Link, Network, max_min  # noqa: E402


def _flow(links: tuple[Link, ...], cap: float = math.inf) -> Flow:
    return Flow(1.0, links, cap, 0.0, None, None)


def test_max_min_gives_a_bottlenecked_flow_s_share_to_the_others() -> None:
    # L1 = 10, L2 = 4; a on L1, b on L1 + L2, c on L2: L2 is the bottleneck of b and c (2 each),
    # and a takes what b leaves on L1 (8), not an equal split (5).
    l1, l2 = Link("l1", 10.0), Link("l2", 4.0)
    a, b, c = _flow((l1,)), _flow((l1, l2)), _flow((l2,))
    r = max_min([a, b, c], {l1: 10.0, l2: 4.0})
    assert r[b] == pytest.approx(2.0) and r[c] == pytest.approx(2.0)
    assert r[a] == pytest.approx(8.0)


def test_max_min_respects_flow_caps_and_residuals() -> None:
    ln = Link("l", 10.0)
    capped, free = _flow((ln,), cap=1.5), _flow((ln,))
    r = max_min([capped, free], {ln: 10.0})
    assert r[capped] == pytest.approx(1.5) and r[free] == pytest.approx(8.5)
    r = max_min([capped, free], {ln: 2.0})  # others use 8 of it
    assert r[capped] == pytest.approx(1.0) and r[free] == pytest.approx(1.0)


def test_flows_finish_at_their_max_min_times() -> None:
    env = simpy.Environment()
    net = Network(env)
    ln = Link("l", 10.0)
    done: dict[str, float] = {}
    net.start(10.0, (ln,), tag="a", on_done=lambda f, ok: done.setdefault(f.tag, env.now))
    net.start(30.0, (ln,), tag="b", on_done=lambda f, ok: done.setdefault(f.tag, env.now))
    env.run()
    # both at 5 B/s until a ends at t = 2 (10 B); b's last 20 B at 10 B/s: t = 4
    assert done["a"] == pytest.approx(2.0) and done["b"] == pytest.approx(4.0)
    assert ln.flows == {} and net.active == 0


def test_a_flow_capped_elsewhere_leaves_its_share_to_the_others() -> None:
    env = simpy.Environment()
    net = Network(env)
    up_a, up_b, down = Link("a/up", 2.0), Link("b/up", 100.0), Link("c/down", 10.0)
    fa = net.start(100.0, (up_a, down))
    fb = net.start(100.0, (up_b, down))
    assert fa.rate == pytest.approx(2.0) and fb.rate == pytest.approx(8.0)
    assert down.alloc == pytest.approx(10.0)


def test_abort_reports_false_and_the_bytes_moved() -> None:
    env = simpy.Environment()
    net = Network(env)
    ln = Link("l", 4.0)
    seen: list[tuple[bool, float]] = []
    f = net.start(100.0, (ln,), on_done=lambda f, ok: seen.append((ok, f.moved)))
    other = net.start(100.0, (ln,))
    env.run(until=5.0)
    net.abort(f)
    assert seen == [(False, pytest.approx(10.0))]  # 5 s at 2 B/s
    assert other.rate == pytest.approx(4.0)  # it has the link to itself now
    net.abort(f)  # twice: no second callback
    assert len(seen) == 1


def test_local_refills_never_over_commit_and_match_global_max_min_on_a_star() -> None:
    """Random flows between 12 nodes' NICs (up, down) and a bucket link: after every start
    and end no link carries more than its capacity; on a star (every flow into one down
    link, so every flow is in the re-filled group) the rates equal global max-min."""
    rng = random.Random(7)
    env = simpy.Environment()
    net = Network(env)
    ups = [Link(f"{i}/up", rng.choice([5.0, 10.0, 20.0])) for i in range(12)]
    downs = [Link(f"{i}/down", 10.0) for i in range(12)]
    bucket = Link("bucket", 15.0)
    links = ups + downs + [bucket]
    flows = []
    for step in range(200):
        if flows and rng.random() < 0.4:
            net.abort(flows.pop(rng.randrange(len(flows))))
        else:
            s, d = rng.sample(range(12), 2)
            path = (bucket, downs[d]) if rng.random() < 0.2 else (ups[s], downs[d])
            flows.append(net.start(1e9, path, cap=rng.choice([math.inf, 3.0])))
        for ln in links:
            used = sum(f.rate for f in ln.flows)
            assert used <= ln.cap * (1 + 1e-6), (step, ln)
            assert ln.alloc == pytest.approx(used, abs=1e-6)
    for f in list(flows):
        net.abort(f)
    star = [net.start(1e9, (ups[i], downs[0])) for i in range(1, 12)]
    want = max_min(star, {ln: ln.cap for ln in links})
    for f in star:
        assert f.rate == pytest.approx(want[f])
    assert sum(f.rate for f in star) == pytest.approx(10.0)
