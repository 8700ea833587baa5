"""One counters object per daemon: the fetcher, the uploads and the hot-load bump it, and both
``GET /v1/status`` and the Prometheus collector read it (plain integers: the hot path only adds).
"""

from __future__ import annotations

from typing import Any

from bdn.daemon.observe.looplag import LoopLag

COUNTERS = (
    "bucket_bytes_owner",
    "bucket_bytes_fallback",
    "bucket_chunks_owner",
    "bucket_chunks_fallback",
    "bucket_manifest_bytes",
    "peer_bytes_in",
    "peer_bytes_out",
    "peer_chunks_in",
    "peer_chunks_out",
    "local_bytes_copied",
    "chunk_verify_failures",
    "chunks_quarantined",
    "peer_wire_bytes_in",  # = peer_bytes_in/out: every peer chunk takes the transfer wire (kept for dashboards)
    "peer_wire_bytes_out",
    "peer_chunks_in_cut_through",  # received while the sender's bucket read still landed (bdn.transfer.growing)
    "bucket_chunks_taken_over",  # read here for another owner at the end of its list (part of bucket_chunks_owner)
    "bucket_reads_given",  # reads of this node's own chunks it gave up to a taker (a TAKE it granted)
    "http_header_timeouts",  # bdn/daemon/http/guard.py: requests not complete in http_header_timeout_s
    "http_connections_refused",  # over http_max_connections
    "http_bad_requests",  # unparsable requests (431 / 400)
    "bad_chunk_reports_refuted",  # a peer said a chunk of ours was bad; re-hashed, it was not
    "chunks_scrubbed",  # chunks of ready snapshots re-hashed by the scrub
    "heap_trims",  # malloc_trim(0) calls when no download ran (bdn.daemon.observe.memtrim)
    "sparse_applies",  # rebuilt files brought forward in place from a spare (bdn.daemon.apply.buffers)
    "sparse_bytes_written",  # bytes those applies wrote
    "sparse_caught_up",  # spares brought forward in the background to the snapshot served (bdn.daemon.apply.forward)
    "sparse_seeded",  # buffers copied from a ready file no spare held, verified (bdn.daemon.apply.seed)
    "sparse_fallbacks",  # sparse applies refused (wrong base, checksum, cheaper in full): full apply instead
    "sparse_chunks_bad",  # chunks a sparse apply touched whose xxh3 after READY did not match: quarantined
)


class Stats:
    """``counters`` (bytes and chunks by source, as named in ``COUNTERS``), ``verify_failures_by_peer``
        (node id or ``"bucket"`` -> count), ``inflight`` requests by kind (``peer``, ``bucket``,
        ``upload``), ``busy_answers`` (503s received from peers) and ``loop_lag`` (the event loop's
    lateness probe, :class:`~bdn.daemon.observe.looplag.LoopLag`)."""

    def __init__(self) -> None:
        self.counters: dict[str, int] = {k: 0 for k in COUNTERS}
        self.verify_failures_by_peer: dict[str, int] = {}
        self.inflight: dict[str, int] = {"peer": 0, "bucket": 0, "upload": 0}
        self.busy_answers = 0
        #: control-plane requests by direction and message kind ("sent"/"received" -> kind -> n):
        #: SWIM (ping, ack, ping_req, sync, sync_ack), hot_load pushes, status reports and reads
        #: "messages_sent"/"messages_received": SWIM messages, answers included (an ack inside a
        #: ping's response is one message, no request), the unit of bench/fleetsim
        self.control: dict[str, dict[str, int]] = {
            "sent": {},
            "received": {},
            "messages_sent": {},
            "messages_received": {},
        }
        #: membership gauges the gossip loop keeps current: periods, members, epoch, state_bytes
        self.membership: dict[str, int] = {}
        self.loop_lag = LoopLag()  # its run() is started by the app

    def add(self, name: str, n: int = 1) -> None:
        """Add ``n`` to counter ``name`` (one of ``COUNTERS``)."""
        self.counters[name] += n

    def control_request(self, direction: str, kind: str) -> None:
        """Count one control request ``sent`` or ``received`` of message ``kind``."""
        d = self.control[direction]
        d[kind] = d.get(kind, 0) + 1

    def verify_failed(self, source: str) -> None:
        """A chunk from ``source`` (a peer's node id, or ``"bucket"``) did not match its digest."""
        self.counters["chunk_verify_failures"] += 1
        self.verify_failures_by_peer[source] = self.verify_failures_by_peer.get(source, 0) + 1

    def snapshot(self) -> dict[str, Any]:
        """The ``counters``, ``verify_failures_by_peer``, ``inflight`` (requests in flight now, by
        kind), ``control_requests`` and ``membership`` members of the status document (copies)."""
        return {
            "counters": dict(self.counters),
            "verify_failures_by_peer": dict(self.verify_failures_by_peer),
            "inflight": dict(self.inflight),
            "control_requests": {k: dict(v) for k, v in self.control.items()},
            "membership": dict(self.membership),
        }
