"""Batching by size (or padded tokens) and by a wait counted from the first row."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ebb.worker.chunks.columns import VALUE, Columns
from ebb.worker.stage.batcher import Batcher, row_lengths


def chunk(uids: list[int], values: list[Any] | None = None) -> tuple[np.ndarray, Columns]:
    column = np.array(values if values is not None else uids)
    return np.asarray(uids, dtype=np.int64), {VALUE: column}


def test_a_full_batch_is_ready_at_once() -> None:
    b = Batcher(max_size=3, max_wait_s=10.0)
    b.add(*chunk([1, 2, 3, 4]), now=0.0)
    assert b.ready(0.0)
    batch = b.take()
    assert batch.uids.tolist() == [1, 2, 3]
    assert batch.columns[VALUE].tolist() == [1, 2, 3]  # cut from the chunk, in order
    assert not b.ready(0.0)
    assert len(b) == 1


def test_a_batch_joins_chunks_and_cuts_the_last() -> None:
    b = Batcher(max_size=5, max_wait_s=10.0)
    b.add(*chunk([1, 2, 3]), now=0.0, segment="s1")
    b.add(*chunk([4, 5, 6, 7]), now=0.0, segment="s2")
    batch = b.take()
    assert batch.uids.tolist() == [1, 2, 3, 4, 5]
    assert batch.columns[VALUE].tolist() == [1, 2, 3, 4, 5]
    assert dict(batch.segments) == {"s1": 3, "s2": 2}  # rows per segment, to unmap later
    b.flush()
    rest = b.take()
    assert rest.uids.tolist() == [6, 7] and dict(rest.segments) == {"s2": 2}


def test_wait_counts_from_the_first_row_and_is_not_reset() -> None:
    b = Batcher(max_size=10, max_wait_s=1.0)
    b.add(*chunk([1]), now=0.0)
    b.add(*chunk([2]), now=0.9)  # a later arrival does not push the deadline out
    assert not b.ready(0.95)
    assert b.time_left(0.95) == 1.0 - 0.95
    assert b.ready(1.0)
    assert b.take().uids.tolist() == [1, 2]


def test_flush_means_no_waiting() -> None:
    b = Batcher(max_size=10, max_wait_s=60.0)
    b.add(*chunk([1, 2]), now=0.0)
    b.flush()
    assert b.ready(0.0)
    assert len(b.take()) == 2
    b.add(*chunk([3]), now=1.0)  # the flush is spent once the batcher emptied
    assert not b.ready(1.0)


def test_solo_rows_run_alone() -> None:
    b = Batcher(max_size=10, max_wait_s=60.0)
    b.add(*chunk([1, 2]), now=0.0)
    b.add(*chunk([3, 5]), now=0.0, solo=True)
    b.add(*chunk([4]), now=0.0)
    b.flush()
    assert b.take().uids.tolist() == [1, 2]
    assert b.take().uids.tolist() == [3]
    assert b.take().uids.tolist() == [5]
    assert b.take().uids.tolist() == [4]


def sequences(lengths: list[int]) -> np.ndarray:
    column = np.empty(len(lengths), dtype=object)
    for i, n in enumerate(lengths):
        column[i] = np.ones(n, dtype=np.int64)
    return column


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(min_value=1, max_value=64), min_size=1, max_size=300),
    budget=st.integers(min_value=64, max_value=2048),
    max_size=st.integers(min_value=1, max_value=64),
    cut=st.integers(min_value=1, max_value=50),
)
def test_a_token_budget_is_never_exceeded_and_no_row_is_dropped(
    lengths: list[int], budget: int, max_size: int, cut: int
) -> None:
    b = Batcher(max_size=max_size, max_wait_s=0.0, max_tokens=budget, lengths=row_lengths("tokens"))
    uids = np.arange(len(lengths), dtype=np.int64)
    for start in range(0, len(lengths), cut):
        part = slice(start, start + cut)
        b.add(uids[part], {"tokens": sequences(lengths[part])}, now=0.0)
    seen: list[int] = []
    while b.ready(0.0):
        batch = b.take()
        longest = max(len(t) for t in batch.columns["tokens"])
        assert len(batch) * longest <= budget
        assert len(batch) <= max_size
        assert [len(t) for t in batch.columns["tokens"]] == [lengths[u] for u in batch.uids]
        seen += batch.uids.tolist()
    assert sorted(seen) == uids.tolist()
    assert len(b) == 0


def test_a_token_budget_buckets_rows_by_length() -> None:
    """Short and long rows interleaved: sorted first, so short rows are not padded to the
    long ones (one batch of each, instead of every batch at the longest length)."""
    lengths = [4, 60] * 8
    b = Batcher(max_size=64, max_wait_s=0.0, max_tokens=512, lengths=row_lengths("n"))
    b.add(np.arange(16), {"n": np.asarray(lengths)}, now=0.0)
    b.flush()
    batches = []
    while b.ready(0.0):
        batches.append(sorted(b.take().columns["n"].tolist()))
    assert batches == [[60] * 8, [4] * 8]


def test_a_row_longer_than_the_budget_runs_alone() -> None:
    b = Batcher(max_size=8, max_wait_s=0.0, max_tokens=10, lengths=row_lengths("n"))
    b.add(np.arange(3), {"n": np.asarray([2, 50, 3])}, now=0.0)
    taken = [b.take().uids.tolist() for _ in range(2)]
    assert taken == [[1], [2, 0]]


def test_adaptive_batch_size_grows_while_it_pays_and_settles() -> None:
    from ebb.worker.stage.batcher import AdaptiveBatchSize

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
