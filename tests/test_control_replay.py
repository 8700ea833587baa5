"""Bounded replay protection (bdn/control/replay.py)."""

from __future__ import annotations

import pytest

from bdn.control.replay import Counters, ReplayError, ReplayGuard, RequestCounter, parse_nonce


class FakeClock:
    def __init__(self, t: float = 1_800_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_each_nonce_accepted_once_and_out_of_order_within_the_window() -> None:
    clock = FakeClock()
    signer, guard = RequestCounter(clock), ReplayGuard(clock, window=64)
    nonces = [signer.next() for _ in range(100)]
    for n in reversed(nonces[40:100]):  # arrive out of order, within the window
        guard.check("a", n, clock.t)
    with pytest.raises(ReplayError, match="replayed"):
        guard.check("a", nonces[70], clock.t)
    with pytest.raises(ReplayError, match="behind"):
        guard.check("a", nonces[0], clock.t)


def test_state_stays_bounded_under_a_million_requests() -> None:
    clock = FakeClock()
    guard = ReplayGuard(clock, window=1024)
    signers = [RequestCounter(FakeClock(clock.t + i)) for i in range(10)]
    for i in range(100_000):
        guard.check(f"n{i % 10}", signers[i % 10].next(), clock.t)
    assert len(guard) == 10 and guard.state_bytes() < 10 * 2 * (1024 // 8 + 200)


def test_restart_starts_a_new_window_and_old_boots_age_out() -> None:
    clock = FakeClock()
    guard = ReplayGuard(clock, boots_kept=2)
    b1 = RequestCounter(clock)
    n1 = b1.next()
    guard.check("a", n1, clock.t)
    clock.t += 1
    b2 = RequestCounter(clock)
    guard.check("a", b2.next(), clock.t)  # counter 1 again, but a newer boot
    with pytest.raises(ReplayError):
        guard.check("a", n1, clock.t)
    clock.t += 1
    guard.check("a", RequestCounter(clock).next(), clock.t)  # third boot: the first is forgotten
    with pytest.raises(ReplayError, match="boot older"):
        guard.check("a", b1.next(), clock.t)


def test_eviction_refuses_unknown_signers_with_old_timestamps() -> None:
    clock = FakeClock()
    guard = ReplayGuard(clock, max_signers=2)
    old = {n: RequestCounter(clock).next() for n in ("a", "b", "c")}
    ts = clock.t
    guard.check("a", old["a"], ts)
    guard.check("b", old["b"], ts)
    clock.t += 1
    guard.check("c", old["c"], clock.t)  # evicts a
    assert len(guard) == 2
    with pytest.raises(ReplayError, match="eviction"):
        guard.check("a", old["a"], ts)  # a replay of a's request after a was forgotten
    guard.check("a", RequestCounter(clock).next(), clock.t + 1)


def test_malformed_nonces() -> None:
    for bad in ("", "xyz", "A" * 32, "0" * 32, "0" * 31):
        with pytest.raises(ReplayError):
            parse_nonce(bad)
    assert parse_nonce("0" * 15 + "1" + "0" * 15 + "2") == (1, 2)


def test_a_boot_from_the_future_is_refused_and_cannot_lock_out_the_genuine_boots() -> None:
    """A secret holder signs nonces with boots near 2^64 for node "a": refused before any state
    is kept, so "a"'s genuine boots (its start time, scaled as Counters scales it) still pass."""
    clock = FakeClock()
    guard = ReplayGuard(clock, boots_kept=2)
    for boot in (2**64 - 1, 2**64 - 2, 2**63):
        with pytest.raises(ReplayError, match="ahead"):
            guard.check("a", f"{boot:016x}{1:016x}", clock.t)
    assert len(guard) == 0  # nothing remembered for the forged boots
    genuine = Counters(clock)
    guard.check("a", genuine.next("v", 0), clock.t)
    guard.check("a", genuine.next("v", Counters.STREAMS - 1), clock.t)  # the largest stream offset
    guard.check("c", RequestCounter(clock).next(), clock.t)  # plain µs boots are smaller still


def test_the_boot_bound_is_30_s_ahead_of_the_injected_clock() -> None:
    clock = FakeClock()
    guard = ReplayGuard(clock)
    edge = Counters(FakeClock(clock.t + 30.0))  # a signer whose clock runs 30 s ahead: accepted
    guard.check("a", edge.next("v", Counters.STREAMS - 1), clock.t)
    late = Counters(FakeClock(clock.t + 30.01))
    with pytest.raises(ReplayError, match="30 s ahead"):
        guard.check("b", late.next("v"), clock.t)
    clock.t += 1.0  # a second later the same boot is within the bound
    guard.check("b", late.next("v"), clock.t)


def test_a_lock_out_lasts_only_while_the_forger_keeps_every_window_busy() -> None:
    """8 forged boots within the next 30 s push out node "a"'s genuine window: "a" is refused
    while the forger keeps using them, and taken back (same boot, no restart) 30 s after it stops."""
    clock = FakeClock()
    guard = ReplayGuard(clock)
    genuine = Counters(clock)
    guard.check("a", genuine.next("v"), clock.t)
    forged = [Counters(FakeClock(clock.t + 1 + i)) for i in range(guard.boots_kept)]
    for f in forged:
        guard.check("a", f.next("v"), clock.t)
    for _ in range(3):  # the forger keeps every window busy: "a" stays out
        with pytest.raises(ReplayError, match="boot older"):
            guard.check("a", genuine.next("v"), clock.t)
        clock.t += 20.0
        for f in forged:
            guard.check("a", f.next("v"), clock.t)
    clock.t += 30.5  # the forger stopped 30.5 s ago: its windows can be dropped, "a" is back
    guard.check("a", genuine.next("v"), clock.t)
    guard.check("a", genuine.next("v"), clock.t)


def test_a_window_dropped_while_live_cannot_be_replayed_into() -> None:
    clock = FakeClock()
    guard = ReplayGuard(clock, boots_kept=2)
    old = RequestCounter(clock)
    captured = old.next()
    guard.check("a", captured, clock.t)
    for i in (1, 2):  # two newer boots push the live window out
        guard.check("a", RequestCounter(FakeClock(clock.t + i)).next(), clock.t)
    clock.t += 29.0  # still within the signature's skew of the captured request
    with pytest.raises(ReplayError, match="boot older"):
        guard.check("a", captured, clock.t - 29.0)
