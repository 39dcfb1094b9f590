"""Batching by size and by a wait counted from the first item."""

from __future__ import annotations

from ebb.worker.batcher import Batcher


def test_a_full_batch_is_ready_at_once() -> None:
    b = Batcher(max_size=3, max_wait_s=10.0)
    b.add([1, 2, 3, 4], ["a", "b", "c", "d"], now=0.0)
    assert b.ready(0.0)
    assert [i.uid for i in b.take()] == [1, 2, 3]
    assert not b.ready(0.0)


def test_wait_counts_from_the_first_item_and_is_not_reset() -> None:
    b = Batcher(max_size=10, max_wait_s=1.0)
    b.add([1], ["a"], now=0.0)
    b.add([2], ["b"], now=0.9)  # a later arrival does not push the deadline out
    assert not b.ready(0.95)
    assert b.time_left(0.95) == 1.0 - 0.95
    assert b.ready(1.0)
    assert [i.uid for i in b.take()] == [1, 2]


def test_flush_means_no_waiting() -> None:
    b = Batcher(max_size=10, max_wait_s=60.0)
    b.add([1, 2], ["a", "b"], now=0.0)
    b.flush()
    assert b.ready(0.0)
    assert len(b.take()) == 2
    b.add([3], ["c"], now=1.0)  # the flush is spent once the batcher emptied
    assert not b.ready(1.0)


def test_solo_items_run_alone() -> None:
    b = Batcher(max_size=10, max_wait_s=60.0)
    b.add([1, 2], ["a", "b"], now=0.0)
    b.add([3], ["c"], now=0.0, solo=True)
    b.add([4], ["d"], now=0.0)
    b.flush()
    assert [i.uid for i in b.take()] == [1, 2]
    assert [i.uid for i in b.take()] == [3]
    assert [i.uid for i in b.take()] == [4]


def test_adaptive_batch_size_grows_while_it_pays_and_settles() -> None:
    from ebb.worker.batcher import AdaptiveBatchSize

    # Per-item cost falls until 64, then flattens: the search should settle on 64.
    def cost(size: int) -> float:
        return 0.001 + 0.05 / min(size, 64)

    sizer = AdaptiveBatchSize(max_size=512, start=8, window=4)
    seen = []
    for _ in range(200):
        size = sizer.size
        seen.append(size)
        sizer.observe(size, cost(size) * size)
    assert seen[-1] == 64
    assert max(seen) == 128  # it tried one step past the best, and came back
    current = sizer.size
    assert sizer.observe(3, 1.0) == current  # a partial batch says nothing
