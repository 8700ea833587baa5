"""Which sources to ask for one chunk, in which order: a pure policy (DESIGN.md, "Moving chunks").

No I/O, no asyncio: the fetcher (``bdn.daemon.fetch.fetcher``) executes what this decides, and a
fleet simulator can run the same code. Time comes from an injected clock, chance from an injected
``random.Random``.

One *round* over the sources, for a chunk of ``layer``:

1. *holders*: live peers whose have-bitfield shows the chunk, least loaded (fewest requests in
   flight from this node) first, ties broken at random. In the *endgame* (at most
   ``endgame_chunks`` chunks of the layer left, and two holders or more) the first two are asked
   at once and the first verified copy wins.
2. *owners*: the nodes by HRW rank for the chunk's digest (stored chunks only: rebuilt chunks are
   never in the bucket). The first is asked with ``?wait=chunk_wait_s`` (it fetches while the
   request is parked), the next ones with a 2 s wait; peers already asked this round are skipped.
   Reaching this node in the ranking ends the list with a :class:`ReadBucket` step: it reads the
   bucket if it is the owner (ranked first, or the owner of the live set at that moment, when the
   nodes above died during the round), else the round ends without a bucket read.

:class:`Rounds` decides what follows a round that found nothing: rounds in which peers only said
"busy" do not count (within ``owner_patience_s``); after ``tries`` counted rounds, the bucket is
read as a counted *fallback*.
"""

from __future__ import annotations

import random
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from bdn.daemon.clock import Clock
from bdn.daemon.layers import STORED
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
    """What :func:`owned_first` needs of a have-bitfield."""

    def __getitem__(self, i: int) -> bool: ...
    def clear_positions(self) -> Any: ...


YIELD_EVERY = 1024  # positions looked at before owned_first hands the event loop a turn


def owned_first(
    bits: Positions, refs: Sequence[Any], nodes: Sequence[str], self_id: str,
) -> Iterator[int | None]:
    """The positions of ``bits``'s clear bits, those whose chunk (``refs[i]``, or
    ``refs.digest(i)`` when the sequence has it) this node owns by HRW among ``nodes`` first, then
    the others, each part in manifest order.

    Lazy and compact, for layers of millions of chunks: the owners are computed as the positions
    are drawn (so no step takes long), the deferred positions are kept in a 4-byte array, and a
    position whose bit got set meanwhile is skipped. Several workers may draw from one iterator.
    ``None`` is drawn after every ``YIELD_EVERY`` positions looked at without a result: the drawer
    gives the event loop a turn (``await asyncio.sleep(0)``) and draws again.
    """
    digest = getattr(refs, "digest", None) or (lambda i: refs[i].digest)
    missing = bits.clear_positions()
    if len(nodes) <= 1:
        yield from _paced(missing, lambda i: not bits[i])
        return
    later = array("I")

    def owned(i: int) -> bool:
        if bits[i]:
            return False
        if hrw.owner(nodes, digest(i)) == self_id:
            return True
        later.append(i)
        return False

    yield from _paced(missing, owned)
    yield from _paced(later, lambda i: not bits[i])


#: Above this many missing chunks ``split_owned`` keeps manifest order (no full pass up front).
ORDER_LIMIT = 1 << 18


def split_owned(
    bits: Positions, nodes: Sequence[str], self_id: str, rng: random.Random, owner_of: Callable[[int], str | None],
) -> tuple[Iterator[int | None], Iterator[int | None]]:
    """``(owned, others)``: the clear positions of ``bits`` whose chunk this node owns
    (``owner_of(i)``, among ``nodes``: it reads those from the bucket), in manifest order, and
    the rest, in the order the fleet is expected to have them: by their place in their owner's
    own list (every owner reads its chunks in manifest order, one after another), ties in a
    random order of this node's own, so that the nodes ask for each owner's next chunk as it
    appears, and not all for the same one. Both lazy as :func:`owned_first` (``None`` = give the
    loop a turn).

    A layer with more than ``ORDER_LIMIT`` missing chunks keeps manifest order for ``others``
    (no full pass over the manifest before the first request)."""
    if len(nodes) <= 1:
        return _paced(bits.clear_positions(), lambda i: not bits[i]), iter(())
    missing = bits.clear_positions()
    if len(missing) > ORDER_LIMIT:
        return (_paced(missing, lambda i: not bits[i] and owner_of(i) == self_id),
                _paced(bits.clear_positions(), lambda i: not bits[i] and owner_of(i) != self_id))
    mine, theirs = array("I"), []
    place: dict[str | None, int] = {}
    for i in missing:
        i = int(i)
        o = owner_of(i)
        if o == self_id:
            mine.append(i)
        else:
            k = place.get(o, 0)
            place[o] = k + 1
            theirs.append((k, rng.random(), i))
    theirs.sort()
    return _paced(mine, lambda i: not bits[i]), _paced(array("I", (i for _, _, i in theirs)), lambda i: not bits[i])


def pick_steal(remaining: Mapping[str, Sequence[int]], margin: int) -> tuple[str, int] | None:
    """The chunk a node whose own bucket reads are all done reads for another owner, or None.

    ``remaining[owner]``: positions (ascending: an owner reads its chunks in manifest order) of
    that owner's chunks that nobody holds or announced reading yet. The owner with the most of
    them gives up its **last** one, if it has more than ``margin`` (the ones at its front are
    the ones it is about to read). Owners do not progress evenly (the N = 4 and 8 timelines: one
    owner's reads ended 5-9 s after another's), and the last owner's uplink alone then carries
    its last chunks to every other node: the tail (bench/NOTES.md)."""
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
#: the 8 streams and each took twice as long to complete and be forwarded (bench/NOTES.md).
MIN_PART = 512 << 10


def bucket_parts(length: int, streams: int) -> list[tuple[int, int]]:
    """How one chunk of ``length`` bytes is read from the bucket: ``(offset, length)`` ranges
    within it, at most ``streams`` (``bucket_concurrency``) of at least ``MIN_PART`` bytes each
    (one for a small chunk), covering it exactly, in order. They are read in parallel and one
    chunk at a time, so an owner's chunks complete one after another at its whole share of the
    bucket (bench/NOTES.md, the N = 8 timeline)."""
    n = max(1, min(streams, length // MIN_PART))
    step = -(-length // n)
    return [(o, min(step, length - o)) for o in range(0, length, step)]


def endgame(left: int, holders: int, endgame_chunks: int) -> bool:
    """True when ``left`` chunks remain (<= ``endgame_chunks``) and at least two holders exist."""
    return holders >= 2 and left <= endgame_chunks


def holders(live: Iterable[PeerView], has: Iterable[str], rng: random.Random) -> list[PeerView]:
    """The live peers whose urls are in ``has`` (their have-bitfield shows the chunk), least loaded first."""
    hs = set(has)
    out = [p for p in live if p.url in hs]
    out.sort(key=lambda p: (p.inflight, rng.random()))
    return out


def plan_holders(
    ranked_holders: Sequence[PeerView], left: int, endgame_chunks: int,
) -> tuple[list[PeerView], list[Ask]]:
    """``(race, asks)``: the holders to ask at once (endgame, else none) and then one by one."""
    if endgame(left, len(ranked_holders), endgame_chunks):
        return list(ranked_holders[:2]), [Ask(p, 0.0) for p in ranked_holders[2:]]
    return [], [Ask(p, 0.0) for p in ranked_holders]


def plan_owners(
    self_id: str, live: Iterable[PeerView], digest: str, layer: str, tried: set[str], chunk_wait_s: float,
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
    step: ReadBucket, self_id: str, live_nodes: Iterable[str], digest: str, owner_now: str | None = None,
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
