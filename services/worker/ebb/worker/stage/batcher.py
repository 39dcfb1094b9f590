"""Batch assembly: by size (or padded tokens), and by a wait measured from the FIRST row's
arrival.

A batch is ready when it is full, when its oldest row has waited `max_wait_s`, or when the
input is known to be drained (flush) - never later. The wait is not reset by new arrivals, so
a trickle of rows cannot hold a batch back forever. Rows flagged solo run alone.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..chunks.columns import VALUE, Columns, concat, is_plain, take


@dataclass(slots=True)
class Chunk:
    """Rows that arrived together (one frame), not yet batched."""

    uids: np.ndarray
    columns: Columns
    arrived: float
    solo: bool = False
    segment: str = ""
    """Shared-memory segment its columns live in ("" when inline)."""
    lengths: np.ndarray | None = None
    """Each row's length, when batches are cut by a token budget."""


@dataclass(slots=True)
class Batch:
    uids: np.ndarray
    columns: Columns
    solo: bool = False
    segments: Counter[str] = field(default_factory=Counter)
    """Rows of the batch per shared-memory segment they came in (to unmap after the run)."""

    def __len__(self) -> int:
        return len(self.uids)


Lengths = Callable[[Columns], np.ndarray]


class Batcher:
    """Rows in, batches out; rows stay in their columnar chunks, cut where a batch ends.

    With `max_tokens`, a batch is cut by padded size: rows are bucketed by length (those
    waiting are sorted, longest first, and cut into batches whose rows x longest row stays
    within the budget), so that short rows are not padded to the length of long ones. A row
    longer than the whole budget runs alone rather than never."""

    def __init__(
        self,
        *,
        max_size: int,
        max_wait_s: float,
        max_tokens: int | None = None,
        lengths: Lengths | None = None,
    ) -> None:
        if max_size < 1:
            raise ValueError("max_size must be >= 1")
        if max_tokens is not None and (max_tokens < 1 or lengths is None):
            raise ValueError("max_tokens needs a positive budget and a way to measure rows")
        self.max_size = max_size
        self.max_wait_s = max_wait_s
        self.max_tokens = max_tokens
        self.lengths = lengths
        self._chunks: deque[Chunk] = deque()
        self._rows = 0
        self._tokens = 0
        self._cut: deque[Batch] = deque()
        """Batches already cut from sorted rows, to be taken before anything else."""
        self._flush = False

    def __len__(self) -> int:
        return self._rows + sum(len(b) for b in self._cut)

    def add(
        self,
        uids: np.ndarray,
        columns: Columns,
        now: float,
        *,
        solo: bool = False,
        segment: str = "",
    ) -> None:
        n = len(uids)
        if not n:
            return
        lengths = None
        if self.lengths is not None:
            lengths = np.asarray(self.lengths(columns), dtype=np.int64).reshape(n)
            self._tokens += int(lengths.sum())
        self._chunks.append(Chunk(uids, columns, now, solo, segment, lengths))
        self._rows += n

    def flush(self) -> None:
        """The upstream has nothing more for now: stop waiting for batches to fill."""
        if len(self):
            self._flush = True

    def ready(self, now: float) -> bool:
        if self._cut:
            return True
        if not self._chunks:
            return False
        head = self._chunks[0]
        return (
            head.solo
            or self._flush
            or self._rows >= self.max_size
            or (self.max_tokens is not None and self._tokens >= self.max_tokens)
            or now - head.arrived >= self.max_wait_s
        )

    def time_left(self, now: float) -> float | None:
        """Seconds until the oldest row's wait runs out; None when empty."""
        if self._cut:
            return 0.0
        if not self._chunks:
            return None
        return max(0.0, self._chunks[0].arrived + self.max_wait_s - now)

    def take(self) -> Batch:
        """The next batch: a solo row alone, else up to max_size rows in arrival order (or,
        with a token budget, the next of the batches cut from the rows sorted by length)."""
        if not self._cut and self._chunks:
            if self._chunks[0].solo:
                self._cut.append(self._take_rows(1, solo=True))
            elif self.max_tokens is None:
                self._cut.append(self._take_rows(self.max_size))
            else:
                self._cut.extend(self._cut_by_tokens())
        batch = self._cut.popleft() if self._cut else Batch(np.empty(0, np.int64), {})
        if not len(self):
            self._flush = False
        return batch

    def _take_rows(self, limit: int, *, solo: bool = False) -> Batch:
        """Up to `limit` rows from the head, stopping before a solo chunk."""
        uids: list[np.ndarray] = []
        parts: list[Columns] = []
        segments: Counter[str] = Counter()
        taken = 0
        while self._chunks and taken < limit:
            chunk = self._chunks[0]
            if chunk.solo != solo and taken:
                break
            n = len(chunk.uids)
            k = min(n, limit - taken)
            if k == n:
                self._chunks.popleft()
                uids.append(chunk.uids)
                parts.append(chunk.columns)
            else:
                uids.append(chunk.uids[:k])
                parts.append(take(chunk.columns, slice(0, k)))
                chunk.uids = chunk.uids[k:]
                chunk.columns = take(chunk.columns, slice(k, None))
                if chunk.lengths is not None:
                    chunk.lengths = chunk.lengths[k:]
            if chunk.segment:
                segments[chunk.segment] += k
            taken += k
            if solo:
                break
        self._rows -= taken
        joined = uids[0] if len(uids) == 1 else np.concatenate(uids)
        return Batch(joined, concat(parts), solo, segments)

    def _cut_by_tokens(self) -> list[Batch]:
        """Every waiting row up to the first solo chunk, sorted by length and cut into
        batches within the budget. The rows are copied out of their chunks (sorting
        gathers them), so their shared memory is free with the first batch."""
        assert self.max_tokens is not None
        chunks: list[Chunk] = []
        while self._chunks and not self._chunks[0].solo:
            chunks.append(self._chunks.popleft())
        uids = np.concatenate([c.uids for c in chunks])
        lengths = np.concatenate([c.lengths for c in chunks if c.lengths is not None])
        columns = concat([c.columns for c in chunks])
        segments = Counter({c.segment: 0 for c in chunks if c.segment})
        for c in chunks:
            if c.segment:
                segments[c.segment] += len(c.uids)
        self._rows -= len(uids)
        self._tokens -= int(lengths.sum())
        order = np.argsort(-lengths, kind="stable")
        batches: list[Batch] = []
        start = 0
        while start < len(order):
            longest = max(int(lengths[order[start]]), 1)
            fits = max(1, min(self.max_size, self.max_tokens // longest))
            index = order[start : start + fits]
            batches.append(Batch(uids[index], take(columns, index)))
            start += fits
        batches[0].segments = segments
        return batches


class AdaptiveBatchSize:
    """Finds, online, the batch size that costs least per item (maximises items/s).

    Starts small and doubles while a full batch gets cheaper per item by more than
    `tolerance`; steps back when a larger size is no better; re-probes now and then, since
    the best size moves with the data. Only full batches count: a batch cut short by its
    wait says nothing about what a bigger one would cost.
    """

    def __init__(
        self, *, max_size: int, start: int = 8, window: int = 8, tolerance: float = 0.05
    ) -> None:
        self.max_size = max_size
        self.size = min(start, max_size)
        self.window = window
        self.tolerance = tolerance
        self.cost: dict[int, float] = {}
        """Median seconds per item at each size tried."""
        self._samples: list[float] = []
        self._windows = 0

    def observe(self, items: int, seconds: float) -> int:
        """A batch of `items` ran in `seconds`. Returns the size to use next."""
        if items != self.size or items == 0:
            return self.size
        self._samples.append(seconds / items)
        if len(self._samples) < self.window:
            return self.size
        self._samples.sort()
        self.cost[self.size] = self._samples[len(self._samples) // 2]
        self._samples.clear()
        self._windows += 1
        if self._windows % 50 == 0:
            self.cost = {self.size: self.cost[self.size]}  # the data may have changed
        self.size = self._next()
        return self.size

    def _next(self) -> int:
        here = self.cost[self.size]
        smaller, bigger = self.size // 2, min(self.size * 2, self.max_size)
        if smaller in self.cost and self.cost[smaller] <= here * (1 + self.tolerance):
            return smaller  # the last doubling bought nothing: back down (less latency)
        if bigger != self.size and (
            bigger not in self.cost or self.cost[bigger] < here * (1 - self.tolerance)
        ):
            return bigger
        return self.size


def row_lengths(column_name: str) -> Callable[[Columns], np.ndarray]:
    """How long each row is, for a token budget: the length of its sequence in a column of
    sequences, or the value of a column of lengths."""

    def lengths(batch: Columns) -> np.ndarray:
        if column_name in batch:
            column = batch[column_name]
        elif is_plain(batch):
            column = batch[VALUE]
        else:
            raise KeyError(f"rows have no column {column_name!r} to measure their length")
        if column.dtype == object:
            return np.fromiter((len(v) for v in column), dtype=np.int64, count=len(column))
        if column.ndim == 1:
            return column.astype(np.int64)
        return np.full(len(column), column.shape[1], dtype=np.int64)

    return lengths
