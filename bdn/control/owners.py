"""Who reads each chunk from the bucket: HRW owners over the live set, computed once per epoch.

Source: rendezvous hashing (:mod:`bdn.proto.hrw`). Two refinements for large fleets:

- **Bucket readers.** A bucket serves ``aggregate_bps`` in total and ``per_connection_bps`` per
  connection, so ``ceil(headroom * aggregate / per_connection)`` connections saturate it (100 at
  10 GB/s and 100 MB/s; ``headroom`` 1.5 keeps it saturated while some finish). With one reader
  per node, N = 10,000 owners would each read one slow connection and every chunk would finish
  at the very end, with nothing left to overlap. So only the top ``readers`` nodes by HRW score
  of the snapshot's identity read from the bucket (each with ``connections_per_reader``
  connections), and a chunk's owner is the HRW top among those readers. The reader set differs
  per snapshot, so the role rotates over the fleet.
- **Reader slots** (a subset of readers): a snapshot has ``readers`` slots; its chunks are
  split over the slots by bounded loads (manifest order, shares equal within one chunk, the
  same whatever the membership); slot ``k`` is read by the live node ranked highest by HRW
  score of ``"readers" NUL identity NUL k`` that no lower slot holds. So the readers' shares
  are equal (plain HRW among 5 readers split 128 chunks 21 / 24 / 26 / 26 / 31 for the
  node ids of the N = 10,000 simulation, and the reader with 31 read last, alone:
  docs/decisions/0002-bucket-reader-slots.md), and a reader's death or a joiner that outranks one moves one slot's
  chunks only, to the node that holds that slot next (HRW's minimal disruption, per slot).
- **Bounded loads** when every live node reads (Mirrokni, Thorup, Zadimoghaddam, "Consistent
  Hashing with Bounded Loads", SODA 2018, applied to HRW): given the snapshot's digests in
  manifest order, each goes to the first node of its HRW ranking holding fewer than
  ``ceil(distinct digests / nodes)``; plain HRW among a subset of readers
  (:func:`readers_and_rule` says why). With
  a few hundred chunks over a few readers plain HRW's shares differ by +-30 %, and the reader
  with most chunks reads last, alone (docs/decisions/0001-owners-hrw-bounded-loads.md); bounded shares are equal
  within one chunk. Above ``MAX_WORK`` hashes (millions of chunks) plain HRW is used, whose
  shares are even at that size anyway. This is the one owner rule: bdnd's fetcher
  (``bdn.daemon.fetch.owners``) and the fleet simulator both call it.
- **Once per epoch.** :class:`OwnerMap` is built from one membership epoch's live set; its
  owner lookups are memoised per chunk and the whole map is rebuilt only when the live set
  changes (``epoch`` differs), never per request: no ``chunks x N`` hashing before bytes move.

Pure: no clock is needed (the epoch is the caller's membership epoch).
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Callable, Container, Sequence

from bdn.proto import hrw

#: Largest ``distinct digests x readers`` a bounded table is computed for; beyond, plain HRW.
MAX_WORK = 1 << 21


def bounded(digests: Sequence[str], nodes: Sequence[str]) -> dict[str, str]:
    """``digest -> owner`` for the distinct ``digests`` (taken in the order given): each to the
    first node of its HRW ranking among ``nodes`` holding fewer than ``ceil(distinct / nodes)``.
    ``nodes`` must not be empty. Cost: one HRW ranking per distinct digest."""
    order = list(dict.fromkeys(digests))
    cap = -(-len(order) // len(nodes))
    load = dict.fromkeys(nodes, 0)
    out: dict[str, str] = {}
    for d in order:
        for n in hrw.rank(nodes, d):
            if load[n] < cap:
                load[n] += 1
                out[d] = n
                break
    return out


def owner_table(digests: Sequence[str] | None, nodes: Sequence[str]) -> dict[str, str]:
    """The bounded table of :func:`bounded`, or ``{}`` (plain HRW) when there are no digests,
    at most one node, or more than ``MAX_WORK`` hashes to compute."""
    if not digests or len(nodes) <= 1 or len(digests) * len(nodes) > MAX_WORK:
        return {}
    return bounded(digests, nodes)


def reader_count(
    live_n: int,
    aggregate_bps: float,
    per_connection_bps: float,
    connections_per_reader: int = 1,
    headroom: float = 1.5,
) -> int:
    """How many nodes read a snapshot from the bucket: enough connections to saturate it.

    ``aggregate_bps``/``per_connection_bps``: bytes per second (0 = unlimited per connection:
    then every live node reads). Returns an integer in ``[1, live_n]`` (0 when ``live_n`` is 0).
    """
    if live_n <= 0:
        return 0
    if per_connection_bps <= 0 or aggregate_bps <= 0:
        return live_n
    conns = math.ceil(headroom * aggregate_bps / per_connection_bps)
    return max(1, min(live_n, math.ceil(conns / max(1, connections_per_reader))))


def _ranked(score: Callable[[str, str], int], key: str, node: str) -> tuple[int, str]:
    return (score(node, key), node)


def slot_key(identity: str, k: int) -> str:
    """The HRW key of reader slot ``k`` of snapshot ``identity``."""
    return f"readers\x00{identity}\x00{k}"


def reader_slots(
    identity: str, live: Sequence[str], slots: int, score: Callable[[str, str], int] = hrw.score, spare: int = 3
) -> list[list[str]]:
    """Per reader slot ``k`` (``0 <= k < slots``, ``slots < len(live)``), its holder and then
    its next candidates: slot ``k`` ranks ``live`` by ``score(node, slot_key(identity, k))``
    (ties by node id) and is held by its best node that no lower slot holds; the candidates
    after the holder (up to ``spare``) hold no other slot, and the first of them is who holds
    the slot when the holder dies (unless it ranks first for a lower slot too: a chance of about
    ``slots / len(live)``). ``score``: :func:`bdn.proto.hrw.score`, or a cached copy of it.
    Cost: ``slots x len(live)`` scores."""
    tops = []
    for k in range(slots):
        key = slot_key(identity, k)
        tops.append(heapq.nlargest(slots + spare, live, key=functools.partial(_ranked, score, key)))
    holders: list[str] = []
    for top in tops:
        h = next((n for n in top if n not in holders), None)
        if h is not None:
            holders.append(h)
    held = set(holders)
    return [[h] + [n for n in top if n not in held][:spare] for h, top in zip(holders, tops)]


def slot_table(digests: Sequence[str], slots: int) -> dict[str, int]:
    """``digest -> slot`` for the distinct ``digests`` (manifest order): bounded loads over the
    slots (:func:`bounded`), so each slot reads ``ceil(distinct / slots)`` chunks or one fewer;
    ``{}`` above ``MAX_WORK`` hashes (then :func:`slot_of`'s plain HRW, even at that size)."""
    if not digests or slots <= 0 or len(digests) * slots > MAX_WORK:
        return {}
    return {d: int(k) for d, k in bounded(digests, [str(k) for k in range(slots)]).items()}


def slot_of(digest: str, slots: int, table: dict[str, int] | None = None) -> int:
    """The reader slot of ``digest``: from ``table`` (:func:`slot_table`), else plain HRW over the slots."""
    k = table.get(digest) if table else None
    return k if k is not None else int(hrw.owner([str(i) for i in range(slots)], digest) or 0)


def readers_of(identity: str, live: Sequence[str], readers: int | None) -> list[str]:
    """The ``readers`` nodes of ``live`` that read snapshot ``identity`` from the bucket: the
    holders of its reader slots, in slot order (:func:`reader_slots`; None or 0, or at least
    ``len(live)``: all of ``live``, in the order given). The same on every daemon with the same
    live set."""
    if not readers or readers >= len(live):
        return list(live)
    return [c[0] for c in reader_slots(identity, live, readers)]


def readers_and_rule(identity: str, live: Sequence[str], readers: int | None) -> tuple[list[str], bool]:
    """The one owner rule's two parts: the snapshot's readers (:func:`readers_of`) and whether
    owners among them are bounded-load (:func:`owner_table`) or plain HRW.

    Bounded loads when every live node reads (small fleets: equal shares, so no owner reads
    last alone); reader slots among a subset of readers (large fleets; the second value False):
    equal shares too, and a reader's death or arrival moves only that reader's slot, while
    bounded caps over the readers themselves would move chunks between the surviving readers
    too, each one more chunk that two daemons with different views may both read. The owner of
    a chunk is then ``readers[slot_of(digest, len(readers), slot_table(digests, len(readers)))]``.
    """
    rs = readers_of(identity, live, readers)
    return rs, len(rs) >= len(live)


class OwnerMap:
    """Owners of one snapshot's chunks for one membership epoch.

    ``live``: node ids of the epoch (this daemon included). ``identity``: the snapshot's
    identity (picks its readers). ``readers``: how many read from the bucket (see
    :func:`reader_count`; ``None`` = all). ``digests``: the snapshot's (or layer's) chunk
    digests in manifest order: owners are then bounded-load HRW when every live node reads
    (:func:`readers_and_rule`); otherwise reader slots (:func:`reader_slots`, :func:`slot_table`;
    without digests plain HRW over the slots). Keys are chunk digests (hex strings).
    """

    def __init__(
        self,
        epoch: int,
        live: Sequence[str],
        identity: str,
        readers: int | None = None,
        digests: Sequence[str] | None = None,
    ) -> None:
        self.epoch = epoch
        self.live = tuple(sorted(set(live)))
        n = len(self.live) if readers is None else max(0, min(readers, len(self.live)))
        self._identity = identity
        every = n >= len(self.live)  # readers_and_rule: every live node reads
        self._cands: list[list[str]] = [] if every or n == 0 else reader_slots(identity, self.live, n)
        if every:
            self.readers = tuple(hrw.rank(self.live, "readers\x00" + identity))
        else:
            self.readers = tuple(c[0] for c in self._cands)  # = readers_of(), in slot order
        self._reader_set = frozenset(self.readers)
        bounded = bool(self.readers) and every
        self._owner: dict[str, str | None] = dict(owner_table(digests, self.readers)) if bounded else {}
        self.bounded = bool(self._owner)
        self._slots = {} if every else slot_table(digests or (), len(self.readers))

    def affected_by(self, node: str) -> bool:
        """Would a change of ``node``'s standing (joined, died) change any owner?

        Owners are HRW (bounded or not) over the readers only, so only a reader leaving, or a
        joiner that ranks among the readers, moves any; while every live node is a reader, any
        change does. Lets a caller keep this map across epochs without recomputing the live set.
        """
        if node in self._reader_set or len(self.readers) >= len(self.live) or not self.readers:
            return True
        for k, h in enumerate(self.readers):  # would it outrank a slot's holder?
            key = slot_key(self._identity, k)
            if (hrw.score(node, key), node) > (hrw.score(h, key), h):
                return True
        return False

    def is_reader(self, node: str) -> bool:
        return node in self._reader_set

    def owner(self, digest: str) -> str | None:
        """The reader that fetches ``digest`` from the bucket (None with no live readers)."""
        o = self._owner.get(digest, "")
        if o == "":
            if self._cands:
                o = self.readers[slot_of(digest, len(self.readers), self._slots)]
            else:
                o = hrw.owner(self.readers, digest)
            self._owner[digest] = o
        return o

    def ranked(self, digest: str) -> list[str]:
        """Nodes from owner to last fallback for ``digest``: the owner, then the HRW ranking
        (with bounded loads the owner may be below the ranking's top); with reader slots the
        slot's holder, then its next candidates (who hold the slot when the holder dies)."""
        if self._cands:
            return list(self._cands[slot_of(digest, len(self.readers), self._slots)])
        r = hrw.rank(self.readers, digest)
        if self.bounded:
            o = self.owner(digest)
            if o is not None and r and r[0] != o:
                r.remove(o)
                r.insert(0, o)
        return r

    def acting_owner(self, digest: str, unreachable: Container[str] = ()) -> str | None:
        """The owner, or when this node found it unreachable (connection refused or reset: a
        local, certain signal, long before membership agrees it is dead) the next reader by
        rank that is not: that reader takes the chunk over after checking the owner itself.
        """
        for n in self.ranked(digest):
            if n not in unreachable:
                return n
        return None

    def former_owner(self, digest: str, node: str) -> str | None:
        """The reader ranked right below ``node`` for ``digest``: who owned it before ``node``
        became a reader (it joined late, or a reader above it died). A new owner asks it first,
        so a chunk already read or being read is not read from the bucket twice."""
        r = self.ranked(digest)
        if node in r:
            i = r.index(node)
            return r[i + 1] if i + 1 < len(r) else None
        return None

    def owned_by(self, node: str, digests: Sequence[str]) -> list[int]:
        """Indexes into ``digests`` that ``node`` owns, in order."""
        if node not in self._reader_set:
            return []
        return [i for i, d in enumerate(digests) if self.owner(d) == node]


class OwnerCache:
    """The current :class:`OwnerMap` per snapshot, rebuilt only when the epoch changes."""

    def __init__(self, max_snapshots: int = 8) -> None:
        self._maps: dict[str, OwnerMap] = {}
        self._max = max_snapshots
        self.rebuilds = 0

    def get(
        self,
        epoch: int,
        live: Sequence[str],
        identity: str,
        readers: int | None = None,
        digests: Sequence[str] | None = None,
    ) -> OwnerMap:
        """The map for ``identity`` at ``epoch`` (``digests``: see :class:`OwnerMap`; a map is
        rebuilt when the epoch or the reader count changes, not when only ``digests`` is given)."""
        m = self._maps.get(identity)
        if m is None or m.epoch != epoch or (readers is not None and len(m.readers) != min(readers, len(m.live))):
            m = OwnerMap(epoch, live, identity, readers, digests)
            self.rebuilds += 1
            self._maps.pop(identity, None)
            self._maps[identity] = m
            while len(self._maps) > self._max:
                self._maps.pop(next(iter(self._maps)))
        return m
