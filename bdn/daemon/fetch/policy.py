"""The chunk-fetch policy: which chunk next, from which source, when to read the bucket, the
endgame, and what each source's record (rate, refusals) means. Pure (DESIGN.md, "Moving chunks").

No I/O, no asyncio: bdnd's fetcher (``bdn.daemon.fetch.fetcher``) executes what this decides,
and the fleet simulator (``bench/fleetsim``) runs the same functions (tests/test_fleetsim_policy.py
fails if it stops). Time comes from an injected clock, chance from an injected ``random.Random``.

*Which chunk next*: :func:`chunk_order`, the one order bdnd and the simulator draw from: each
owner's next chunk first (the order the owners read them), ties at random per node. :func:`split_owned`
applies it to a layer (the chunks this node owns apart, in manifest order: it reads them), and
``bdn.control.peerset.PeerSet.pick`` to what a peer set's holders have. One *round* over the
sources, for a chunk of ``layer``:

1. *holders* (:func:`holders`): live peers whose have-bitfield shows the chunk; sources the
   :class:`SourceBook` counts slow last, then least loaded (fewest requests in flight from this
   node), ties broken at random. In the *endgame* (:func:`endgame`: at most ``endgame_chunks``
   chunks of the layer left, and two holders or more) the first two are asked at once and the
   first verified copy wins.
2. *owners* (:func:`plan_owners`): the nodes by HRW rank for the chunk's digest (stored chunks
   only: rebuilt chunks are never in the bucket). The first is asked with ``?wait=chunk_wait_s``
   (it fetches while the request is parked), the next ones with a 2 s wait; peers already asked
   this round are skipped. Reaching this node in the ranking ends the list with a
   :class:`ReadBucket` step: it reads the bucket if it is the owner (ranked first, or the owner
   of the live set at that moment, when the nodes above died during the round), else the round
   ends without a bucket read.

:class:`Rounds` decides what follows a round that found nothing: rounds in which peers only said
"busy" do not count (within ``owner_patience_s``); after ``tries`` counted rounds, the bucket is
read as a counted *fallback*. :class:`SourceBook` says which source is penalised (refuses what
its have-list invites) and which request lags (a source far below the median rate holds it:
it is asked elsewhere). :func:`bucket_parts` splits one bucket read.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from bdn.daemon.process.clock import Clock
from bdn.daemon.snapshots.layers import STORED
from bdn.proto import hrw

OWNER_WAIT_NEXT_S = 2.0


@dataclass(frozen=True)
class PeerView:
    """A live peer as the plan sees it: its ``url``, ``node_id`` and requests in flight to it."""

    url: str
    node_id: str
    inflight: int = 0


@dataclass(frozen=True)
class Ask:
    """Ask ``peer``, holding the request up to ``wait`` s at the peer while it fetches (0 = no wait)."""

    peer: PeerView
    wait: float


@dataclass(frozen=True)
class ReadBucket:
    """This node reached itself at HRW position ``pos``: read the bucket if it is the owner."""

    pos: int


class Positions(Protocol):
    """What :func:`split_owned` needs of a have-bitfield (``n`` bits)."""

    n: int

    def __getitem__(self, i: int) -> bool: ...
    def clear_positions(self) -> Any: ...


YIELD_EVERY = 1024  # positions looked at before a drawn order hands the event loop a turn


#: Above this many missing chunks ``split_owned`` keeps manifest order (no full pass up front).
ORDER_LIMIT = 1 << 18


def tiebreak(positions: np.ndarray, salt: int) -> np.ndarray:
    """A random-looking rank per position (uint64 array of ``positions``' shape), fixed by
    ``salt`` (a node's own 64-bit draw): splitmix64's finaliser of ``position ^ salt``, a
    bijection of 64-bit integers, so no two positions tie. Computed for the candidates only (a
    permutation array of 10^6 chunks took 60-70 ms and 8 bytes per chunk)."""
    x = np.asarray(positions).astype(np.uint64) ^ np.uint64(salt & 0xFFFFFFFFFFFFFFFF)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def owner_places(owners: Iterable[object]) -> np.ndarray:
    """Each chunk's place in its owner's read list: ``owners`` gives the owner of each chunk
    in manifest order; the k-th chunk of an owner gets place k (int32 array). Every owner reads
    its chunks in manifest order, one after another, so place k is what the fleet has first."""
    seen: dict[object, int] = {}
    out = []
    for o in owners:
        k = seen.get(o, 0)
        seen[o] = k + 1
        out.append(k)
    return np.asarray(out, dtype=np.int32)


def chunk_order(place: np.ndarray, ties: np.ndarray) -> np.ndarray:
    """Which chunk next: the indexes ``0..len-1`` of the candidate chunks in the order to ask
    for them. ``place[j]``: candidate ``j``'s place in its owner's read list
    (:func:`owner_places`); ``ties[j]``: this node's random rank of it (:func:`tiebreak`).

    Each owner's next chunk first: every owner reads its list in manifest order, so the k-th
    chunk of each owner is in the fleet before any (k+1)-th, and a chunk nobody holds yet is
    asked for as it appears (parked at its owner); ties at random per node, so that nodes asking
    at once spread over the owners' chunks rather than all ask for the same one. Measured against
    rarest first (fewest holders first, BitTorrent's order, which the fleet simulator's peer sets
    ran before) and rarest first with this order among equals: as fast on the simulated delta
    (the second 0.017 x faster), faster on the anchor, and it needs no holder counts
    (BENCHMARKS.md, "How does the control plane scale?").

    bdnd's fetcher (:func:`split_owned`) and the fleet simulator's peer sets
    (``bdn.control.peerset.PeerSet.pick``) both order their candidates with it."""
    return np.lexsort((ties, place))


def split_owned(
    bits: Positions,
    nodes: Sequence[str],
    self_id: str,
    rng: random.Random,
    owner_of: Callable[[int], str | None],
) -> tuple[Iterator[int | None], Iterator[int | None]]:
    """``(owned, others)``: the clear positions of ``bits`` whose chunk this node owns
    (``owner_of(i)``, among ``nodes``: it reads those from the bucket), in manifest order, and
    the rest in :func:`chunk_order`'s order (places in the owners' lists of all ``bits.n``
    chunks, of the missing ones above ``ORDER_LIMIT`` chunks; ties by :func:`tiebreak` salted
    from ``rng``). Both lazy and compact (4-byte arrays
    of positions, a position whose bit got set meanwhile skipped); ``None`` is drawn after every
    ``YIELD_EVERY`` positions looked at without a result: the drawer gives the event loop a turn
    and draws again.

    A layer with more than ``ORDER_LIMIT`` missing chunks keeps manifest order for ``others``
    (no full pass over the manifest before the first request)."""
    if len(nodes) <= 1:
        return _paced(bits.clear_positions(), lambda i: not bits[i]), iter(())
    missing = bits.clear_positions()
    if len(missing) > ORDER_LIMIT:
        return (
            _paced(missing, lambda i: not bits[i] and owner_of(i) == self_id),
            _paced(bits.clear_positions(), lambda i: not bits[i] and owner_of(i) != self_id),
        )
    if bits.n <= ORDER_LIMIT:
        every = [owner_of(i) for i in range(bits.n)]
        owners, place = [every[i] for i in missing], owner_places(every)[missing]
    else:  # a large manifest, most of it held: places among the missing chunks (no pass over all)
        owners = [owner_of(int(i)) for i in missing]
        place = owner_places(owners)
    is_mine = np.fromiter((o == self_id for o in owners), dtype=bool, count=len(missing))
    rest = missing[~is_mine]
    order = chunk_order(place[~is_mine], tiebreak(rest, rng.getrandbits(64)))
    return _paced(missing[is_mine], lambda i: not bits[i]), _paced(rest[order], lambda i: not bits[i])


def pick_steal(remaining: Mapping[str, Sequence[int]], margin: int) -> tuple[str, int] | None:
    """The chunk a node whose own bucket reads are all done reads for another owner, or None.

    ``remaining[owner]``: positions (ascending: an owner reads its chunks in manifest order) of
    that owner's chunks that nobody holds or announced reading yet. The owner with the most of
    them gives up its **last** one, if it has more than ``margin`` (the ones at its front are
    the ones it is about to read). Owners do not progress evenly (each one's bucket reads share its
    downlink with peer traffic), and the last owner's uplink alone then carries its last chunks
    to every other node: the tail (docs/decisions/0009-reads-taken-over-by-grant.md)."""
    best: tuple[int, str] | None = None
    for owner, pos in remaining.items():
        if len(pos) > margin and (best is None or (len(pos), owner) > best):
            best = (len(pos), owner)
    if best is None:
        return None
    return best[1], int(remaining[best[1]][-1])


def _paced(positions: Iterable[Any], wanted: Any) -> Iterator[int | None]:
    """The positions ``wanted(i)`` accepts, and ``None`` after every ``YIELD_EVERY`` refused in a row."""
    idle = 0
    for i in positions:
        i = int(i)
        if wanted(i):
            idle = 0
            yield i
            continue
        idle += 1
        if idle >= YIELD_EVERY:
            idle = 0
            yield None


#: Smallest ranged GET a chunk's bucket read is split into (smaller parts cost more requests than
#: they save). 512 KiB: a 4 MiB chunk is read in 8 parts, so with ``bucket_concurrency`` 8 an
#: owner reads ONE chunk at a time at its whole bucket share; with 1 MiB parts two chunks shared
#: the 8 streams and each took twice as long to complete and be forwarded
#: (docs/decisions/0016-bucket-reads-one-chunk-at-a-time.md).
MIN_PART = 512 << 10


def bucket_parts(length: int, streams: int) -> list[tuple[int, int]]:
    """How one chunk of ``length`` bytes is read from the bucket: ``(offset, length)`` ranges
    within it, at most ``streams`` (``bucket_concurrency``) of at least ``MIN_PART`` bytes each
    (one for a small chunk), covering it exactly, in order. They are read in parallel and one
    chunk at a time, so an owner's chunks complete one after another at its whole share of the
    bucket."""
    n = max(1, min(streams, length // MIN_PART))
    step = -(-length // n)
    return [(o, min(step, length - o)) for o in range(0, length, step)]


def endgame(left: int, holders: int, endgame_chunks: int) -> bool:
    """True when ``left`` chunks remain (<= ``endgame_chunks``) and at least two holders exist."""
    return holders >= 2 and left <= endgame_chunks


def holder_key(slow: bool, inflight: int, spare_reader: bool = False) -> tuple[bool, bool, int]:
    """How the holders of one chunk rank, best (smallest key) first: a source the
    :class:`SourceBook` counts slow last; then a bucket reader when another holder has the chunk
    too (``spare_reader``: its upload slots carry the chunks nobody else has yet; the peer sets
    of ``bdn.control.peerset`` know readers); then fewest requests in flight from this node."""
    return (slow, spare_reader, inflight)


def holders(
    live: Iterable[PeerView],
    has: Iterable[str],
    rng: random.Random,
    book: SourceBook | None = None,
) -> list[PeerView]:
    """The live peers whose urls are in ``has`` (their have-bitfield shows the chunk), ranked
    by :func:`holder_key`, ties at random."""
    hs = set(has)
    out = [p for p in live if p.url in hs]
    out.sort(key=lambda p: (*holder_key(book is not None and book.slow(p.node_id), p.inflight), rng.random()))
    return out


def plan_holders(
    ranked_holders: Sequence[PeerView],
    left: int,
    endgame_chunks: int,
) -> tuple[list[PeerView], list[Ask]]:
    """``(race, asks)``: the holders to ask at once (endgame, else none) and then one by one."""
    if endgame(left, len(ranked_holders), endgame_chunks):
        return list(ranked_holders[:2]), [Ask(p, 0.0) for p in ranked_holders[2:]]
    return [], [Ask(p, 0.0) for p in ranked_holders]


def plan_owners(
    self_id: str,
    live: Iterable[PeerView],
    digest: str,
    layer: str,
    tried: set[str],
    chunk_wait_s: float,
    owner: str | None = None,
) -> list[Ask | ReadBucket]:
    """The owner steps of a round: peers by HRW rank (skipping ``tried`` urls) up to this node;
    ``owner`` (``bdn.daemon.fetch.owners``: the chunk's bounded-load owner among this node and
    ``live``) first, when given."""
    if layer != STORED:
        return []
    live = list(live)
    by_node = {p.node_id: p for p in live}
    nodes = [self_id, *(p.node_id for p in live)]
    steps: list[Ask | ReadBucket] = []
    seen = set(tried)
    ranked = hrw.rank(nodes, digest)
    if owner is not None and owner in ranked:
        ranked.remove(owner)
        ranked.insert(0, owner)
    for pos, node in enumerate(ranked):
        if node == self_id:
            steps.append(ReadBucket(pos))
            break
        p = by_node.get(node)
        if p is None or p.url in seen:
            continue
        seen.add(p.url)
        steps.append(Ask(p, chunk_wait_s if pos == 0 else OWNER_WAIT_NEXT_S))
    return steps


def reads_as_owner(
    step: ReadBucket,
    self_id: str,
    live_nodes: Iterable[str],
    digest: str,
    owner_now: str | None = None,
) -> bool:
    """Whether this node reads the bucket at ``step``: ranked first, or the owner among the nodes
    live now (``owner_now`` when given, else by HRW; those ranked above died during the round:
    this is the new owner's read)."""
    if step.pos == 0:
        return True
    return (owner_now if owner_now is not None else hrw.owner([self_id, *live_nodes], digest)) == self_id


class Rounds:
    """What follows a round that did not get the chunk.

    ``after_round(busy, failed)`` -> ``(delay_s, again)``: wait ``delay_s``, then go round again
    (``again``) or read the bucket as a fallback. A round in which peers only answered busy
    (``busy`` and not ``failed``) does not count while ``patience_s`` has not passed since the
    first round; busy rounds wait 0.1-0.5 s (jittered: slots free up), counted rounds 0.2 s x
    their number.
    """

    def __init__(self, clock: Clock, patience_s: float, rng: random.Random, tries: int = 3) -> None:
        self.clock = clock
        self.rng = rng
        self.tries = tries
        self.attempt = 0
        self.busy_deadline = clock.monotonic() + patience_s

    def after_round(self, busy: bool, failed: bool) -> tuple[float, bool]:
        if busy and not failed and self.clock.monotonic() < self.busy_deadline:
            return 0.1 + self.rng.random() * 0.4, True
        self.attempt += 1
        return 0.2 * self.attempt, self.attempt < self.tries


#: A source's refusals in a row (busy or "not here" to a request its have-list invited) ...
REFUSE_LIMIT = 6
#: ... spanning at least this long, with nothing delivered by it meanwhile while another source
#: delivered: it is penalised (a lying or stale have-list; an honest holder that is merely busy
#: delivers now and then, and when every source is busy nobody is blamed). Long enough that an
#: honest owner busy serving others is not taken for a liar: a penalty takes it out of the live
#: set, so its chunks' HRW owners move and another node reads them from the bucket too.
REFUSE_WINDOW_S = 10.0
#: A source below this fraction of the median rate of the others is slow: asked last, and a
#: request to it running longer than the median source would need at this fraction is lagging.
SLOW_FRACTION = 0.1
#: A request is never lagging before this many seconds (a small chunk's time is mostly latency).
LAG_MIN_S = 2.0
#: Chunks its have-list shows that a source answered "not here" for, in a row: penalised at once.
LIE_LIMIT = 3
#: Weight of a new rate sample in a source's moving average.
RATE_ALPHA = 0.3
#: ``SourceBook`` key of the bucket (never a node id: those are peers).
BUCKET = "\0bucket"


@dataclass
class _Record:
    rate: float = 0.0  # bytes/s, a moving average of whole transfers (0: none measured)
    refusals: int = 0  # refused requests since its last delivery
    lies: int = 0  # of them, "not here" for chunks its have-list shows
    refused_since: float = 0.0  # when the first of them was
    delivered_at: float = float("-inf")


class SourceBook:
    """What this node knows of each chunk source (a peer's node id, or :data:`BUCKET`): its
    rate (bytes/s, a moving average over whole transfers asked with no wait) and its refusals.
    Pure: time from ``clock`` (monotonic s); the fetcher reports what happened and acts on the
    answers (penalise and log, ask another source), as the fleet simulator does.

    The rules (docs/decisions/0020-source-book.md): a source that answers "not here" for chunks its have-list shows, or
    keeps refusing while others deliver, is a lying or stale have-list (:meth:`refused` says
    penalise); a source below ``SLOW_FRACTION`` of the
    median rate of the others is slow (:meth:`slow`: asked last), and a request to any source
    running past :meth:`lag_limit` is lagging (:meth:`lagging`: it is asked elsewhere, and the
    source counts as slow)."""

    def __init__(
        self,
        clock: Clock,
        *,
        refuse_limit: int = REFUSE_LIMIT,
        refuse_window_s: float = REFUSE_WINDOW_S,
        lie_limit: int = LIE_LIMIT,
        slow_fraction: float = SLOW_FRACTION,
        lag_min_s: float = LAG_MIN_S,
    ) -> None:
        self.clock = clock
        self.refuse_limit, self.refuse_window_s, self.lie_limit = refuse_limit, refuse_window_s, lie_limit
        self.slow_fraction, self.lag_min_s = slow_fraction, lag_min_s
        self._src: dict[str, _Record] = {}
        self._last_delivery = float("-inf")  # by any source
        #: Answers whose body is arriving now (the executor counts them: ``bodies += 1`` / ``-= 1``).
        self.bodies = 0

    def _rec(self, src: str) -> _Record:
        r = self._src.get(src)
        if r is None:
            r = self._src[src] = _Record()
        return r

    def delivered(self, src: str, nbytes: int, seconds: float | None) -> None:
        """Event: ``src`` delivered a verified chunk of ``nbytes`` in ``seconds`` (None: not a
        rate sample, e.g. a request parked at an owner or paced by its bucket read)."""
        r = self._rec(src)
        now = self.clock.monotonic()
        r.refusals, r.delivered_at = 0, now
        self._last_delivery = now
        if seconds is not None and nbytes > 0:
            sample = nbytes / max(seconds, 1e-6)
            r.rate = sample if r.rate <= 0 else (1 - RATE_ALPHA) * r.rate + RATE_ALPHA * sample
        self._trim()

    def refused(self, src: str, advertised: bool = False) -> bool:
        """Event: ``src`` refused a request (busy, not here). ``advertised``: it answered "not
        here" for a chunk its have-list shows. True when it is to be penalised now; its streak
        then starts again. Penalised: ``lie_limit`` advertised chunks refused in a row; or
        ``refuse_limit`` refusals in a row over at least ``refuse_window_s`` with nothing
        delivered by it meanwhile, while another source delivered, or while nothing at all was
        delivered for twice that window and no answer is arriving (``bodies``: every request
        of this node waits on refusals)."""
        r = self._rec(src)
        now = self.clock.monotonic()
        if r.refusals == 0:
            r.refused_since = now
            r.lies = 0
        r.refusals += 1
        r.lies += advertised
        others = self._last_delivery > max(r.refused_since, r.delivered_at)
        stalled = not self.bodies and now - max(self._last_delivery, r.refused_since) >= 2 * self.refuse_window_s
        if r.lies >= self.lie_limit or (
            r.refusals >= self.refuse_limit and now - r.refused_since >= self.refuse_window_s and (others or stalled)
        ):
            r.refusals = r.lies = 0
            return True
        return False

    def rate(self, src: str) -> float | None:
        """``src``'s measured rate in bytes/s, or None when none was measured."""
        r = self._src.get(src)
        return r.rate if r is not None and r.rate > 0 else None

    def median_rate(self, without: str | None = None) -> float | None:
        """The median measured rate (bytes/s) of the sources other than ``without``; None if none."""
        rates = sorted(r.rate for s, r in self._src.items() if r.rate > 0 and s != without)
        if not rates:
            return None
        mid = len(rates) // 2
        return rates[mid] if len(rates) % 2 else (rates[mid - 1] + rates[mid]) / 2

    def slow(self, src: str) -> bool:
        """Whether ``src`` is measured below ``slow_fraction`` of the others' median rate."""
        mine, median = self.rate(src), self.median_rate(without=src)
        return mine is not None and median is not None and mine < self.slow_fraction * median

    def lag_limit(self, nbytes: int, src: str) -> float | None:
        """Seconds after which a request of ``nbytes`` to ``src`` (asked with no wait) is
        lagging: what the others' median rate would take at ``slow_fraction`` of it, at least
        ``lag_min_s``; None while no other source was measured (nothing to compare with)."""
        median = self.median_rate(without=src)
        if median is None:
            return None
        return max(self.lag_min_s, nbytes / (self.slow_fraction * median))

    def lagging(self, src: str, nbytes: int, elapsed: float) -> bool:
        """Event and answer: a request of ``nbytes`` to ``src`` has run ``elapsed`` s. True when
        it is past :meth:`lag_limit`: ``src`` is then recorded at most that rate (so it is slow
        and asked last from now on) and the chunk is to be asked elsewhere."""
        limit = self.lag_limit(nbytes, src)
        if limit is None or elapsed < limit:
            return False
        r = self._rec(src)
        bound = nbytes / max(elapsed, 1e-6)
        r.rate = bound if r.rate <= 0 else min(r.rate, bound)
        return True

    def _trim(self, keep: int = 4096) -> None:
        """Bound the table: the records delivered least recently go first."""
        if len(self._src) > keep:
            for src, _r in sorted(self._src.items(), key=lambda kv: kv[1].delivered_at)[: len(self._src) - keep]:
                del self._src[src]
