"""Upload admission (bdn.daemon.serve.uploads): slots, per-chunk fan-out, "still fetching"."""

from __future__ import annotations

from bdn.daemon.serve.uploads import Admission, Uploads

A, B = "a" * 32, "b" * 32


def test_held_chunk_is_sent_and_books_a_slot() -> None:
    u = Uploads(max_uploads=2, per_chunk=2)
    assert u.admit(A, held=True, fetching=False, waited=False) is Admission.SEND
    assert u.running == 1 and u.by_address == {A: 1}
    u.done(A)
    assert u.running == 0 and u.by_address == {}


def test_not_held_is_not_here_unless_the_asker_waited_while_fetching() -> None:
    u = Uploads(2, 2)
    assert u.admit(A, held=False, fetching=False, waited=True) is Admission.NOT_HERE
    assert u.admit(A, held=False, fetching=True, waited=False) is Admission.NOT_HERE
    assert u.admit(A, held=False, fetching=True, waited=True) is Admission.STILL_FETCHING
    assert u.running == 0


def test_slots_full() -> None:
    u = Uploads(max_uploads=2, per_chunk=5)
    assert u.admit(A, True, False, False) is Admission.SEND
    assert u.admit(B, True, False, False) is Admission.SEND
    assert u.admit(A, True, False, False) is Admission.SLOTS_FULL
    u.done(B)
    assert u.admit(B, True, False, False) is Admission.SEND


def test_per_chunk_fan_out_limit() -> None:
    u = Uploads(max_uploads=8, per_chunk=2)
    # an idle uplink (fewer than half the slots in use): one chunk goes to up to half the slots
    assert [u.admit(A, True, False, False) for _ in range(5)] == [Admission.SEND] * 4 + [Admission.FANNED_OUT]
    assert u.fan_out() == 2  # 4 of 8 slots in use: busy, the tree limit holds
    assert u.admit(B, True, False, False) is Admission.SEND
    assert u.admit(B, True, False, False) is Admission.SEND
    assert u.admit(B, True, False, False) is Admission.FANNED_OUT
    u.done(A)
    u.done(A)
    assert u.running == 4 and u.admit(A, True, False, False) is Admission.FANNED_OUT  # 2 of A already
    u.done(B)
    u.done(B)
    assert u.running == 2 and u.admit(A, True, False, False) is Admission.SEND  # idle again: a 3rd copy


def test_busy_answers_carry_retry_after() -> None:
    assert Admission.STILL_FETCHING.retry_after == "1"
    assert Admission.SLOTS_FULL.retry_after == "1"
    assert Admission.FANNED_OUT.retry_after == "0.2"
    assert Admission.SEND.retry_after is None and Admission.NOT_HERE.retry_after is None


def test_a_growing_chunk_goes_to_every_asker_while_its_own_slots_last() -> None:
    """Cut-through copies (the chunk still lands from the bucket) ignore the per-chunk fan-out
    and have GROWING_X * max_uploads slots of their own: ordinary uploads are still admitted beside them."""
    from bdn.daemon.serve.uploads import GROWING_X, Admission, Uploads

    u = Uploads(max_uploads=4, per_chunk=2)
    g = GROWING_X * 4
    assert [u.admit_growing("a") for _ in range(g + 1)] == [Admission.SEND] * g + [Admission.SLOTS_FULL]
    assert [u.admit("b", True, False, False) for _ in range(3)] == [Admission.SEND] * 2 + [Admission.FANNED_OUT]
    assert u.admit("c", True, False, False) is Admission.SEND
    assert u.admit("d", True, False, False) is Admission.SEND
    assert u.admit("e", True, False, False) is Admission.SLOTS_FULL  # 4 ordinary ones run
    assert u.admit("a", True, False, False) is Admission.SLOTS_FULL
    u.done("b")
    assert u.admit("a", True, False, False) is Admission.FANNED_OUT  # g copies of "a" run already
    for _ in range(g):
        u.done("a")
    for x in ("b", "c", "d"):
        u.done(x)
    assert u.running == 0 and u.growing == 0 and u.by_address == {} and u.growing_by_address == {}
