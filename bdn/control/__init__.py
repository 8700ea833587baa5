"""bdn's control-plane policies: pure, clock-injected, no asyncio, no sockets, no threads.

Each module takes the time from an injected ``clock`` (a ``Callable[[], float]`` returning
seconds, monotonic) and returns decisions or messages; the daemon's services and the fleet
simulator (bench/fleetsim) are the only places that send them. Modules:

- :mod:`bdn.control.swim`: membership at O(1) messages per node per period (SWIM).
- :mod:`bdn.control.members`: SWIM's member table, optionally over a shared immutable fleet list.
- :mod:`bdn.control.owners`: the one owner rule (bucket readers, HRW with bounded loads among
  them), computed once per membership epoch; bdnd's fetcher and the simulator use it.
- :mod:`bdn.control.peerset`: a bounded peer set per snapshot, BITFIELD once then HAVE, rarest-first.
- :mod:`bdn.control.hotload`: hot-load targets ordered by the trainer, gossiped; status
  aggregation and pagination.
- :mod:`bdn.control.replay`: bounded replay protection for signed requests.
"""

from __future__ import annotations

from collections.abc import Callable

#: A monotonic clock's reading, in seconds (float): the daemon passes its
#: ``bdn.daemon.process.clock.Clock``'s ``monotonic``; tests and the simulator pass their own.
Now = Callable[[], float]
