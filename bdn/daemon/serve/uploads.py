"""Upload admission: whether this node sends a chunk to the peer asking now. A pure policy.

Answers (the transfer server maps them, ``bdn.daemon.serve.wire_peer``: ``SEND`` -> the bytes,
``NOT_HERE`` -> ``NOT_HERE``, the others -> ``BUSY`` with their retry-after):

- ``STILL_FETCHING``: not held yet but this node is fetching it (the asker waited): "busy, ask
  again", so it keeps waiting for this live owner instead of counting a failure and reading the
  bucket itself (retry after 1 s);
- ``SLOTS_FULL``: ``max_uploads`` uploads already run (retry after 1 s);
- ``FANNED_OUT``: this chunk already goes to ``fan_out()`` peers (``per_chunk``, or half the slots
  while fewer than half are in use): the next asker takes it from
  one of them as soon as they verified it, so chunks spread as a tree rather than every copy
  leaving the owner's uplink (retry after 0.2 s).

``admit`` books a slot for ``SEND``; every ``SEND`` must be followed by one ``done(address)``.
"""

from __future__ import annotations

import enum


class Admission(enum.Enum):
    SEND = "send"
    NOT_HERE = "not here"
    STILL_FETCHING = "still fetching"
    SLOTS_FULL = "upload slots full"
    FANNED_OUT = "chunk already uploading"

    @property
    def retry_after(self) -> str | None:
        """The retry-after value (s) a busy answer carries; None for SEND/NOT_HERE."""
        return {"STILL_FETCHING": "1", "SLOTS_FULL": "1", "FANNED_OUT": "0.2"}.get(self.name)


#: Cut-through upload slots per ``max_uploads``. An owner lands about two chunks at once (its
#: ``bucket_concurrency`` parts queue in chunk order, so the next chunk's first parts land while
#: the last ones of the chunk before do) and every node of its peer set
#: wants each: 2 x 7 askers at N = 8. With ``max_uploads`` (8) of them, the askers of half the
#: landing chunks were refused and took those chunks store-and-forward, seconds later; each
#: such copy is paced by the bucket's bytes, so more of them cost the uplink nothing extra.
GROWING_X = 2


class Uploads:
    """At most ``max_uploads`` uploads at once, at most ``per_chunk`` of one chunk, plus at most
    ``GROWING_X * max_uploads`` cut-through uploads of chunks still landing here (``admit_growing``)."""

    def __init__(self, max_uploads: int, per_chunk: int) -> None:
        self.max_uploads = max_uploads
        self.per_chunk = per_chunk
        self.running = 0  # every upload, cut-through ones included
        self.by_address: dict[str, int] = {}
        self.growing = 0  # cut-through uploads (admit_growing), their own max_uploads slots
        self.growing_by_address: dict[str, int] = {}

    def admit(self, address: str, held: bool, fetching: bool, waited: bool) -> Admission:
        """The answer for a request of ``address``: ``held`` (verified here), ``fetching`` (in
        progress here), ``waited`` (the asker asked to wait and the wait ended)."""
        if not held:
            return Admission.STILL_FETCHING if waited and fetching else Admission.NOT_HERE
        if self.running - self.growing >= self.max_uploads:
            return Admission.SLOTS_FULL
        if self.by_address.get(address, 0) >= self.fan_out():
            return Admission.FANNED_OUT
        self.running += 1
        self.by_address[address] = self.by_address.get(address, 0) + 1
        return Admission.SEND

    def admit_growing(self, address: str) -> Admission:
        """The answer for a request of ``address`` while the chunk still lands here from the
        bucket (a cut-through asker, bdn.transfer.growing): sent to as many askers as there are
        free slots, without the per-chunk fan-out: each copy runs at the rate the bucket's bytes
        land (a fraction of the uplink) and the askers would otherwise wait a whole chunk for a
        tree level. They have ``GROWING_X * max_uploads`` slots of their own, beside the ordinary ones: a
        fresh chunk's askers are not turned away by uploads of older chunks, and a chunk that
        missed its cut-through is still served while fresh ones land (with one shared budget,
        such chunks would wait until the bucket phase ended). Copies counted here
        hold the chunk's fan-out once it is verified."""
        if self.growing >= GROWING_X * self.max_uploads:
            return Admission.SLOTS_FULL
        self.running += 1
        self.growing += 1
        self.growing_by_address[address] = self.growing_by_address.get(address, 0) + 1
        self.by_address[address] = self.by_address.get(address, 0) + 1
        return Admission.SEND

    def fan_out(self) -> int:
        """Peers one chunk may go to at once now: ``per_chunk``, or half the upload slots while
        fewer than half are in use (an idle uplink sends a fresh chunk to more askers directly
        rather than leave them waiting a tree level; a busy one keeps the tree, so a late
        owner's last chunks are forwarded by their first receivers)."""
        half = self.max_uploads // 2
        return max(self.per_chunk, half) if self.running - self.growing < half else self.per_chunk

    def done(self, address: str) -> None:
        """The upload of ``address`` that ``admit`` allowed ended (sent, cut short or failed)."""
        self.running -= 1
        g = self.growing_by_address.get(address, 0)
        if g:
            self.growing -= 1
            if g > 1:
                self.growing_by_address[address] = g - 1
            else:
                del self.growing_by_address[address]
        left = self.by_address[address] - 1
        if left:
            self.by_address[address] = left
        else:
            del self.by_address[address]
