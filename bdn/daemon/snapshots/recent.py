"""A set of names that keeps only the ``limit`` most recently added (issue 31: a long-lived
daemon's per-snapshot memory must be bounded by a count, not grow with every hot-load).

Used for the identities GC collected (``Catalog.collected``): a peer's hint naming one of them is
answered at once ("old here") instead of starting a fetch; one forgotten after ``limit`` newer
collections is old enough that a fetch of it fails or is refused as usual. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator


class RecentSet:
    """``add``/``discard``/``in``/``len`` like a set; adding beyond ``limit`` forgets the oldest."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.limit = limit
        self._names: OrderedDict[str, None] = OrderedDict()

    def add(self, name: str) -> None:
        """Remember ``name`` as the newest (again, if it was there); forget the oldest past ``limit``."""
        self._names[name] = None
        self._names.move_to_end(name)
        while len(self._names) > self.limit:
            self._names.popitem(last=False)

    def discard(self, name: str) -> None:
        """Forget ``name`` if it is there."""
        self._names.pop(name, None)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __len__(self) -> int:
        return len(self._names)
