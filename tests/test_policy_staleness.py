"""The staleness bound (bdn/rl/staleness.py): which policy versions may train which step. Pure."""

from __future__ import annotations

import pytest

from bdn.rl.staleness import StalenessBound


def test_on_policy_admits_only_the_trainers_current_version() -> None:
    b = StalenessBound(0)
    assert b.min_version(0) == 0 and b.min_version(7) == 7
    assert b.admissible(7, [7])
    assert not b.admissible(7, [6])
    assert not b.admissible(7, [8])  # a policy newer than the trainer's weights: another run's


def test_a_bound_of_two_admits_two_steps_behind_and_never_below_zero() -> None:
    b = StalenessBound(2)
    assert [b.min_version(s) for s in range(5)] == [0, 0, 0, 1, 2]
    assert b.admissible(5, [3]) and b.admissible(5, [5])
    assert not b.admissible(5, [2])
    assert b.staleness(5, [3]) == 2


def test_a_rollout_from_two_policies_counts_by_the_oldest() -> None:
    b = StalenessBound(1)
    assert b.staleness(4, [2, 4]) == 2
    assert not b.admissible(4, [2, 4])
    assert b.admissible(4, [3, 4])


def test_a_rollout_without_a_version_is_never_admissible() -> None:
    b = StalenessBound(1)
    assert not b.admissible(3, [])
    with pytest.raises(ValueError, match="no policy version"):
        b.staleness(3, [])


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1", None])
def test_the_bound_must_be_a_non_negative_integer(bad: object) -> None:
    with pytest.raises(ValueError, match="max_staleness must be an integer >= 0"):
        StalenessBound(bad)  # type: ignore[arg-type]
