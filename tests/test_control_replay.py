"""Bounded replay protection (bdn/control/replay.py)."""

from __future__ import annotations

import pytest

from bdn.control.replay import ReplayError, ReplayGuard, RequestCounter, parse_nonce


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
