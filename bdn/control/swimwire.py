"""SWIM's wire values (:mod:`bdn.control.swim`): member states, updates and messages, validated.

An :class:`Update` is one member's gossiped state ``[node, status, incarnation, addr]``; a
:class:`Message` one membership message (``ping``, ``ack``, ``ping_req``, ``sync``,
``sync_ack``). :meth:`Update.from_wire` checks untrusted input (:class:`SwimError`). Split out of
``swim.py`` (fleet branch) without changing behaviour; ``bdn.control.swim`` re-exports every name.

Pure: no clock, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

ALIVE, SUSPECT, DEAD = 0, 1, 2
STATUS_NAMES = ("alive", "suspect", "dead")
KINDS = ("ping", "ack", "ping_req", "sync", "sync_ack")
MAX_NODE_ID = 128
MAX_ADDR = 512
MAX_UPDATES_PER_MESSAGE = 64
MAX_SYNC_ENTRIES = 100_000
#: The wire's largest incarnation (``Update.from_wire`` accepts ``[0, 2^63)``). A suspicion or a
#: death counts at most ``MAX_INCARNATION - 1``, so the member can always refute it with an
#: ``alive`` the wire carries: one forged ``dead`` at ``2^63 - 1`` would otherwise make it refute
#: with ``2^63``, which every receiver refuses, and leave it dead for good (tests/test_adversarial_swim.py).
MAX_INCARNATION = 2**63 - 1


class SwimError(ValueError):
    """A malformed message (from the wire: untrusted)."""


@dataclass(frozen=True)
class Update:
    """One member's state as gossiped: ``status`` is ALIVE/SUSPECT/DEAD, ``incarnation`` >= 0."""

    node: str
    status: int
    incarnation: int
    addr: str = ""

    def wire(self) -> list:
        """The update as sent: ``[node, status, incarnation, addr]`` (msgpack-able)."""
        return [self.node, self.status, self.incarnation, self.addr]

    @classmethod
    def from_wire(cls, obj: object) -> Update:
        """Parse ``[node, status, incarnation, addr]`` from a peer. Raises SwimError when malformed."""
        if not isinstance(obj, (list, tuple)) or len(obj) != 4:
            raise SwimError("update must be [node, status, incarnation, addr]")
        node, status, inc, addr = obj
        if not isinstance(node, str) or not 0 < len(node) <= MAX_NODE_ID:
            raise SwimError("update node id must be 1-128 characters")
        if status not in (ALIVE, SUSPECT, DEAD) or isinstance(status, bool):
            raise SwimError("update status must be 0, 1 or 2")
        if not isinstance(inc, int) or isinstance(inc, bool) or not 0 <= inc < 2**63:
            raise SwimError("update incarnation must be an integer in [0, 2^63)")
        if not isinstance(addr, str) or len(addr) > MAX_ADDR:
            raise SwimError("update address must be a string of at most 512 characters")
        return cls(node, status, inc, addr)


@dataclass(frozen=True)
class Message:
    """A membership message from ``src`` to ``dst``.

    ``kind``: ``ping`` (answered by ``ack`` with the same ``seq``), ``ping_req`` (ping ``target``
    for me, answer ``ack`` with my ``seq``), ``sync``/``sync_ack`` (``updates`` is the whole
    table). ``extra`` is opaque to this module: what the caller piggybacks (the hot-load target).
    """

    kind: str
    src: str
    dst: str
    seq: int = 0
    target: str = ""
    updates: tuple[Update, ...] = ()
    extra: object = None
