"""Who reads which chunk of a layer from the bucket: bdnd's cache of the one owner rule.

The rule itself (HRW with bounded loads among the bucket readers, pure) is
:mod:`bdn.control.owners` (:func:`~bdn.control.owners.owner_table`), shared with the fleet
simulator (bench/fleetsim) so the daemon and the simulation pick the same owners. Here: one
table per layer and live set (``Owners`` keeps the last ``KEEP``); every daemon computes the same
table from the same manifest and the same live set, so they agree on the owner without a message.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import cast

from bdn.control.owners import MAX_WORK, bounded, owner_table, slot_of, slot_table
from bdn.proto import hrw

__all__ = ["KEEP", "MAX_WORK", "Owners", "bounded"]

#: Tables kept (layers downloading at once, each for its current live set).
KEEP = 4


class Owners:
    """The owner of a chunk of a layer for a live set, from a cached bounded table.

    ``digests``: a callable giving the layer's digests in manifest order (called only when a
    table is built). ``owner(key, nodes, digest)`` -> the owner's node id (``key`` names the
    layer, e.g. ``(identity, layer)``; a new key or another live set rebuilds the table).
    """

    def __init__(self) -> None:
        # (key, nodes) -> owner table; (key, "slots", count) -> slot table
        self._tables: OrderedDict[tuple[object, ...], dict[str, str] | dict[str, int]] = OrderedDict()

    def owner(
        self, key: object, nodes: Sequence[str], digest: str, digests: Callable[[], Sequence[str]], count: int
    ) -> str | None:
        """The owner of ``digest`` among ``nodes`` for the layer ``key`` of ``count`` chunks."""
        if not nodes:
            return None
        if count * len(nodes) > MAX_WORK or len(nodes) == 1:
            return hrw.owner(nodes, digest)
        k = (key, tuple(sorted(nodes)))
        table = cast("dict[str, str] | None", self._tables.get(k))  # a (key, nodes) key holds an owner table
        if table is None:
            table = self._tables[k] = owner_table(digests(), k[1])
            while len(self._tables) > KEEP:
                self._tables.popitem(last=False)
        else:
            self._tables.move_to_end(k)
        o = table.get(digest)
        return o if o is not None else hrw.owner(nodes, digest)

    def slot_owner(
        self, key: object, readers: Sequence[str], digest: str, digests: Callable[[], Sequence[str]], count: int
    ) -> str | None:
        """The owner of ``digest`` when a subset reads (``bucket_readers``): ``readers`` are the
        holders of the layer's reader slots in slot order (:func:`bdn.control.owners.readers_of`),
        and the chunk's slot comes from the layer's slot table (equal shares, independent of the
        membership: built once per layer and slot count)."""
        if not readers:
            return None
        k = (key, "slots", len(readers))
        table = cast("dict[str, int] | None", self._tables.get(k))  # a (key, "slots", n) key holds a slot table
        if table is None:
            table = self._tables[k] = slot_table(digests(), len(readers)) if count * len(readers) <= MAX_WORK else {}
            while len(self._tables) > KEEP:
                self._tables.popitem(last=False)
        return readers[slot_of(digest, len(readers), table)]

    def forget(self, key: object) -> None:
        """Drop the tables of layer ``key`` (its download ended)."""
        for k in [k for k in self._tables if k[0] == key]:
            del self._tables[k]
