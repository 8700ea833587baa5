"""The result row of one fleet simulation (bench/fleetsim): what the issue asks per run."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import numpy as np


def result(sim: Any, victims: list[str]) -> dict[str, Any]:
    """Times in seconds, memory in bytes, control rates in messages per node per second.

    Control messages: SWIM (ping, ack, ping_req, sync), BITFIELD, HAVE and hot-load pushes, sent
    plus received, over each live node's time in the run.
    """
    sc = sim.sc
    live = [x for x in sim.nodes.values() if x.alive]
    done = [x.done_at for x in live if x.done_at is not None]
    last = max(done) if done and len(done) == len(live) else None
    end = sim.env.now
    rates = [(x.ctrl_sent + x.ctrl_recv) / max(1e-9, end - x.joined_at) for x in live]
    dup = sum(c - 1 for c in sim.bucket_reads.values() if c > 1)
    adopted = [x.adopted_at for x in live if x.adopted_at is not None]
    sample = sim.rng.sample(live, min(10, len(live)))
    swim_bytes = max((x.swim.state_bytes() for x in sample if x.swim), default=0)
    readers = sim.reader_count(sc.n - len(sim.late))
    # late joiners counted live by the members that were there before them (SWIM admission:
    # a joiner heard of second-hand counts once it answered a probe, bdn.control.probation)
    joiners = [x.id for x in live if x.joined_at > 0]
    olds = [x for x in sample if x.joined_at == 0 and x.swim is not None]
    known = sum(1 for x in olds for j in joiners if x.swim.is_live(j))
    waiting = max((len(x.swim.newcomers) for x in sample if x.swim), default=0)
    return {
        "scenario": asdict(sc),
        "floor_s": round(sc.floor_s, 3),
        "seconds": None if last is None else round(last, 3),
        "x_floor": None if last is None else round(last / sc.floor_s, 4),
        "done_nodes": len(done),
        "live_nodes": len(live),
        "killed": len(victims),
        "late": len(sim.late),
        "readers": readers,
        "bucket_connections": None if readers is None else readers * sc.bucket_concurrency,
        "bucket_egress_over_s": round(sim.bucket_bytes / sc.snapshot_bytes, 4),
        "duplicate_bucket_reads": dup,
        "control_msgs_per_node_s_mean": round(float(np.mean(rates)), 3),
        "control_msgs_per_node_s_max": round(float(np.max(rates)), 3),
        "peer_state_bytes_per_node_max": int(max((x.state_peak for x in live), default=0)),
        "member_table_bytes_per_node": int(swim_bytes),
        # the POST reaching every node of the fleet as it was, and joiners after their join
        "hotload_target_spread_s": None
        if len(adopted) < len(live)
        else round(max(x.adopted_at for x in live if x.joined_at == 0) - sim.post_at, 4),
        "hotload_late_joiner_adopt_s": round(
            max(
                (x.adopted_at - x.joined_at for x in live if x.joined_at > 0 and x.adopted_at is not None), default=0.0
            ),
            4,
        ),
        "hotload_done_s": None if last is None else round(last - sim.post_at, 3),
        "joiners_counted_live_frac": round(known / (len(olds) * len(joiners)), 4) if olds and joiners else None,
        "newcomers_waiting_max": waiting,
        # control runs: seconds from a joiner's join until 99 % of the members count it live
        # (sampled every 0.5 s over 500 members; max None: some joiner never got there)
        "joiner_99pct_live_s_median": round(float(np.median(list(sim.admitted_99.values()))), 2)
        if sim.admitted_99
        else None,
        "joiner_99pct_live_s_max": round(max(sim.admitted_99.values()), 2)
        if sim.admitted_99 and len(sim.admitted_99) == len(sim.late)
        else None,
        "joiners_99pct_live": len(sim.admitted_99),
        "sim_end_s": round(end, 3),
        "owner_map_rebuilds": sim.owner_cache_rebuilds,
        "chunk_requests": sim.requests,
        "network_refills": sim.net.refills,
    }
