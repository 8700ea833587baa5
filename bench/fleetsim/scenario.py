"""One simulated run's parameters (bench/fleetsim). Rates in bytes per second, times in seconds."""

from __future__ import annotations

import math
from dataclasses import dataclass

REAL_CHUNK = 16 << 20  # bdn's chunk size (bdn/proto): the real snapshot has bytes / 16 MiB chunks


@dataclass
class Scenario:
    """One simulated run.

    Sizes: ``snapshot_bytes`` are real; ``chunks`` simulated chunks stand for them, each of
    ``g = chunk_bytes / 16 MiB`` real chunks (:attr:`real_chunks_per_chunk`). A bucket reader
    runs ``bucket_concurrency`` connections of ``bucket_conn_bps`` each, as the daemon does.
    ``serial_reads`` (bdnd since the N = 8 timeline, ``plan.bucket_parts``): one chunk at a
    time, split over all ``bucket_concurrency`` connections, so a reader's chunks complete one
    after another at its whole share of the bucket; otherwise (the older daemon, and today's
    model in the validation) a simulated chunk of ``g`` real chunks is read by
    ``min(g, bucket_concurrency)`` connections and a reader has ``ceil(bucket_concurrency / g)``
    simulated chunks in flight. Either way the reader's connection count and rate are the
    daemon's at any scale.
    """

    name: str
    n: int
    snapshot_bytes: float
    chunks: int
    nic_bps: float
    bucket_bps: float
    bucket_conn_bps: float = 0.0  # 0: no per-connection limit
    rtt_s: float = 0.0002
    jitter_s: float = 0.0001
    policy: str = "fleet"  # "fleet" (bdn/control) or "today" (today's bdnd, bench/fleetsim/today.py)
    kill_frac: float = 0.0
    kill_at_floor: float = 0.5  # deaths at this fraction of the floor
    late_frac: float = 0.0
    late_at_floor: float = 0.25
    seed: int = 1
    # fleet policy knobs (bdn/control/peerset.py, owners.py; the daemon's config keys)
    k: int = 16
    max_peers: int = 32
    reader_slots: int = 4
    download_slots: int = 8
    bucket_concurrency: int = 4  # bdnd's bucket_concurrency: connections per bucket reader
    max_uploads: int = 8
    max_per_peer: int = 2
    busy_backoff_s: float = 0.05  # a peer that answered busy is skipped this long (x 1-3 after a failure)
    penalty_s: float = 30.0  # bdnd's penalty_s: a peer its SourceBook penalises is skipped this long
    have_flush_s: float = 0.1
    serial_reads: bool = False  # a reader reads one chunk at a time over all its connections (bdnd)
    forward: str = "store"  # how a chunk still arriving is forwarded: store, real, cut (forward.py)
    have_at_once_after_read: bool = False  # HAVE flushed at each bucket read, not at the next batch
    owner_ask_after_s: float = 2.0
    endgame_chunks: int = 0  # bdnd's endgame_chunks (4): race two holders for the last chunks (PeerSet)
    swim_period_s: float = 1.0
    hotload_fanout: int = 3  # TargetGossip's fanout (bdn/control/hotload.py default 3)
    suspect_mult: float = 4.0
    max_piggyback: int = 32  # Swim.max_piggyback: updates per SWIM message
    uploads_per_chunk: int = 2  # bdnd's uploads_per_chunk (bdn.daemon.serve.uploads.Uploads, both policies)
    # today policy knobs (bdn/daemon/config.py defaults)
    max_inflight: int = 16
    today_per_peer: int = 4
    #: payload share of a link's rate. 1.0: rates are payload rates. bench/swarm's ``tc tbf``
    #: shapes whole frames (the kernel counts each GSO segment's headers: qdisc_pkt_len_init),
    #: so a 200 Mbit/s tbf carries 1448 payload bytes per 1514-byte frame (MSS with TCP
    #: timestamps): 0.956 of it; the validation row uses that.
    wire_payload: float = 1.0
    time_limit_s: float = 3600.0
    data: bool = True  # False: membership and hot-load only (no chunks): the control plane at scale
    min_sim_s: float = 0.0  # run at least this long (control rates over a steady window)

    @property
    def chunk_bytes(self) -> float:
        return self.snapshot_bytes / self.chunks

    @property
    def real_chunks_per_chunk(self) -> float:
        return max(1.0, self.chunk_bytes / REAL_CHUNK)

    @property
    def conns_per_read(self) -> int:
        """Bucket connections one simulated chunk read stands for."""
        if self.serial_reads:
            return max(1, self.bucket_concurrency)
        return max(1, min(self.bucket_concurrency, round(self.real_chunks_per_chunk)))

    @property
    def reads_per_reader(self) -> int:
        """Simulated chunk reads a reader keeps in flight (its connections / conns_per_read)."""
        if self.serial_reads:
            return 1
        return max(1, math.ceil(self.bucket_concurrency / self.conns_per_read))

    @property
    def read_cap_bps(self) -> float:
        return self.bucket_conn_bps * self.conns_per_read if self.bucket_conn_bps else math.inf

    @property
    def floor_s(self) -> float:
        """S over the narrower of one NIC and the bucket: no schedule can beat it."""
        return self.snapshot_bytes / min(self.nic_bps, self.bucket_bps)
