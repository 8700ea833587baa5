"""Who reads which chunk of a layer from the bucket: HRW with bounded loads (pure, no I/O).

Source: Mirrokni, Thorup, Zadimoghaddam, "Consistent Hashing with Bounded Loads" (SODA 2018),
applied to rendezvous hashing (bdn.proto.hrw): keys are taken in a fixed order (here the
manifest's), and each goes to the first node of its HRW ranking that holds fewer than
``cap = ceil(distinct keys / nodes)`` keys. Every daemon computes the same table from the same
manifest and the same live set, so they agree on the owner without a message.

Why not plain HRW: with a few hundred chunks over 8 nodes, HRW's random shares differ by +-30 %
(bench/NOTES.md: 25 to 41 chunks of 4 MiB at N = 8). The bucket is shared fairly between the
owners' reads, so the owner with most chunks reads last, alone, and its late chunks then all
leave through its one uplink: the N = 8 timeline's tail. Bounded loads make every owner's share
equal (within one chunk) and keep HRW's ranking for everything else (who is asked next, who takes
over a chunk whose owner died).

Cost: one HRW ranking per distinct digest (``O(chunks x nodes)`` hashes), computed once per layer
and live set (``Owners`` caches the last table); above ``MAX_WORK`` hashes (a manifest of
millions of chunks) plain HRW is used, whose shares are even at that size anyway.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from bdn.proto import hrw

#: Largest ``distinct digests x nodes`` the bounded table is computed for; beyond, plain HRW.
MAX_WORK = 1 << 21
#: Tables kept (layers downloading at once, each for its current live set).
KEEP = 4


def bounded(digests: Sequence[str], nodes: Sequence[str]) -> dict[str, str]:
    """``digest -> owner`` for the distinct ``digests`` (taken in the order given): each to the
    first node of its HRW ranking among ``nodes`` holding fewer than ``ceil(distinct / nodes)``.
    ``nodes`` must not be empty."""
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


class Owners:
    """The owner of a chunk of a layer for a live set, from a cached bounded table.

    ``digests``: a callable giving the layer's digests in manifest order (called only when a
    table is built). ``owner(key, nodes, digest)`` -> the owner's node id (``key`` names the
    layer, e.g. ``(identity, layer)``; a new key or another live set rebuilds the table).
    """

    def __init__(self) -> None:
        self._tables: OrderedDict[tuple[object, tuple[str, ...]], dict[str, str]] = OrderedDict()

    def owner(self, key: object, nodes: Sequence[str], digest: str,
              digests: Callable[[], Sequence[str]], count: int) -> str | None:
        """The owner of ``digest`` among ``nodes`` for the layer ``key`` of ``count`` chunks."""
        if not nodes:
            return None
        if count * len(nodes) > MAX_WORK or len(nodes) == 1:
            return hrw.owner(nodes, digest)
        k = (key, tuple(sorted(nodes)))
        table = self._tables.get(k)
        if table is None:
            table = self._tables[k] = bounded(digests(), k[1])
            while len(self._tables) > KEEP:
                self._tables.popitem(last=False)
        else:
            self._tables.move_to_end(k)
        o = table.get(digest)
        return o if o is not None else hrw.owner(nodes, digest)

    def forget(self, key: object) -> None:
        """Drop the tables of layer ``key`` (its download ended)."""
        for k in [k for k in self._tables if k[0] == key]:
            del self._tables[k]
