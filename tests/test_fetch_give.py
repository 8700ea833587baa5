"""The owner's side of a read taken over (``TakeOvers.give`` and the ``claim()`` of its own bucket
reads, bdn/daemon/fetch/takeover.py): a read that passed its claim is never given, a read given
is never started while the taker is live and the grant lasts, a chunk is given once, a taker
holds at most ``MAX_GRANTS`` at a time. Pure decisions on the event loop's state, with an
injected clock; the TAKE/GIVE frames travel over real sockets in
tests/test_transfer_roundtrip.py, and between real daemons in tests/test_swarm_steal.py."""

from __future__ import annotations

from types import SimpleNamespace

from bdn.daemon.config import Config
from bdn.daemon.fetch.takeover import GRANT_S, MAX_GRANTS, TakeOvers
from bdn.daemon.observe.stats import Stats
from bdn.daemon.process.clock import FakeClock
from bdn.daemon.snapshots.snapshot import STORED
from bdn.daemon.store.bitfield import Bitfield
from bdn.daemon.swarm.membership import Membership

N = 40


class Job:
    def __init__(self, identity: str = "step000001", delta: bool = False) -> None:
        self.identity = identity
        self.manifest = SimpleNamespace(is_delta=delta)
        self.stored = Bitfield(N)

    def bits(self, layer: str) -> Bitfield | None:
        return self.stored if layer == STORED else None


class NoHaves:
    def holding(self, job, layer, idx):  # noqa: ANN001, ANN201
        return []

    def growing_at(self, job, layer, idx):  # noqa: ANN001, ANN201
        return []


def _owner(clock: FakeClock, **cfg: object) -> tuple[TakeOvers, Membership]:
    ms = Membership("owner", "http://10.0.0.1:7080", [], clock)
    for i in range(3):
        ms.mark_ok(f"http://10.0.1.{i}:7080", f"taker{i}")
    t = TakeOvers(Config(node_id="owner", **cfg), ms, NoHaves(), None, Stats(), clock)  # type: ignore[arg-type]
    return t, ms


def test_a_read_started_is_never_given_and_a_read_given_is_never_started() -> None:
    clock = FakeClock()
    f, _ = _owner(clock)
    job = Job()
    assert not f.give("taker0", job.identity, 3)  # no download of it here: refused
    f.begin(job)
    claim3 = f.claim(job, STORED, 3)
    assert claim3()  # this node's read of chunk 3 takes its bucket slot ...
    assert not f.give("taker0", job.identity, 3)  # ... so it is never given
    assert f.give("taker0", job.identity, 4)
    assert not f.claim(job, STORED, 4)()  # given: this node's read of 4 gives itself up
    f.read_ended((job.identity, STORED, 3))  # the read failed (it would have set the bit): ...
    assert f.give("taker0", job.identity, 3)  # ... nobody reads it now, so it may be given
    assert f.stats.counters["bucket_reads_given"] == 2
    job.stored.set(5)
    assert not f.give("taker0", job.identity, 5)  # held here: taken from here, not the bucket
    for bad in (-1, N, 2**32 - 1):
        assert not f.give("taker0", job.identity, bad)
    assert not f.give("stranger", job.identity, 6)  # not a live member
    assert not f.give("taker0", "step000009", 6)
    f.end(job)
    assert not f.give("taker0", job.identity, 6)  # that download is over


def test_a_grant_ends_with_its_taker_or_its_time_and_is_never_given_twice() -> None:
    clock = FakeClock()
    f, ms = _owner(clock)
    job = Job()
    f.begin(job)
    assert f.give("taker0", job.identity, 7) and f.give("taker1", job.identity, 8)
    claim7, claim8 = f.claim(job, STORED, 7), f.claim(job, STORED, 8)
    assert not claim7() and not claim8()
    ms.mark_dead("http://10.0.1.1:7080")  # taker1 died before it read chunk 8
    assert claim8()  # the owner reads it after all
    clock.advance(GRANT_S - 0.5)
    assert not claim7()
    clock.advance(1.0)  # taker0 never announced it: the grant lapsed
    assert claim7()
    assert not f.give("taker2", job.identity, 7)  # reading it here now, and given once already


def test_a_taker_holds_at_most_max_grants_at_once_and_deltas_are_never_given() -> None:
    clock = FakeClock()
    f, _ = _owner(clock)
    job = Job()
    f.begin(job)
    got = [i for i in range(10, 30) if f.give("taker0", job.identity, i)]
    assert got == list(range(10, 10 + MAX_GRANTS))  # a secret holder asking for all gets a few
    assert f.give("taker1", job.identity, 30)  # the bound is per taker
    clock.advance(GRANT_S + 1)
    assert f.give("taker0", job.identity, 31)  # lapsed grants no longer count against it
    assert not f.give("taker0", job.identity, 10)  # but their chunks are not given again
    delta = Job("step000002", delta=True)
    f.begin(delta)
    assert not f.give("taker0", delta.identity, 1)
    off, _ = _owner(clock, steal_reads=False)
    off.begin(job)
    assert not off.give("taker0", job.identity, 32)
