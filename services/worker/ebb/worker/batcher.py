"""Batch assembly: by size, and by a wait measured from the FIRST item's arrival.

A batch is ready when it is full, when its oldest item has waited `max_wait_s`, or when the
input is known to be drained (flush) - never later. The wait is not reset by new arrivals, so
a trickle of items cannot hold a batch back forever. Items flagged solo run alone.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class Item:
    uid: int
    value: Any
    arrived: float
    solo: bool = False
    segment: str = ""
    """Shared-memory segment its value lives in ("" when inline)."""


class Batcher:
    def __init__(self, *, max_size: int, max_wait_s: float) -> None:
        if max_size < 1:
            raise ValueError("max_size must be >= 1")
        self.max_size = max_size
        self.max_wait_s = max_wait_s
        self._items: deque[Item] = deque()
        self._flush = False

    def __len__(self) -> int:
        return len(self._items)

    def add(
        self,
        uids: list[int],
        values: list[Any],
        now: float,
        *,
        solo: bool = False,
        segment: str = "",
    ) -> None:
        self._items.extend(
            Item(u, v, now, solo, segment) for u, v in zip(uids, values, strict=True)
        )

    def flush(self) -> None:
        """The upstream has nothing more for now: stop waiting for batches to fill."""
        if self._items:
            self._flush = True

    def ready(self, now: float) -> bool:
        if not self._items:
            return False
        head = self._items[0]
        return (
            head.solo
            or self._flush
            or len(self._items) >= self.max_size
            or now - head.arrived >= self.max_wait_s
        )

    def time_left(self, now: float) -> float | None:
        """Seconds until the oldest item's wait runs out; None when empty."""
        if not self._items:
            return None
        return max(0.0, self._items[0].arrived + self.max_wait_s - now)

    def take(self) -> list[Item]:
        """The next batch: a solo item alone, else up to max_size items in arrival order."""
        if not self._items:
            return []
        if self._items[0].solo:
            batch = [self._items.popleft()]
        else:
            batch = []
            while self._items and len(batch) < self.max_size and not self._items[0].solo:
                batch.append(self._items.popleft())
        if not self._items:
            self._flush = False
        return batch


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
