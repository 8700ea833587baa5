"""The fleet hot-load status without N requests per poll (DESIGN.md, "Hot-load").

Each replica reports its row (what ``GET replica`` answers) to the **aggregators** of its target:
the ``status_aggregators`` live nodes ranked first by HRW of ``"status" + identity``
(``bdn.control.hotload.aggregators``; every daemon computes the same ones from the same live
set). It reports at once when its stage, loading identity, served snapshot, readiness or
reason changes (checked locally every ``CHECK_S``: no request unless something changed), and
re-reports an unchanged row every ``report_interval`` (``status_report_s``, stretched with the
fleet size so that an aggregator receives at most ``PER_AGGREGATOR_PER_S`` refreshes per
second). ``GET /hot_load/v1/models/hot_load`` on any daemon asks the aggregators of its target
(``status_aggregators`` signed ``GET status`` requests, whatever N), merges their rows with its
own, lists live members that have not reported yet as ``queued``, and answers one page
(``page_size`` default 50, at most 1,000; ``page_token`` from the previous answer's
``next_page_token``) plus ``replica_count`` and ``stages`` over the whole fleet.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from bdn.control import hotload as policy
from bdn.daemon.config import Config
from bdn.daemon.errors import Invalid, NotAvailable
from bdn.daemon.observe.packing import packb
from bdn.daemon.observe.stats import Stats
from bdn.daemon.process.clock import Clock
from bdn.daemon.replica.view import ReplicaView
from bdn.daemon.swarm.membership import Membership
from bdn.daemon.swarm.peer_client import PeerClient
from bdn.proto.fleet_schema import complete_row, replica_row, stage_counts
from bdn.proto.identity import IdentityError, validate_identity
from bdn.proto.keys import NODE_ID_RE
from bdn.proto.states import REPLICA_STAGES

log = logging.getLogger("bdn.fleet_status")
CHECK_S = 0.2
PER_AGGREGATOR_PER_S = 10.0
MAX_ROW_BYTES = 16 << 10
TTL_MULT = 3.0  # a row not refreshed for this many report intervals is dropped


def _key(row: dict[str, Any]) -> tuple[Any, ...]:
    ls = row.get("loading_state") or {}
    return (
        ls.get("stage"),
        ls.get("identity"),
        ls.get("reason"),
        row.get("current_snapshot_identity"),
        row.get("readiness"),
        row.get("engines"),
    )


def _stage(r: policy.Row) -> str:
    ls = r.data.get("loading_state")
    return str(ls.get("stage")) if isinstance(ls, dict) else "queued"


def check_row(obj: Any, peer: str) -> policy.Row:
    """A replica's report from the wire (untrusted; signed by node ``peer``). Raises Invalid."""
    if not isinstance(obj, dict) or not isinstance(obj.get("row"), dict):
        raise Invalid("status report must be a map with a row")
    ident, row = obj.get("identity"), obj["row"]
    try:
        ident = validate_identity(ident)
    except IdentityError as e:
        raise Invalid(f"status report identity: {e}") from None
    if row.get("replica_id") != peer:
        raise Invalid("status report replica_id is not its signer")
    ls = row.get("loading_state")
    if not isinstance(ls, dict) or ls.get("stage") not in REPLICA_STAGES:
        raise Invalid("status report loading_state.stage is not a replica stage")
    try:
        size = len(json.dumps(row))
    except (TypeError, ValueError, RecursionError):
        raise Invalid("status report row is not JSON") from None
    if size > MAX_ROW_BYTES:
        raise Invalid(f"status report row over {MAX_ROW_BYTES} bytes")
    return policy.Row(peer, ident, row)


class FleetStatus:
    """Reports this replica to the aggregators, keeps the rows reported to it, answers the GET."""

    def __init__(
        self, cfg: Config, view: ReplicaView, membership: Membership, peers: PeerClient, stats: Stats, clock: Clock
    ) -> None:
        self.cfg = cfg
        self.view = view
        self.membership = membership
        self.peers = peers
        self.stats = stats
        self.clock = clock
        self.board = policy.ReplicaBoard(clock.monotonic, ttl_s=TTL_MULT * cfg.status_report_s)
        self.closing = False
        self._sent: tuple[tuple[Any, ...], tuple[str, ...]] | None = None  # (row key, aggregators) last reported
        self._next_refresh = 0.0

    def _identity(self) -> str:
        t = self.view.target
        return t.identity if t is not None else (self.view.current or "")

    def aggregators(self, identity: str) -> list[str]:
        """The node ids that aggregate ``identity``'s replica rows (HRW over this node and the live members,
        ``status_aggregators`` of them)."""
        return policy.aggregators(self.membership.hrw_nodes(), identity, self.cfg.status_aggregators)

    def _interval(self) -> float:
        return policy.report_interval(self.cfg.status_report_s, len(self.membership.live()) + 1, PER_AGGREGATOR_PER_S)

    # ---- the reporting side ------------------------------------------------------------------
    async def report_once(self) -> int:
        """Report this replica if its row changed, its aggregators changed or a refresh is due;
        the number of reports sent."""
        ident = self._identity()
        if not ident:
            return 0
        row = self.view.replica()
        aggs = tuple(self.aggregators(ident))
        now = self.clock.monotonic()
        state = (_key(row), aggs)
        if state == self._sent and now < self._next_refresh:
            return 0
        self._sent, self._next_refresh = state, now + self._interval()
        self.board.ttl_s = TTL_MULT * self._interval()
        payload = packb({"identity": ident, "row": row})
        by_node = self.membership.by_node()
        sent = 0
        for node in aggs:
            if node == self.cfg.node_id:
                self.board.put(policy.Row(node, ident, row))
                continue
            m = by_node.get(node)
            if m is None:
                continue
            self.stats.control_request("sent", "status_report")
            sent += 1
            try:
                status, _ = await self.peers.post_json(m.url, "status", payload, timeout=5.0)
                if status != 200:
                    self._sent = None  # try again at the next check
            except Exception as e:  # an aggregator that missed it gets the next refresh
                log.debug("status report to %s failed: %s", node, e)
                self._sent = None
        return sent

    async def loop(self) -> None:
        """:meth:`report_once` every ``CHECK_S`` seconds until ``closing``; a failed round is logged."""
        while not self.closing:
            await asyncio.sleep(CHECK_S)
            try:
                await self.report_once()
            except Exception:  # keep reporting whatever one round met
                log.exception("status report failed")

    # ---- the aggregator side -----------------------------------------------------------------
    def received(self, obj: Any, peer: str) -> None:
        """A replica's report (``POST status``). Raises Invalid, or NotAvailable when the board
        holds ``max_rows`` live rows already (more reporting nodes than a fleet has)."""
        self.stats.control_request("received", "status_report")
        row = check_row(obj, peer)
        try:
            self.board.put(row)
        except policy.HotLoadError as e:
            raise NotAvailable(f"{e} ({self.board.max_rows} replicas)") from None

    def rows_for(self, identity: str) -> list[dict[str, Any]]:
        """``GET status?identity=``: the rows this daemon aggregates for ``identity``."""
        self.stats.control_request("received", "status_read")
        return [r.data for r in self.board.rows(identity)]

    # ---- the GET -----------------------------------------------------------------------------
    async def fleet(self, page_size: object = None, page_token: object = None) -> dict[str, Any]:
        """One page of the fleet's replicas (sorted by replica id), every key of
        ``bdn.proto.fleet_schema`` in every row; replicas membership knows dead are left out.
        Raises Invalid (page args)."""
        try:
            size, after = policy.page_params(page_size, page_token)
        except policy.HotLoadError as e:
            raise Invalid(str(e)) from None
        ident = self._identity()
        boards: list[list[policy.Row]] = []
        if ident:
            by_node = self.membership.by_node()

            async def one(node: str) -> list[policy.Row]:
                if node == self.cfg.node_id:
                    return self.board.rows(ident)
                m = by_node.get(node)
                if m is None:
                    return []
                self.stats.control_request("sent", "status_read")
                try:
                    status, body = await self.peers.get_json(m.url, f"status?identity={ident}", timeout=5.0)
                except Exception as e:  # the other aggregators answer for it
                    log.debug("status read from %s failed: %s", node, e)
                    return []
                if status != 200 or not isinstance(body, dict) or not isinstance(body.get("rows"), list):
                    return []
                out = []
                for r in body["rows"][: policy.MAX_PAGE_SIZE * 100]:
                    rid = r.get("replica_id") if isinstance(r, dict) else None
                    if isinstance(rid, str) and NODE_ID_RE.match(rid):
                        out.append(policy.Row(rid, ident, r))
                return out

            boards = list(await asyncio.gather(*(one(n) for n in self.aggregators(ident))))
        live = {m.node_id for m in self.membership.live()}
        # a replica membership declared dead leaves the view at once, not when its row expires
        # (3 report intervals: a killed replica would be counted done for ~30 s)
        dead = {m.node_id for m in self.membership.members.values() if m.node_id and not m.alive} - live
        # the aggregators may hold different reports of one replica: its newest row wins
        complete = [[policy.Row(r.node, r.identity, complete_row(r.data)) for r in rows] for rows in boards]
        reported = policy.merge(complete, made_at=lambda r: float(r.data["reported_at"]))
        merged = {r.node: r for r in reported if r.node not in dead}
        merged[self.cfg.node_id] = policy.Row(self.cfg.node_id, ident, self.view.replica())  # our own, fresh
        for node in live - set(merged):
            merged[node] = policy.Row(
                node,
                ident,
                replica_row(node, {"stage": "queued", "identity": ident or None, "reason": "no status report yet"}),
            )
        rows = [merged[n] for n in sorted(merged)]
        page, token = policy.paginate(rows, size, after)
        return {
            "identity": ident or None,
            "replicas": [r.data for r in page],
            "next_page_token": token,
            "replica_count": len(rows),
            "stages": stage_counts(_stage(r) for r in rows),
        }
