"""The expiry heap on its own: deadlines on a clock the test moves, and the backoff after an
expiry the store refused."""

from __future__ import annotations

import itertools

import pytest

from ebb.shard_master.errors import Deposed, StoreUnavailable
from ebb.shard_master.table.expiry import RETRY_MAX_S, Expiry, ExpiryHeap, retry_delay


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_backoff_doubles_from_a_fifth_of_a_second_up_to_five() -> None:
    assert [retry_delay(n) for n in range(1, 9)] == [0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0, 5.0]
    assert retry_delay(1_000) == RETRY_MAX_S


def test_entries_come_due_in_deadline_order_and_only_once_due() -> None:
    heap = ExpiryHeap(clock=Clock())
    assert heap.next_expiry() is None
    for deadline, shard in ((130.0, 2), (110.0, 0), (120.0, 1)):
        heap.push(Expiry(deadline, "j", shard, f"t{shard}"))
    assert heap.next_expiry() == 110.0
    assert heap.due(109.0) == []
    assert [e.shard for e in heap.due(120.0)] == [0, 1]
    assert heap.next_expiry() == 130.0
    assert [e.shard for e in heap.due(1_000.0)] == [2]
    assert heap.next_expiry() is None


def retry_time(heap: ExpiryHeap) -> float:
    when = heap.next_expiry()
    assert when is not None
    return when


async def test_a_failed_pass_backs_off_growing_then_a_good_one_resets() -> None:
    clock = Clock()
    heap = ExpiryHeap(clock=clock)
    heap.push(Expiry(100.0, "j", 0, "t0"))
    heap.push(Expiry(100.0, "j", 1, "t1"))
    tried: list[int] = []
    store_up = False

    async def expire(entry: Expiry) -> bool:
        tried.append(entry.shard)
        if entry.shard == 0 and not store_up:
            raise StoreUnavailable("no server heard the write")
        return True

    # The entry the store refused goes back on the heap; the other still expires.
    failed_at = clock.now
    assert await heap.expire_due(expire) == 1
    retries = [retry_time(heap)]
    for _ in range(3):
        clock.now = retries[-1] - 0.01
        assert await heap.expire_due(expire) == 0  # nothing is tried before the retry time
        clock.now = retries[-1]
        assert await heap.expire_due(expire) == 0  # tried, and refused again
        retries.append(retry_time(heap))
    assert tried == [0, 1, 0, 0, 0]
    times = [failed_at, *retries]
    gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
    assert gaps == pytest.approx([retry_delay(n) for n in (1, 2, 3, 4)])
    store_up = True
    clock.now = retry_time(heap)
    assert await heap.expire_due(expire) == 1
    assert heap.next_expiry() is None
    # The backoff starts over: a later failure waits the first delay again.
    store_up = False
    heap.push(Expiry(clock.now, "j", 0, "t0"))
    await heap.expire_due(expire)
    assert heap.next_expiry() == pytest.approx(clock.now + retry_delay(1))


async def test_a_deposed_master_leaves_every_entry_it_did_not_reach_due() -> None:
    heap = ExpiryHeap(clock=Clock())
    for shard in range(3):
        heap.push(Expiry(100.0, "j", shard, f"t{shard}"))

    async def deposed(entry: Expiry) -> bool:
        raise Deposed("another master writes our state")

    with pytest.raises(Deposed):
        await heap.expire_due(deposed)
    assert sorted(e.shard for e in heap.due(100.0)) == [0, 1, 2]
