"""A bounded peer set per snapshot: a bitfield once per connection, then HAVEs; chunks picked in
bdnd's own order (``bdn.daemon.fetch.policy.chunk_order``: each owner's next chunk first).

Source: BitTorrent (BEP 3: ``bitfield`` once after the handshake, then ``have`` per piece) and
Kraken's scheduler (a capped set of connections per torrent; ``dispatch/piecerequest``: which
piece next is a pure function of bitsets and counts). The order itself is bdnd's, not
rarest-first: in this fleet every chunk starts at one holder, its owner (measured:
``policy.chunk_order``).

Each daemon works, per snapshot, with at most ``max_peers`` peers: it dials until it has
``k`` (a few of them bucket readers, ``reader_slots``, so fresh chunks enter its neighbourhood
first-hand) and accepts inbound connections up to ``max_peers``. A connection starts with
one BITFIELD each way; after that each side pushes HAVE messages, batched: chunks that arrived
since the last flush go to every peer at most once per ``have_flush_s`` (one message per peer
per flush, however many chunks). Dead peers are dropped at once and replaced at the next
:meth:`PeerSet.refresh`; so are peers that have been useless for ``idle_s`` while this node
still needs chunks (a complete peer stays: it is a seed).

**Endgame** (``endgame_chunks``, bdnd's key of the same name and its rule,
``bdn.daemon.fetch.policy.endgame``): once at most that many chunks are missing, a chunk already
asked of one holder is asked of a second holder too (a race: the first verified copy wins, the
caller cancels the other). At the end of a snapshot every node wants the same last chunks, and
a request queued behind a holder's full upload slots otherwise waits there for a whole copy
while a peer that just announced the chunk has slots free.

Memory: four bool arrays (held, in flight, owned, announced) and an availability count per chunk, plus one
bitfield per peer: O(K * chunks / 8) bytes, independent of N.

Pure: the caller's transport delivers BITFIELD/HAVE messages; time comes from ``clock``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from bdn.control import Now
from bdn.daemon.fetch.policy import chunk_order, endgame, holder_key, tiebreak

MAX_PEERS_HARD = 256
RACE = 2  # holders asked at once for one chunk in the endgame (bdnd: the first two)


class PeerSetError(ValueError):
    """A malformed BITFIELD or HAVE from a peer (untrusted input)."""


def pack_bits(bits: np.ndarray) -> bytes:
    """Bool array -> bytes, BitTorrent bit order (MSB of byte 0 is chunk 0)."""
    return np.packbits(bits.astype(np.uint8)).tobytes()


def unpack_bits(data: bytes, n: int) -> np.ndarray:
    """Bytes (BitTorrent bit order) -> bool array of ``n``; spare bits are ignored.

    Raises:
        PeerSetError: the length is not ``ceil(n / 8)`` bytes.
    """
    if len(data) != (n + 7) // 8:
        raise PeerSetError(f"bitfield of {n} chunks needs {(n + 7) // 8} bytes, got {len(data)}")
    return np.unpackbits(np.frombuffer(data, dtype=np.uint8), count=n).astype(bool)


@dataclass
class _Peer:
    have: np.ndarray  # bool per chunk
    since: float
    last_useful: float
    pending_have: list[int]
    reader: bool = False
    seen_live: bool = False  # counted live by this node's membership at some refresh


class PeerSet:
    """One node's peers for one snapshot of ``n_chunks`` chunks.

    ``owned``: bool per chunk, True where this node is the chunk's owner (it reads those from
    the bucket itself; :meth:`pick` never asks peers for them unless ``include_owned``).
    """

    def __init__(
        self,
        self_id: str,
        n_chunks: int,
        clock: Now,
        *,
        rng: random.Random | None = None,
        k: int = 16,
        max_peers: int = 32,
        reader_slots: int = 4,
        have_flush_s: float = 0.1,
        idle_s: float = 10.0,
        owned: Sequence[bool] | None = None,
        endgame_chunks: int = 0,
    ) -> None:
        if not 0 < k <= max_peers <= MAX_PEERS_HARD:
            raise ValueError("need 0 < k <= max_peers <= 256")
        self.self_id = self_id
        self.n = n_chunks
        self.clock = clock
        self.rng = rng or random.Random()
        self.k, self.max_peers, self.reader_slots = k, max_peers, reader_slots
        self.have_flush_s, self.idle_s = have_flush_s, idle_s
        self.endgame_chunks = endgame_chunks
        self.asked: dict[int, set[str]] = {}  # chunk -> peers asked for it now (picks in flight)
        self.held = np.zeros(n_chunks, dtype=bool)
        self.inflight = np.zeros(n_chunks, dtype=bool)
        self.announced = np.zeros(n_chunks, dtype=bool)  # HAVE sent before the chunk was whole
        self.owned = np.zeros(n_chunks, dtype=bool) if owned is None else np.asarray(owned, dtype=bool).copy()
        self.avail = np.zeros(n_chunks, dtype=np.int32)
        # Ties go by a random order of this set's own (``policy.tiebreak``: a keyed bijection of
        # the position, computed for the candidates only: a permutation array of 10^6 chunks took
        # 60-70 ms on the daemon's event loop and 8 bytes per chunk).
        self._salt = self.rng.getrandbits(64)
        #: Each chunk's place in its owner's read list (``policy.owner_places``; the caller sets
        #: it when the owners change; None: all 0): the chunk order's key.
        self.place: np.ndarray | None = None
        self.peers: dict[str, _Peer] = {}
        self._next_flush = clock()
        self.messages_out = 0  # BITFIELD + HAVE messages this set asked to send (a metric)

    # ---- reads -------------------------------------------------------------------------------
    @property
    def complete(self) -> bool:
        return bool(self.held.all())

    def missing(self) -> int:
        return int(self.n - self.held.sum())

    def holders(self, idx: int) -> list[str]:
        return [p for p, s in self.peers.items() if s.have[idx]]

    def state_bytes(self) -> int:
        """Control-state bytes: our arrays plus one packed bitfield per peer."""
        per_peer = (self.n + 7) // 8 + 64
        return 4 * self.n + 4 * self.n + len(self.peers) * per_peer

    def have_bits(self) -> np.ndarray:
        """What a new peer's BITFIELD tells: the chunks held, and those announced while they
        arrive (:meth:`announce`; :meth:`got` sends no second HAVE for them, so a peer that
        connected in between would otherwise never learn of them)."""
        return self.held | self.announced

    def bitfield(self) -> bytes:
        return pack_bits(self.have_bits())

    # ---- membership of the set ---------------------------------------------------------------
    def refresh(
        self, live: Sequence[str], readers: Iterable[str] = (), is_live: Callable[[str], bool] | None = None
    ) -> list[str]:
        """Drop peers no longer live (and long-useless ones), choose new ones up to ``k``.

        ``live``: the membership's live node ids; ``is_live``: an O(1) test of the same set
        (built from ``live`` when not given). New peers are drawn at random from ``live``.
        Returns the node ids to dial (each gets this node's BITFIELD: :meth:`bitfield`).

        "No longer live" means counted live here once and not now (it died or left). A peer
        that connected to this node (:meth:`accept`) before this node's membership counts it
        (a joiner still on SWIM probation here, :mod:`bdn.control.probation`) stays: its open
        connection is first-hand evidence that it runs, and its death resets the connection
        (the caller's :meth:`remove`). Dropping it at every refresh would cut late joiners off
        from the HAVEs of the peers they had dialed (docs/decisions/0021-peer-set-keeps-accepted-joiners.md).
        """
        now = self.clock()
        if is_live is None:
            live_set = set(live)
            is_live = live_set.__contains__
        gone = []
        for p, s in self.peers.items():
            if is_live(p):
                s.seen_live = True
            elif s.seen_live:
                gone.append(p)
        for p in gone:
            self.remove(p)
        if not self.complete:
            for p, s in list(self.peers.items()):
                if not s.have.all() and now - s.last_useful >= self.idle_s and now - s.since >= self.idle_s:
                    self.remove(p)
        want = self.k - len(self.peers)
        if want <= 0:
            return []
        dial: list[str] = []
        have_readers = sum(1 for s in self.peers.values() if s.reader)
        rs = [r for r in readers if r != self.self_id and r not in self.peers and is_live(r)]
        if have_readers < self.reader_slots and rs:
            dial += self.rng.sample(rs, min(len(rs), self.reader_slots - have_readers, want))
        dial += self._draw(live, want - len(dial), set(dial))
        reader_set = set(rs)
        for p in dial:
            self._add(p, now, p in reader_set)
            self.peers[p].seen_live = True
        self.messages_out += len(dial)
        return dial

    def _draw(self, live: Sequence[str], need: int, taken: set[str]) -> list[str]:
        """``need`` random members of ``live`` not yet peers: O(need) draws in a large fleet."""
        if need <= 0 or not live:
            return []
        out: list[str] = []
        if len(live) > 4 * (len(self.peers) + need + 1):
            for _ in range(8 * need):
                n = live[self.rng.randrange(len(live))]
                if n != self.self_id and n not in self.peers and n not in taken:
                    taken.add(n)
                    out.append(n)
                    if len(out) >= need:
                        break
            return out
        others = [n for n in live if n != self.self_id and n not in self.peers and n not in taken]
        return self.rng.sample(others, min(need, len(others)))

    def accept(self, peer: str, is_reader: bool = False) -> bool:
        """An inbound connection: True if taken (then answer with :meth:`bitfield`)."""
        if peer == self.self_id:
            return False
        if peer in self.peers:
            return True
        if len(self.peers) >= self.max_peers:
            return False
        self._add(peer, self.clock(), is_reader)
        self.messages_out += 1
        return True

    def _add(self, peer: str, now: float, reader: bool) -> None:
        self.peers[peer] = _Peer(np.zeros(self.n, dtype=bool), now, now, [], reader)

    def remove(self, peer: str) -> None:
        s = self.peers.pop(peer, None)
        if s is not None:
            self.avail -= s.have

    # ---- what peers tell us ------------------------------------------------------------------
    def on_bitfield(self, peer: str, data: bytes | np.ndarray) -> None:
        """The peer's BITFIELD (bytes from the wire, or a bool array from a simulator).

        Raises:
            PeerSetError: wrong length.
        """
        s = self.peers.get(peer)
        if s is None:
            return
        bits = unpack_bits(data, self.n) if isinstance(data, (bytes, bytearray)) else np.asarray(data, dtype=bool)
        if bits.shape != (self.n,):
            raise PeerSetError(f"bitfield of {bits.shape} for {self.n} chunks")
        self.avail += bits.astype(np.int32) - s.have
        s.have = bits.copy()
        if (bits & ~self.held).any():
            s.last_useful = self.clock()

    def on_have(self, peer: str, indexes: Iterable[int]) -> None:
        """The peer's HAVE: chunk indexes it now holds.

        Raises:
            PeerSetError: an index out of range.
        """
        s = self.peers.get(peer)
        if s is None:
            return
        for i in indexes:
            if not isinstance(i, int) or not 0 <= i < self.n:
                raise PeerSetError(f"HAVE index {i!r} outside 0..{self.n - 1}")
            if not s.have[i]:
                s.have[i] = True
                self.avail[i] += 1
                if not self.held[i]:
                    s.last_useful = self.clock()

    # ---- what we do --------------------------------------------------------------------------
    def got(self, idx: int) -> None:
        """Chunk ``idx`` arrived here and was verified: queue a HAVE for every peer (unless
        :meth:`announce` did already)."""
        self.inflight[idx] = False
        self.asked.pop(idx, None)
        if self.held[idx]:
            return
        self.held[idx] = True
        if self.announced[idx]:
            return
        for s in self.peers.values():
            if not s.have[idx]:
                s.pending_have.append(idx)

    def announce(self, idx: int) -> None:
        """Chunk ``idx`` is arriving here and is served while it arrives (forwarded piece by piece
        as each is verified: a simulated chunk of several real ones, or cut-through behind a
        bucket read): queue its HAVE now, once; :meth:`got` then sends none."""
        if self.held[idx] or self.announced[idx]:
            return
        self.announced[idx] = True
        for s in self.peers.values():
            if not s.have[idx]:
                s.pending_have.append(idx)

    def withdraw(self, idx: int) -> None:
        """The copy of chunk ``idx`` that :meth:`announce` announced failed before it was whole:
        its HAVEs not sent yet are dropped (the caller tells the peers that got one: they call
        :meth:`on_withdraw`); a later :meth:`got` announces it again."""
        if not self.announced[idx] or self.held[idx]:
            return
        self.announced[idx] = False
        for s in self.peers.values():
            if idx in s.pending_have:
                s.pending_have.remove(idx)

    def on_withdraw(self, peer: str, idx: int) -> None:
        """``peer`` no longer serves chunk ``idx`` (its announced copy failed before it was whole).

        Raises:
            PeerSetError: an index out of range.
        """
        if not isinstance(idx, int) or not 0 <= idx < self.n:
            raise PeerSetError(f"withdrawn index {idx!r} outside 0..{self.n - 1}")
        s = self.peers.get(peer)
        if s is not None and s.have[idx]:
            s.have[idx] = False
            self.avail[idx] -= 1

    def failed(self, idx: int, peer: str | None = None) -> None:
        """A request for chunk ``idx`` (to ``peer``, when it was a pick) failed: it may be picked
        again, unless an endgame race still has a request for it at another holder."""
        asked = self.asked.get(idx)
        if asked is not None and peer is not None:
            asked.discard(peer)
            if asked:
                return
        self.asked.pop(idx, None)
        self.inflight[idx] = False

    def flush_haves(self, force: bool = False) -> dict[str, list[int]]:
        """At most every ``have_flush_s``: peer -> chunk indexes to send in one HAVE message."""
        now = self.clock()
        if not force and now < self._next_flush:
            return {}
        self._next_flush = now + self.have_flush_s
        out = {p: s.pending_have for p, s in self.peers.items() if s.pending_have}
        for p in out:
            self.peers[p].pending_have = []
        self.messages_out += len(out)
        return out

    def next_flush(self) -> float:
        return self._next_flush

    def pick(
        self,
        limit: int,
        load: dict[str, int] | None = None,
        max_per_peer: int = 4,
        include_owned: bool = False,
        slow: Callable[[str], bool] | None = None,
    ) -> list[tuple[int, str]]:
        """Up to ``limit`` (chunk index, peer) requests, in bdnd's chunk order
        (``bdn.daemon.fetch.policy.chunk_order`` over :attr:`place` and this set's tiebreak: the
        order bdnd's fetcher draws in) among the chunks a peer with a free slot holds, each from
        the best holder by
        bdnd's own rule (``bdn.daemon.fetch.policy.holder_key``: ``slow`` sources last, e.g.
        ``SourceBook.slow``; bucket readers only when no other holder of the chunk has a free
        slot; least loaded).

        ``load``: requests in flight per peer (from this node); peers at ``max_per_peer`` are
        skipped. Marks the picked chunks in flight (:meth:`got` or :meth:`failed` clear it).
        In the endgame (:func:`endgame`) a chunk in flight at one holder is picked again from a
        second one (the caller races the two and cancels the loser).
        """
        if limit <= 0 or not self.peers:
            return []
        load = dict(load or {})
        # peers with a free slot (a pick only takes slots, so none frees up during this call)
        elig = [
            (p, s.have, s.reader, slow is not None and slow(p))
            for p, s in self.peers.items()
            if load.get(p, 0) < max_per_peer
        ]
        if not elig:
            return []
        out = self._pick_new(limit, load, max_per_peer, include_owned, elig)
        if self.endgame_chunks > 0 and len(out) < limit:
            out += self._pick_race(limit - len(out), load, max_per_peer, include_owned, elig)
        return out

    def _pick_race(
        self, limit: int, load: dict[str, int], max_per_peer: int, include_owned: bool, elig: list
    ) -> list[tuple[int, str]]:
        """Endgame: second holders for the chunks asked of one holder only."""
        left = self.n - int(self.held.sum())
        if left > self.endgame_chunks:
            return []
        cand = self.inflight & ~self.held & (self.avail >= RACE)
        if not include_owned:
            cand &= ~self.owned
        out: list[tuple[int, str]] = []
        for i in np.flatnonzero(cand).tolist():
            asked = self.asked.get(i)
            if asked is None or len(asked) >= RACE:  # not a pick of ours (an owner ask, a read)
                continue
            if not endgame(left, int(self.avail[i]), self.endgame_chunks):
                continue
            best, best_key = None, holder_key(True, max_per_peer, True)
            for p, have, _reader, slow in elig:
                ld = load.get(p, 0)
                key = holder_key(slow, ld)
                if have[i] and p not in asked and ld < max_per_peer and key < best_key:
                    best, best_key = p, key
            if best is None:
                continue
            best_load = best_key[2]
            load[best] = best_load + 1
            asked.add(best)
            out.append((i, best))
            if len(out) >= limit:
                break
        return out

    def _pick_new(
        self, limit: int, load: dict[str, int], max_per_peer: int, include_owned: bool, elig: list
    ) -> list[tuple[int, str]]:
        cand = ~self.held & ~self.inflight & (self.avail > 0)
        if not include_owned:
            cand &= ~self.owned
        if len(elig) <= len(self.peers) // 2:  # only what a peer with a free slot holds
            held_by = np.zeros(self.n, dtype=bool)
            for _p, have, _r, _s in elig:
                held_by |= have
            cand &= held_by
        idxs = np.flatnonzero(cand)
        if idxs.size == 0:
            return []
        place = self.place[idxs] if self.place is not None else np.zeros(idxs.size, dtype=np.int32)
        order = idxs[chunk_order(place, tiebreak(idxs, self._salt))]
        avail = self.avail
        out: list[tuple[int, str]] = []
        for i in order.tolist():
            # a bucket reader's upload slots carry the chunks nobody else has yet: a chunk
            # another peer holds too is taken from a non-reader when one has a free slot
            spare_readers = avail[i] > 1
            best, best_key, best_load = None, holder_key(True, max_per_peer, True), max_per_peer
            for p, have, reader, slow in elig:
                if have[i]:
                    ld = load.get(p, 0)
                    key = holder_key(slow, ld, reader and spare_readers)
                    if ld < max_per_peer and key < best_key:
                        best, best_key, best_load = p, key, ld
                        if key == (False, False, 0):
                            break
            if best is None:
                continue
            load[best] = best_load + 1
            self.inflight[i] = True
            self.asked[i] = {best}
            out.append((i, best))
            if len(out) >= limit:
                break
        return out

    def unavailable(self, include_owned: bool = False) -> np.ndarray:
        """Indexes of chunks still needed that no peer in the set holds (ask their owners)."""
        cand = ~self.held & ~self.inflight & (self.avail == 0)
        if not include_owned:
            cand &= ~self.owned
        return np.flatnonzero(cand)

    def mark_inflight(self, idx: int) -> None:
        """Chunk ``idx`` is being fetched other than by a pick (its owner asked, the bucket read)."""
        self.inflight[idx] = True
        self.asked.pop(idx, None)
