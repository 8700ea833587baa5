"""bdn/control/uploadq.py: the order in which a holder serves its waiting upload requests."""

from __future__ import annotations

from collections import Counter

import pytest

from bdn.control.uploadq import next_upload


def test_the_chunk_sent_least_goes_first_the_oldest_among_equals() -> None:
    sent = Counter({7: 5, 3: 1, 9: 1})
    assert next_upload([7, 3, 9], sent) == 1  # 3 and 9 were sent once: the older, 3
    assert next_upload([7, 12, 3], sent) == 1  # 12 never sent
    assert next_upload([7, 7, 7], sent) == 0  # all equal: first come, first served
    assert next_upload([4], {}) == 0


def test_a_reader_s_queue_under_a_herd_sends_its_newest_chunk_first() -> None:
    """Every peer asks a reader for its newest chunk; FIFO would serve the older, already
    forwarded one first."""
    sent: Counter = Counter()
    queue = [10, 10, 10, 11, 11, 11]  # chunk 10 read first, 11 just read
    order = []
    while queue:
        k = next_upload(queue, sent)
        c = queue.pop(k)
        sent[c] += 1
        order.append(c)
    assert order[:2] == [10, 11]  # each leaves once before either leaves twice
    assert order == [10, 11, 10, 11, 10, 11]


def test_an_empty_queue_is_an_error() -> None:
    with pytest.raises(ValueError):
        next_upload([], {})


def test_a_request_waits_only_for_a_fresh_chunk_once() -> None:
    """may_wait: a full holder keeps a request waiting only for a chunk it is not sending now
    and that no other waiting request wants, up to the limit; the rest are told busy."""
    from bdn.control.uploadq import may_wait

    assert may_wait(7, [], {}, 8)
    assert not may_wait(7, [3, 7], {}, 8)  # one waiting request per chunk
    assert not may_wait(7, [], {7: 1}, 8)  # being sent: take it from its receivers
    assert may_wait(7, [], {7: 0, 3: 2}, 8)
    assert not may_wait(7, list(range(8)), {}, 8)  # the queue is full
    assert not may_wait(7, [], {}, 0)
