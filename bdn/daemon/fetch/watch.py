"""What the fetcher does with the chunk sources' records (``bdn.daemon.fetch.policy.SourceBook``):
time each peer request, tell the book how it ended, and act on its answers: a peer that keeps
refusing what its have-list invites (a lying or stale have-list), or whose answer lags far behind
the others' median rate, is penalised (``Membership.penalise``: out of the live set for
``penalty_s``, its requests in flight cancelled, so their chunks go to the next source at once)
and named in one log line. The rules themselves are the policy's; this module only executes them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable

from bdn.daemon.config import Config
from bdn.daemon.fetch.policy import SourceBook
from bdn.daemon.process.clock import Clock
from bdn.daemon.swarm.membership import Member, Membership
from bdn.proto.manifest import ChunkRef

log = logging.getLogger("bdn.fetch")

#: Seconds between two looks at a request in flight (is it lagging yet?).
LAG_CHECK_S = 0.25


class Attempt:
    """One peer request as the watch sees it: ``outcome`` (``ok``, ``busy``, ``not_here``,
    ``failed``, ``corrupt``; ``local`` when it never left this node: given up before it was
    sent) and ``data_at``, when its answer's body began (:meth:`data`, called by the transfer
    thread on a DATA frame), on the book's clock."""

    __slots__ = ("clock", "data_at", "outcome")

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.outcome = "local"
        self.data_at: float | None = None

    def data(self) -> None:
        """The answer's body begins now (thread-safe: one float assignment)."""
        self.data_at = self.clock.monotonic()


class SourceWatch:
    """The :class:`SourceBook` of this daemon and the acts its answers call for (see above)."""

    def __init__(self, cfg: Config, membership: Membership, clock: Clock) -> None:
        self.cfg = cfg
        self.membership = membership
        self.clock = clock
        self.book = SourceBook(clock)

    def attempt(self) -> Attempt:
        """A new :class:`Attempt` on this watch's clock."""
        return Attempt(self.clock)

    async def run(self, identity: str, m: Member, ref: ChunkRef, att: Attempt, request: Awaitable[bool]) -> bool:
        """Await ``request`` (a peer request for ``ref`` filling ``att``), looking every
        ``LAG_CHECK_S`` whether its body lags (:meth:`SourceBook.lagging`): then the peer is
        penalised (which cancels its requests: this one returns False soon) and logged."""
        task: asyncio.Future[bool] = asyncio.ensure_future(request)
        counted = False
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=LAG_CHECK_S)
                if done:
                    return task.result()
                if att.data_at is None or self.membership.redirected(m):
                    continue
                if not counted:
                    counted = True
                    self.book.bodies += 1
                elapsed = self.clock.monotonic() - att.data_at
                if self.book.lagging(m.node_id, ref.length, elapsed):
                    median = self.book.median_rate(without=m.node_id) or 0.0
                    self.membership.penalise(m.url, self.cfg.penalty_s)
                    log.warning(
                        "snapshot %s: peer %s is slow: chunk %d of %s (%d bytes) not done after %.1f s, "
                        "the other sources' median is %.0f KB/s; asked elsewhere, penalised for %g s",
                        identity,
                        m.node_id,
                        ref.index,
                        ref.path,
                        ref.length,
                        elapsed,
                        median / 1e3,
                        self.cfg.penalty_s,
                        extra={"peer": m.node_id},
                    )
                    return await task
        except asyncio.CancelledError:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise
        finally:
            if counted:
                self.book.bodies -= 1

    def judge(self, identity: str, m: Member, ref: ChunkRef, att: Attempt, invited: bool) -> None:
        """Tell the book how ``att`` ended. ``invited``: the peer's have-list showed the chunk
        (asked as a holder, with no wait), so a busy answer is a refusal too; "not here" always
        is. A refusal the book calls one too many penalises the peer (one log line)."""
        if att.outcome == "ok":
            secs = None if att.data_at is None else self.clock.monotonic() - att.data_at
            self.book.delivered(m.node_id, ref.length, secs)
        elif (att.outcome == "not_here" or (att.outcome == "busy" and invited)) and self.book.refused(
            m.node_id, advertised=invited and att.outcome == "not_here"
        ):
            self.membership.penalise(m.url, self.cfg.penalty_s)
            log.warning(
                "snapshot %s: peer %s refused the chunks it advertises, request after request (the "
                "last: %s, chunk %d of %s); penalised for %g s",
                identity,
                m.node_id,
                att.outcome.replace("_", " "),
                ref.index,
                ref.path,
                self.cfg.penalty_s,
                extra={"peer": m.node_id},
            )
