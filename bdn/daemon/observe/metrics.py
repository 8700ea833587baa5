"""Prometheus metrics of one node, rendered from its live counters on each scrape.

A custom collector (prometheus-client's documented pattern for values that already live
elsewhere) reads the daemon's counters (``bdn.daemon.observe.stats``) and its services' views, so the
hot path only bumps plain integers.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from bdn.daemon.fetch.bucketio import BucketIO
from bdn.daemon.observe.readiness import Readiness
from bdn.daemon.observe.stats import Stats
from bdn.daemon.replica.view import ReplicaView
from bdn.daemon.snapshots.catalog import Catalog
from bdn.daemon.swarm.membership import Membership
from bdn.proto.states import SNAPSHOT_STATES as STATES


class _Collector:
    def __init__(
        self,
        stats: Stats,
        catalog: Catalog,
        membership: Membership,
        bucket: BucketIO,
        replica: ReplicaView,
        readiness: Readiness | None = None,
    ) -> None:
        self.stats, self.catalog, self.membership, self.bucket, self.replica = (
            stats,
            catalog,
            membership,
            bucket,
            replica,
        )
        self.readiness = readiness

    def collect(self) -> Iterator[Metric]:
        c = self.stats.counters
        failures = self.stats.verify_failures_by_peer
        jobs = self.catalog.all()
        b = CounterMetricFamily("bdn_bucket_bytes", "Chunk bytes read from the bucket", labels=["role"])
        b.add_metric(["owner"], c["bucket_bytes_owner"])
        b.add_metric(["fallback"], c["bucket_bytes_fallback"])
        yield b
        bc = CounterMetricFamily("bdn_bucket_chunks", "Chunks read from the bucket", labels=["role"])
        bc.add_metric(["owner"], c["bucket_chunks_owner"])
        bc.add_metric(["fallback"], c["bucket_chunks_fallback"])
        yield bc
        yield CounterMetricFamily(
            "bdn_bucket_manifest_bytes", "Manifest bytes read from the bucket", value=c["bucket_manifest_bytes"]
        )
        stats = self.bucket.bucket_stats()
        yield CounterMetricFamily(
            "bdn_bucket_get_requests", "GET requests sent to the bucket", value=stats.get("get_requests", 0)
        )
        p = CounterMetricFamily("bdn_peer_bytes", "Chunk bytes exchanged with peers", labels=["direction"])
        p.add_metric(["in"], c["peer_bytes_in"])
        p.add_metric(["out"], c["peer_bytes_out"])
        yield p
        yield CounterMetricFamily(
            "bdn_peer_chunks_in_cut_through",
            "Chunks received while the sender's bucket read still landed (cut-through)",
            value=c["peer_chunks_in_cut_through"],
        )
        yield CounterMetricFamily(
            "bdn_bucket_chunks_taken_over",
            "Chunks read from the bucket here for another owner, at the end of its list",
            value=c["bucket_chunks_taken_over"],
        )
        yield CounterMetricFamily(
            "bdn_bucket_reads_given",
            "Bucket reads of this node's own chunks given up to another node that took them over",
            value=c["bucket_reads_given"],
        )
        yield CounterMetricFamily(
            "bdn_heap_trims",
            "Times the C heap's free pages were given back to the system while no download ran (malloc_trim)",
            value=c["heap_trims"],
        )
        yield CounterMetricFamily(
            "bdn_local_bytes_copied", "Chunk bytes copied from this node's own store", value=c["local_bytes_copied"]
        )
        v = CounterMetricFamily(
            "bdn_chunk_verify_failures", "Chunks whose bytes did not match the manifest", labels=["source"]
        )
        v.add_metric(["bucket"], failures.get("bucket", 0))
        for peer, k in failures.items():
            if peer != "bucket":
                v.add_metric([peer], k)
        yield v
        yield CounterMetricFamily(
            "bdn_chunks_quarantined",
            "Chunks of ready snapshots found corrupted on this "
            "node (bdnctl verify --repair): no longer served, fetched again",
            value=c["chunks_quarantined"],
        )
        yield CounterMetricFamily(
            "bdn_bad_chunk_reports_refuted",
            "Peers' reports of a bad chunk from this node that its re-hash refuted (the bytes here match)",
            value=c["bad_chunk_reports_refuted"],
        )
        yield CounterMetricFamily(
            "bdn_chunks_scrubbed", "Chunks of ready snapshots re-hashed by the scrub", value=c["chunks_scrubbed"]
        )
        sp = CounterMetricFamily(
            "bdn_sparse",
            "Sparse applies (DESIGN.md, Sparse apply): files brought forward "
            "in place, spares brought forward in the background, buffers seeded by a verified copy, bytes they wrote, refusals (full apply instead), touched chunks found bad",
            labels=["what"],
        )
        for what in ("applies", "caught_up", "seeded", "bytes_written", "fallbacks", "chunks_bad"):
            sp.add_metric([what], c[f"sparse_{what}"])
        yield sp
        h = CounterMetricFamily(
            "bdn_http_guard",
            "Connections the HTTP guards closed or refused (bdn/daemon/http/guard.py)",
            labels=["reason"],
        )
        h.add_metric(["header_timeout"], c["http_header_timeouts"])
        h.add_metric(["too_many_connections"], c["http_connections_refused"])
        h.add_metric(["bad_request"], c["http_bad_requests"])
        yield h
        s = GaugeMetricFamily("bdn_snapshots", "Snapshots on this node by state", labels=["state"])
        for state in STATES:
            s.add_metric([state], sum(1 for j in jobs if j.state == state))
        yield s
        live = GaugeMetricFamily("bdn_peers_live", "Peers that answer health checks", value=len(self.membership.live()))
        yield live
        ctl = CounterMetricFamily(
            "bdn_control_requests",
            "Control-plane requests by direction and message kind "
            "(SWIM ping/ack/ping_req/sync/sync_ack, hot_load, status_report, status_read)",
            labels=["direction", "kind"],
        )
        for direction, kinds in self.stats.control.items():
            for kind, n in kinds.items():
                ctl.add_metric([direction, kind], n)
        yield ctl
        ms = self.stats.membership
        yield CounterMetricFamily("bdn_swim_periods", "SWIM protocol periods run", value=ms.get("periods", 0))
        yield GaugeMetricFamily(
            "bdn_membership_epoch", "Changes of the live set seen (HRW owners recomputed)", value=ms.get("epoch", 0)
        )
        yield GaugeMetricFamily(
            "bdn_members_known", "Members in the SWIM table (alive, suspect or dead)", value=ms.get("members", 0)
        )
        yield GaugeMetricFamily(
            "bdn_membership_state_bytes",
            "Approximate bytes of the SWIM table and queue",
            value=ms.get("state_bytes", 0),
        )
        infl = GaugeMetricFamily("bdn_inflight_requests", "Chunk requests in flight", labels=["kind"])
        for kind, n in self.stats.inflight.items():
            infl.add_metric([kind], n)
        yield infl
        st = GaugeMetricFamily(
            "bdn_snapshot_stage_seconds", "Seconds each snapshot spent in each stage", labels=["identity", "stage"]
        )
        pv = GaugeMetricFamily("bdn_snapshot_policy_version", "Policy version of each snapshot", labels=["identity"])
        for j in jobs[-32:]:  # bounded label set: the node keeps few snapshots
            for stage, secs in j.describe()["stages"].items():
                st.add_metric([j.identity, stage], secs)
            if j.policy_version is not None:
                pv.add_metric([j.identity], j.policy_version)
        yield st
        yield pv
        cur = self.replica.current_policy_version
        yield GaugeMetricFamily(
            "bdn_current_policy_version",
            "Policy version this replica serves (-1: none)",
            value=cur if cur is not None else -1,
        )
        yield CounterMetricFamily(
            "bdn_bucket_retries", "Bucket requests retried (throttling, 5xx)", value=stats.get("retries", 0)
        )
        lag = self.stats.loop_lag
        yield GaugeMetricFamily(
            "bdn_event_loop_lag_max_seconds", "Largest lateness of the event loop over the last minute", value=lag.max_s
        )
        yield CounterMetricFamily("bdn_event_loop_slow", "Event loop probes late by more than 100 ms", value=lag.slow)
        yield GaugeMetricFamily(
            "bdn_event_loop_lag_cpu_max_seconds",
            "Largest lateness of the event loop over the last minute, at most the loop thread's own CPU time meanwhile",
            value=lag.cpu_max_s,
        )
        yield CounterMetricFamily(
            "bdn_event_loop_slow_cpu",
            "Event loop probes late by more than 100 ms of the loop thread's own CPU time",
            value=lag.slow_cpu,
        )
        shm = GaugeMetricFamily("bdn_shm_bytes", "Bytes of reconstructed snapshots held in shm")
        shm.add_metric([], sum(j.result_bytes for j in jobs if j.state == "ready"))
        yield shm
        if self.readiness is not None:
            # the last /v1/ready answer (renewed every 10 s), and the misconfigurations behind it
            yield GaugeMetricFamily(
                "bdn_ready",
                "1 when /v1/ready answered ready last (renewed every 10 s)",
                value=1 if self.readiness.last["ready"] else 0,
            )
            bad = GaugeMetricFamily(
                "bdn_misconfigured", "Misconfigurations noticed and not over, by kind", labels=["problem"]
            )
            for kind, n in self.readiness.problems.counts().items():
                bad.add_metric([kind], n)
            yield bad


class Metrics:
    """One registry with the daemon's collector; ``render()`` -> ``(body, content_type)``."""

    def __init__(
        self,
        stats: Stats,
        catalog: Catalog,
        membership: Membership,
        bucket: BucketIO,
        replica: ReplicaView,
        readiness: Readiness | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_Collector(stats, catalog, membership, bucket, replica, readiness))

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
